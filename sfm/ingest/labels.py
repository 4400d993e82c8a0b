"""Label volumes aligned with a survey, ingested like surveys: validated against the survey's grid,
content-addressed, stored, and published through the manifest.

    row = ingest_labels("faults.sgy", "<survey id or store URL>", "sfm_data", ignore=-1)

A label set is a class per voxel of one survey (0..254), or 255: not interpreted. Labels may be sparse,
some inlines or crosslines only; every voxel the source leaves out (a missing trace, the source's
``ignore`` value, 255 itself, a trace the survey lacks) is stored as 255. Sources: a SEG-Y file with the
survey's geometry, a ``.npy`` on its grid, or an integer variable of a Zarr or MDIO store
(:mod:`sfm.ingest.label_sources`).

Two passes over the source, in bounded memory (a run of inlines at a time):

1. every value is checked (a whole number, a class or the ignore value) and the classes are digested:
   ``label_id`` is the first 16 hex digits of the BLAKE3 of the survey id, the shape and the stored
   labels, so the same labels of one survey are one label set whatever file they came from;
2. unless that label set is published already, the store is written at ``<data-root>/labels/<label_id>.zarr``
   (``labels`` uint8 [inline, crossline, sample] chunked like the survey's bricks, ``label_mask`` [inline,
   crossline], the survey's coordinates; root attributes last, sfm/data_contracts/label_store.schema.json),
   then its manifest row (sfm/data_contracts/label_row.schema.json), last and atomically.

A source that does not fit is refused in the first pass, before anything is written; a label set without
its row is invisible, so nothing half-written is ever read.
"""

from __future__ import annotations

import datetime as dt
import time
import warnings
from typing import Any

import numpy as np

from sfm import storage
from sfm.config import LABEL_IGNORE, IngestConfig
from sfm.errors import SFMError
from sfm.formats import manifest
from sfm.formats.contracts import validate
from sfm.ingest.label_sources import SurveyGrid, open_source, refuse, survey_grid

LABELS_VERSION = 1
MAX_CLASS = LABEL_IGNORE - 1


def label_name(url: str) -> str:
    """The label set's display name: the source's file name without its suffix."""
    base = storage.normalize(url).rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".npy", ".sgy", ".segy", ".zarr", ".mdio", ".SGY", ".SEGY"):
        base = base[: -len(suffix)] if base.endswith(suffix) else base
    return "".join("_" if ord(ch) < 32 or ord(ch) == 127 else ch for ch in base) or "labels"


def classes_of(values: np.ndarray, present: np.ndarray, ignore: int | None, where: tuple[str, SurveyGrid, int]
               ) -> np.ndarray:
    """Raw label values [n, XL, NS] of inlines i0.. (``where``: source URL, grid, i0) -> uint8 classes, 255
    where not interpreted: traces not ``present`` or the survey lacks, ``ignore`` and 255. Anything else
    that is not a whole number in 0..254 is refused, naming its position."""
    url, grid, i0 = where
    skip = ~(present & grid.trace_mask[i0:i0 + len(values)])[..., None] | (values == LABEL_IGNORE)
    if ignore is not None:
        skip |= values == ignore
    bad = ~skip & ((values < 0) | (values > MAX_CLASS))
    if np.issubdtype(values.dtype, np.floating):
        bad |= ~skip & ~(np.floor(values) == values)  # NaN too
    if bad.any():
        i, j, k = np.unravel_index(int(np.argmax(bad)), bad.shape)
        raise refuse(url, f"value {values[i, j, k]} at inline {grid.inlines[i0 + i]}, crossline {grid.crosslines[j]}, "
                     f"sample {k} is not a class (a whole number 0..{MAX_CLASS}) nor the ignore value "
                     f"({ignore if ignore is not None else 'none given'}; {LABEL_IGNORE} always)",
                     "store one integer class per sample, or pass --ignore with the value of unlabelled samples")
    return np.where(skip, LABEL_IGNORE, values).astype(np.uint8)


def _blocks(source, grid: SurveyGrid, ignore: int | None):
    """(i0, classes uint8 [n, XL, NS]) for every run of ``grid.bricks[0]`` inlines, in order."""
    step = grid.bricks[0]
    for i0 in range(0, grid.shape[0], step):
        i1 = min(grid.shape[0], i0 + step)
        values, present = source.block(i0, i1)
        yield i0, classes_of(values, present, ignore, (source.url, grid, i0))


def measure(source, grid: SurveyGrid, ignore: int | None) -> dict[str, Any]:
    """The first pass: every value checked; the digest, class counts and label mask of the label set."""
    import blake3

    h = blake3.blake3()
    h.update(f"sfm-labels {LABELS_VERSION} survey {grid.survey_id} shape {list(grid.shape)}\n".encode())
    counts = np.zeros(LABEL_IGNORE + 1, np.int64)
    mask = np.zeros(grid.shape[:2], bool)
    for i0, block in _blocks(source, grid, ignore):
        h.update(block.tobytes())
        counts += np.bincount(block.ravel(), minlength=LABEL_IGNORE + 1)
        mask[i0:i0 + len(block)] = (block != LABEL_IGNORE).any(axis=2)
    labelled = int(counts[:LABEL_IGNORE].sum())
    if labelled == 0:
        raise refuse(source.url, f"holds no labelled sample for survey {grid.name}",
                     "check --ignore and that the traces sit on the survey's lines")
    present = np.flatnonzero(counts[:LABEL_IGNORE])
    return {"checksum": f"blake3:{h.hexdigest()}", "classes": present.tolist(),
            "class_voxels": counts[: int(present[-1]) + 1].tolist(), "labelled_voxels": labelled,
            "labelled_inlines": int(mask.any(axis=1).sum()), "labelled_crosslines": int(mask.any(axis=0).sum()),
            "mask": mask}


def write_store(store_url: str, source, grid: SurveyGrid, ignore: int | None, attrs: dict[str, Any],
                mask: np.ndarray) -> None:
    """The second pass: the store's arrays, then its root attributes (validated first)."""
    import zarr

    validate("label_store", attrs, f"label store {store_url}")
    group = zarr.create_group(storage.zarr_store(store_url), overwrite=True, zarr_format=3)
    chunks = tuple(min(b, n) for b, n in zip(grid.bricks, grid.shape))
    labels = group.create_array("labels", shape=grid.shape, chunks=chunks, dtype=np.uint8, fill_value=LABEL_IGNORE,
                                dimension_names=["inline", "crossline", "sample"])
    for name, values, dims in (("label_mask", mask, ["inline", "crossline"]), ("inline", grid.inlines, ["inline"]),
                               ("crossline", grid.crosslines, ["crossline"]), ("sample", grid.samples, ["sample"])):
        values = np.asarray(values)
        array = group.create_array(name, shape=values.shape, chunks=values.shape, dtype=values.dtype,
                                   fill_value=values.dtype.type(0), dimension_names=dims)
        array[...] = values
    for i0, block in _blocks(source, grid, ignore):
        labels[i0:i0 + len(block)] = block
    group.attrs.update(attrs)  # the root zarr.json, last
    with warnings.catch_warnings():  # zarr notes that consolidated metadata is not in the v3 spec; xarray reads it
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(storage.zarr_store(store_url))


def ingest_labels(src_url: str, survey: str, data_root: str, *, ignore: int | None = None, variable: str = "",
                  name: str = "") -> dict[str, Any]:
    """Ingest the label volume at ``src_url`` for ``survey`` (a survey id published in ``data_root``, or a
    survey store URL) and publish it. ``ignore``: the source's value of samples not interpreted (255 always
    is); ``variable``: the Zarr/MDIO variable holding the labels (default: its only integer 3-D one).

    Returns the manifest row plus ``status`` ("ingested", or "exists": the same labels of the same
    survey were published before), ``label_mask`` [IL, XL] and ``seconds``."""
    t0 = time.perf_counter()
    data_root = storage.normalize(data_root)
    grid = survey_grid(survey, data_root)
    source = open_source(src_url, grid, variable)
    summary = measure(source, grid, ignore)
    mask = summary.pop("mask")
    label_id = summary["checksum"].split(":")[1][:16]
    row = manifest.get_label_row(data_root, label_id)
    status = "exists"
    if row is None:
        store_url = manifest.label_store_url(data_root, label_id)
        attrs = {"sfm_labels_version": LABELS_VERSION, "label_id": label_id, "survey_id": grid.survey_id,
                 "survey_store_url": grid.store_url, "name": name or label_name(source.url),
                 "source_url": source.url, "source_kind": source.kind, "source_ignore": ignore,
                 "shape": list(grid.shape), "ignore": LABEL_IGNORE, **summary}
        if source.variable:
            attrs["variable"] = source.variable
        try:
            write_store(store_url, source, grid, ignore, attrs, mask)
        except Exception:
            storage.remove(store_url)  # a failed write leaves no store (a killed one leaves an invisible one)
            raise
        row = {k: attrs[k] for k in ("label_id", "survey_id", "name", "source_url", "shape", "checksum", "classes",
                                     "labelled_voxels", "labelled_inlines", "labelled_crosslines")}
        row.update(store_url=store_url, ingested_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
        status = "ingested" if manifest.publish_labels(data_root, row) else "exists"
        row = manifest.get_label_row(data_root, label_id)
    return {**row, "status": status, "label_mask": mask, "seconds": time.perf_counter() - t0}


def ingest_pairs(pairs: list[dict[str, str]], data_root: str, cfg: IngestConfig | None = None) -> list[dict[str, Any]]:
    """Publish every survey and its labels (sources already published are found, not copied again): ``pairs``
    [{"survey", "labels", "role"}] as :func:`sfm.finetune.run.plan_pairs` makes them; returns them with their
    store URLs and ids."""
    from sfm.ingest.survey import survey_row

    out = []
    for pair in pairs:
        row = survey_row(pair["survey"], data_root, cfg)
        if manifest.is_id(pair["labels"]):
            labels = manifest.get_label_row(data_root, pair["labels"])
            if labels is None or labels["survey_id"] != row["survey_id"]:
                raise SFMError(f"label set {pair['labels']} is not published for survey {row['survey_id']} in "
                               f"{data_root}; ingest it with `sfm ingest-labels`")
        else:
            labels = ingest_labels(pair["labels"], row["survey_id"], data_root)
        print(f"sfm finetune: {pair['role']}: survey {row['survey_id']} ({row['name']}) at {row['store_url']}, labels "
              f"{labels['label_id']} ({labels['name']}: {labels['labelled_voxels']} labelled voxels on "
              f"{labels['labelled_inlines']} inlines)")
        out.append({**pair, "store_url": row["store_url"], "label_url": labels["store_url"],
                    "survey_id": row["survey_id"], "label_id": labels["label_id"], "name": labels["name"]})
    return out
