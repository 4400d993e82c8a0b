"""What an ingest writes, as digests: the proof that refactoring the ingest keeps its stores bit for bit.

The cases: the real F3 crop (``shared/data/segy/f3.sgy``) and a generated survey with holes (a whole brick
column among them), dead (all-zero) traces and NaN samples, in float32, int8 and float16, in both layouts
(sfm, mdio), plus the registration of an MDIO-layout store (its reference group). Each is ingested in one
task (:func:`sfm.ingest.survey.ingest_survey`) and by the parts functions (:mod:`sfm.ingest.parts`) in
several part counts; every run must give the digests recorded in ``tests/data/ingest_digests.json``.

What a store holds that depends on where the run happens is masked, never dropped: the source's path
(``source_url``, an MDIO reference's ``amplitude_url``) becomes ``<source>`` and the data root ``<root>``,
in the JSON objects and the manifest row. Left out: the manifest row's ``ingested_at`` (wall-clock time,
and so the row's parquet object). Nothing else in a store depends on the clock or the host (the writers'
temporary names do, but they never stay).

Regenerate the fixture (only when a change of the stores is meant), from the project root:

    cd tests && PYTHONPATH=.. python -m support.ingest_digests
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from conftest import SEGY_DIR
from support import ingest_cases as cases

from sfm.config import IngestConfig
from sfm.formats import manifest, segy
from sfm.ingest import parts
from sfm.synth import survey as synth
from sfm.ingest.survey import ingest_survey

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "ingest_digests.json"
PART_COUNTS = (1, 2, 3)
HOLES_SHAPE = (40, 36, 70)  # 5 x 5 brick columns of 8^3 (the last ones partial)

# name -> (source, ingest settings, piece bytes of the content digest: 0 for segy.PIECE_BYTES)
CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "f3-float32-sfm": ("f3", {"chunk": 8}, 0),
    "f3-int8-sfm": ("f3", {"chunk": 8, "dtype": "int8"}, 0),
    "f3-float16-sfm": ("f3", {"chunk": 8, "dtype": "float16"}, 0),
    "f3-float32-mdio": ("f3", {"chunk": 8, "layout": "mdio"}, 0),
    "holes-float32-sfm": ("holes", {"chunk": 8}, 0),
    "holes-int8-sfm": ("holes", {"chunk": 8, "dtype": "int8"}, 0),
    "holes-float16-mdio": ("holes", {"chunk": 8, "dtype": "float16", "layout": "mdio", "domain": "depth"}, 0),
    "holes-int8-mdio": ("holes", {"chunk": 8, "dtype": "int8", "layout": "mdio"}, 0),
    "holes-float32-sfm-pieces": ("holes", {"chunk": 8}, 64 << 10),  # several scan parts: 12 pieces of 64 KiB
    "register-f3-mdio": ("f3.mdio", {}, 0),  # an MDIO-layout store registered: the reference group
}


def holes_survey(path: Path) -> Path:
    """A generated survey (``sfm synth``'s path) of :data:`HOLES_SHAPE`, then edited: 30 scattered traces and
    the whole brick column inlines 8-15 x crosslines 8-15 removed, 5 traces zeroed, 3 samples NaN in each of 3 traces."""
    ni, nx, ns = HOLES_SHAPE
    synth.synth_survey(path, shape=HOLES_SHAPE, seed=11)
    head, records = cases.traces(path, ns)
    rng = np.random.default_rng(3)
    records[rng.choice(ni * nx, 5, replace=False), cases.TRACE_HEADER:] = 0  # dead traces
    for trace in rng.choice(ni * nx, 3, replace=False):
        cases.set_samples(records, int(trace), rng.choice(ns, 3, replace=False), np.nan)
    keep = np.ones(ni * nx, dtype=bool)
    keep[rng.choice(keep.size, 30, replace=False)] = False
    il, xl = np.divmod(np.arange(ni * nx), nx)
    keep[(il >= 8) & (il < 16) & (xl >= 8) & (xl < 16)] = False
    return cases.rewrite(path, head, records[keep])


def sources(folder: Path) -> dict[str, str]:
    """{source name: path}: the F3 crop where it is, the holes survey written into ``folder``, and an MDIO-layout
    store of the F3 crop whose ``source_url`` names the file only (the store's identity hashes its metadata, so
    the path of the folder it was written from would change the survey id)."""
    folder.mkdir(parents=True, exist_ok=True)
    made = {"f3": str(SEGY_DIR / "f3.sgy"), "holes": str(holes_survey(folder / "holes.sgy"))}
    out = folder / "f3.mdio"
    if not out.exists():
        row = ingest_survey(made["f3"], str(folder / "mdio-root"), chunk=8, layout="mdio")
        shutil.copytree(row["store_url"], out)
        meta = json.loads((out / "zarr.json").read_text())
        meta["attributes"]["source_url"] = "f3.sgy"
        (out / "zarr.json").write_text(json.dumps(meta, indent=2))
    made["f3.mdio"] = str(out)
    return made


@contextlib.contextmanager
def piece_bytes(size: int):
    """The content digest's piece size set to ``size`` (0: unchanged) while the block runs."""
    saved = segy.PIECE_BYTES
    segy.PIECE_BYTES = size or saved
    try:
        yield
    finally:
        segy.PIECE_BYTES = saved


def ingest(case: str, source: str, root: Path, n_parts: int = 0) -> dict[str, Any]:
    """Ingest ``case`` from ``source`` into the data root ``root``: in one task (``n_parts`` 0) or by the parts
    functions in ``n_parts`` parts (scanned and written in reverse order); the manifest row."""
    _, settings, pieces = CASES[case]
    cfg = IngestConfig(**settings)
    kind = "mdio" if source.endswith(".mdio") else "segy"
    with piece_bytes(pieces):
        if n_parts == 0:
            survey_id = ingest_survey(source, str(root), cfg)["survey_id"]
        else:
            scans = parts.plan_scans(source, "proof", str(root), cfg, parts=n_parts, kind=kind)
            writes = parts.plan_writes([parts.scan_part(s, cfg) for s in reversed(scans)], str(root), cfg)
            for part in reversed(writes):
                parts.write_part(part, cfg)
            survey_id = parts.publish_parts(writes, str(root))["survey_id"]
    return manifest.get_row(str(root), survey_id)


def record(row: dict[str, Any], source: str, root: Path) -> dict[str, Any]:
    """What the fixture keeps of one ingest: the store's objects' sha256 by relative path, the manifest row
    (minus ``ingested_at``) and the list of what the data root holds under ``surveys/``."""
    masks = {source: "<source>", str(root): "<root>"}
    store = Path(row["store_url"])
    objects = {}
    for path in sorted(p for p in store.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == "zarr.json":
            data = mask(data.decode(), masks).encode()
        objects[str(path.relative_to(store))] = hashlib.sha256(data).hexdigest()
    kept = {k: mask(v, masks) if isinstance(v, str) else v for k, v in row.items() if k != "ingested_at"}
    return {"objects": objects, "row": kept, "surveys": sorted(p.name for p in (root / "surveys").iterdir())}


def mask(text: str, masks: dict[str, str]) -> str:
    for value in sorted(masks, key=len, reverse=True):
        text = text.replace(value, masks[value])
    return text


def source_digest(path: str) -> str:
    """sha256 of a source: the file's, or an MDIO store's objects' (relative path and bytes)."""
    target = Path(path)
    digest = hashlib.sha256()
    for item in sorted(p for p in target.rglob("*") if p.is_file()) if target.is_dir() else [target]:
        digest.update(str(item.relative_to(target) if target.is_dir() else item.name).encode())
        digest.update(item.read_bytes())
    return digest.hexdigest()


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        made = sources(Path(tmp) / "sources")
        fixture: dict[str, Any] = {"sources": {name: source_digest(path) for name, path in made.items()}, "cases": {}}
        for case, (name, _, _) in CASES.items():
            root = Path(tmp) / case
            fixture["cases"][case] = record(ingest(case, made[name], root), made[name], root)
            print(case, fixture["cases"][case]["row"]["survey_id"], len(fixture["cases"][case]["objects"]), "objects")
    FIXTURE.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    main()
