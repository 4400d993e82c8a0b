"""The crops the data path delivers, as sha256 digests: the proof that a change of the loader keeps them bit for bit.

Each case is a job's ``[data]`` settings (and where the stream sits: rank, start batch, epoch, slab)
over small survey stores built here from the project's synthetic generator, with traces missing from
the SEG-Y file and bricks cut short at the surveys' far edges. A case's digest covers every batch the
stream delivers, in order (for int8 batches, the stored values and each sample's affine). Elementwise
float operations are exact on any x86 host, so the digests hold wherever the tests run.

Regenerate tests/data/crop_digests.json (only when the crops are meant to change)::

    cd tests && PYTHONPATH=..:$PYTHONPATH python -m support.crop_digests
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import zarr

from support.crop_stores import survey_with_holes
from sfm import data
from sfm.config import JobConfig

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "crop_digests.json"
ALL = ",".join(data.AUGMENTATIONS)
# two surveys: partial edge bricks along crossline (40 = 2.5 bricks of 16), and along every axis
SURVEYS = (((48, 40, 64), 0), ((44, 38, 56), 1))


def _cases() -> dict[str, dict]:
    """name -> {"data": [data] settings, "stores": which stores, and the stream's place (rank, world,
    start, epoch, slab, batches)}."""
    cases: dict[str, dict] = {
        "voxel": {"data": {"augment": ""}},
        "brick": {"data": {"augment": "", "align": "brick"}},
        "all-voxel": {"data": {"augment": ALL}},
        "all-brick": {"data": {"augment": ALL, "align": "brick", "crop": [32, 32, 16]}},
        "flip_inline,reverse_time": {"data": {"augment": "flip_inline,reverse_time"}},
        "swap,invert_polarity": {"data": {"augment": "swap,invert_polarity"}},
        "flip_crossline,swap,reverse_time": {"data": {"augment": "flip_crossline,swap,reverse_time"}},
        "flips,invert_polarity-brick": {"data": {"augment": "flip_inline,flip_crossline,invert_polarity",
                                                 "align": "brick"}},
        "swap-oblong": {"data": {"augment": ALL, "crop": [16, 24, 8]}},  # D != H: never swapped
        "live-0.9": {"data": {"augment": ALL, "min_live_fraction": 0.9}},
        "live-0": {"data": {"augment": ALL, "min_live_fraction": 0.0, "seed": 3}},
        "rank1-of-2-start3": {"data": {"augment": ALL, "seed": 5}, "rank": 1, "world": 2, "start": 3},
        "epoch2": {"data": {"augment": ALL}, "epoch": 2},
        "float16": {"data": {"augment": ALL, "batch_dtype": "float16"}},
        "int8": {"data": {"augment": ALL, "batch_dtype": "int8"}, "stores": "int8"},
        "int8-stores-float32": {"data": {"augment": ALL}, "stores": "int8"},
        "int8-stores-float16": {"data": {"augment": ALL, "batch_dtype": "float16"}, "stores": "int8"},
        "float16-stores": {"data": {"augment": ALL}, "stores": "float16"},
        "zarr-read": {"data": {"augment": ALL}, "stores": "zarr"},  # a layout the brick reader leaves to zarr
        "cache": {"data": {"augment": ALL, "cache_mb": 64}},
        "cache-tight": {"data": {"augment": ALL, "cache_mb": 1, "seed": 2}, "batches": 5},
        "cache-float16": {"data": {"augment": ALL, "cache_mb": 64, "batch_dtype": "float16"}},
        "cache-int8": {"data": {"augment": ALL, "cache_mb": 64, "batch_dtype": "int8"}, "stores": "int8"},
        "slab": {"data": {"augment": ALL, "crop": [24, 24, 16]}, "slab": [8, 16]},
        "slab-brick": {"data": {"augment": ALL, "crop": [32, 32, 16], "align": "brick"}, "slab": [0, 16]},
        "workers": {"data": {"augment": ALL, "workers": 2}, "batches": 4},
    }
    regions = {
        "k4": {"crops_per_region": 4},
        "k2-bricks-1x2x3-lanes6": {"crops_per_region": 2, "region_bricks": [1, 2, 3], "regions_in_flight": 6},
        "k3-bricks-3x1x2-brick": {"crops_per_region": 3, "region_bricks": [3, 1, 2], "align": "brick"},
        "k8-lanes5": {"crops_per_region": 8, "regions_in_flight": 5},
    }
    for name, settings in regions.items():
        cases[f"regions-{name}"] = {"data": {"augment": ALL, **settings}, "batches": 6}
    cases["regions-k4-float16"] = {"data": {"augment": ALL, "crops_per_region": 4, "batch_dtype": "float16"}}
    cases["regions-k4-int8"] = {"data": {"augment": ALL, "crops_per_region": 4, "batch_dtype": "int8"},
                                "stores": "int8"}
    cases["regions-k4-cache"] = {"data": {"augment": ALL, "crops_per_region": 4, "cache_mb": 64}}
    cases["regions-k4-zarr-read"] = {"data": {"augment": ALL, "crops_per_region": 4}, "stores": "zarr"}
    cases["regions-k4-slab"] = {"data": {"augment": ALL, "crops_per_region": 4, "crop": [24, 24, 16]},
                                "slab": [16, 24]}
    cases["regions-k4-rank1-of-2-start2"] = {"data": {"augment": ALL, "crops_per_region": 4}, "rank": 1,
                                             "world": 2, "start": 2}
    cases["regions-k4-workers-int8"] = {"data": {"augment": ALL, "crops_per_region": 4, "workers": 2,
                                                 "batch_dtype": "int8"}, "stores": "int8", "batches": 4}
    return cases


CASES = _cases()


def build_stores(tmp: Path) -> SimpleNamespace:
    """The stores the cases read: float32, float16 and int8 ingests of the same two holed SEG-Y files,
    and the float32 ones rewritten big-endian and unsharded (read through zarr, not the brick reader)."""
    urls: dict[str, list[str]] = {"float32": [], "float16": [], "int8": [], "zarr": []}
    for shape, seed in SURVEYS:
        for dtype in ("float32", "float16", "int8"):
            (tmp / dtype).mkdir(parents=True, exist_ok=True)
            url, _, _ = survey_with_holes(tmp / dtype, str(tmp / dtype / "root"), shape=shape, seed=seed,
                                          chunk=16, dtype=dtype)
            urls[dtype].append(url)
        urls["zarr"].append(_big_endian_copy(urls["float32"][-1], tmp / "zarr" / f"{seed}.zarr"))
    return SimpleNamespace(tmp=tmp, urls=urls)


def _big_endian_copy(url: str, path: Path) -> str:
    """The store at ``url`` with its amplitude in unsharded big-endian 16^3 chunks, attributes kept."""
    source = zarr.open_group(url, mode="r")
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    values = source["amplitude"][...]
    amp = group.create_array("amplitude", shape=values.shape, chunks=(16, 16, 16), dtype=values.dtype,
                             fill_value=0, serializer=zarr.codecs.BytesCodec(endian="big"))
    amp[...] = values
    group.create_array("trace_mask", data=source["trace_mask"][...])
    attrs = dict(source.attrs)
    attrs["store"] = {**attrs["store"], "bricks": [16, 16, 16], "shards": [16, 16, 16], "codec": "big-endian zstd"}
    group.attrs.update(attrs)
    return str(path)


def store_digest(url: str) -> str:
    """sha256 of a store's amplitude values, trace mask and statistics: what the crops are cut from."""
    group = zarr.open_group(url, mode="r")
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(group["amplitude"][...]).tobytes())
    h.update(np.ascontiguousarray(group["trace_mask"][...]).tobytes())
    h.update(json.dumps(dict(group.attrs)["stats"], sort_keys=True).encode())
    return h.hexdigest()


def case_digest(stores: SimpleNamespace, name: str) -> str:
    """sha256 over every batch case ``name``'s stream delivers, in order."""
    case = CASES[name]
    settings = {"crop": [16, 16, 16], "batch_size": 4, "pool_dir": str(stores.tmp / "pools" / name),
                **case["data"]}
    kind = case.get("stores", "float32")
    cfg = JobConfig.from_dict({"data": settings, "ingest": {"dtype": "int8" if kind == "int8" else "float32"}})
    cfg.validate()
    slab = tuple(case["slab"]) if "slab" in case else None
    stream = data.training_stream(stores.urls[kind], cfg.data, rank=case.get("rank", 0),
                                  world_size=case.get("world", 1), start_batch=case.get("start", 0), slab=slab)
    h = hashlib.sha256()
    try:
        if case.get("epoch"):
            stream.set_epoch(case["epoch"])
        for _ in range(case.get("batches", 3)):
            batch = next(stream)
            parts = (batch.values, batch.affine) if hasattr(batch, "affine") else (batch,)
            for part in parts:
                h.update(str(tuple(part.shape)).encode() + str(part.dtype).encode())
                h.update(part.contiguous().numpy().tobytes())
    finally:
        stream.close()
    return h.hexdigest()


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=FIXTURE.parent).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="sfm-crop-digests-") as tmp:
        stores = build_stores(Path(tmp))
        out = {"commit": commit,
               "stores": {f"{kind}-{n}": store_digest(url) for kind, urls in stores.urls.items()
                          for n, url in enumerate(urls)},
               "cases": {name: case_digest(stores, name) for name in CASES}}
    FIXTURE.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{FIXTURE}: {len(out['cases'])} cases, {len(out['stores'])} stores at {commit}", file=sys.stderr)


if __name__ == "__main__":
    main()
