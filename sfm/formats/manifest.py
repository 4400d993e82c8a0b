"""The manifest: the table of published surveys under ``<data-root>/manifest/``, and where each survey's
store lives (``<data-root>/surveys/<survey_id>.zarr``, :func:`survey_store_url`); label sets aligned with
a survey are published the same way (``manifest/labels/<label_id>.parquet``, their stores under
``<data-root>/labels/``).

Each published survey is one immutable parquet row object, ``manifest/rows/<survey_id>.parquet``,
written in a single atomic PUT *after* its store is complete. A survey without a row is invisible,
so an interrupted ingest leaves nothing readers can see, and two ingests into the same data root
never overwrite each other's rows. The manifest version is a digest of the set of rows, so the same
set of surveys always has the same version (used in model lineage).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
from typing import Any

from sfm import storage
from sfm.formats.contracts import validate

COLUMNS = ["survey_id", "name", "source_url", "store_url", "shape", "live_traces", "checksum",
           "sample_format", "sample_interval_us", "sample_start_ms", "dtype", "ingested_at", "stats_json"]


_HEX = set("0123456789abcdef")


def is_id(text: str) -> bool:
    """A survey or label id: 16 hex digits (what the manifest names them by)."""
    return len(text) == 16 and set(text) <= _HEX


def survey_store_url(data_root: str, survey_id: str) -> str:
    """Where a survey's store lives: ``<data_root>/surveys/<survey_id>.zarr``."""
    return storage.join(data_root, "surveys", f"{survey_id}.zarr")


def make_row(attrs: dict[str, Any], store_url: str, stats: dict[str, Any]) -> dict[str, Any]:
    """A survey's row (sfm/data_contracts/manifest_row.schema.json) from its store's root attributes; ``ingested_at``
    is now."""
    made = {"store_url": store_url, "ingested_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "stats_json": json.dumps(stats, sort_keys=True)}
    return {k: made[k] if k in made else attrs[k] for k in COLUMNS}


def rows_url(data_root: str) -> str:
    return storage.join(data_root, "manifest", "rows")


def row_url(data_root: str, survey_id: str) -> str:
    return storage.join(rows_url(data_root), f"{survey_id}.parquet")


def publish(data_root: str, row: dict[str, Any]) -> bool:
    """Make a survey visible: validate its row and create it in one atomic step.

    Returns False (and changes nothing) when the survey's row already exists: two ingests of the same
    content racing each other publish exactly one row.
    """
    return _publish_row(row_url(data_root, row["survey_id"]), "manifest_row", row, row.get("name", "?"))


def _publish_row(url: str, contract: str, row: dict[str, Any], name: str) -> bool:
    """Validate ``row`` against ``contract`` and create it at ``url`` as one parquet object, if absent."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    validate(contract, row, f"manifest row for {name}")
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([row]), buf)
    return storage.write_bytes_if_absent(url, buf.getvalue())


def _read_row(url: str, contract: str) -> dict[str, Any] | None:
    """The row at ``url``, validated against ``contract``; None if there is none."""
    if not storage.exists(url):
        return None
    row = decode_row(storage.read_bytes(url))
    row["shape"] = [int(v) for v in row["shape"]]
    validate(contract, row, url)
    return row


def decode_row(data: bytes) -> dict[str, Any]:
    """The first row of the parquet object ``data``, as a dict.

    Arrow's thread pools stay off, and the bytes reach it as an Arrow buffer, not a Python file object: a process
    that read parquet with pool threads, or through a Python file (whose reads take the GIL from Arrow's threads),
    aborts at random as it exits ("terminate called without an active exception", apache/arrow#34314, #50482),
    which failed finished ingests.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(data), use_threads=False, pre_buffer=False).to_pylist()[0]


def publish_or_get(data_root: str, row: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """:func:`publish` ``row``: (``row``, True), or (the row published first, False) when the same content was
    published meanwhile."""
    if publish(data_root, row):
        return row, True
    return get_row(data_root, row["survey_id"]), False


def get_row(data_root: str, survey_id: str) -> dict[str, Any] | None:
    return _read_row(row_url(data_root, survey_id), "manifest_row")


def read(data_root: str):
    """All published surveys as a pandas DataFrame, one row each, sorted by survey_id."""
    import pandas as pd

    rows = []
    for name in storage.list_dir(rows_url(data_root)):
        if name.endswith(".parquet"):
            row = get_row(data_root, name[: -len(".parquet")])
            if row:
                rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS).sort_values("survey_id", ignore_index=True)


def version(data_root: str) -> str:
    """A digest of the published set of surveys: ``m<count>-<sha256[:12]>``."""
    ids = sorted(name[: -len(".parquet")] for name in storage.list_dir(rows_url(data_root)) if name.endswith(".parquet"))
    digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12]
    return f"m{len(ids)}-{digest}"


# ---- label sets (sfm.ingest.labels) ---------------------------------------------------------------


def label_store_url(data_root: str, label_id: str) -> str:
    """Where a label set's store lives: ``<data_root>/labels/<label_id>.zarr``."""
    return storage.join(data_root, "labels", f"{label_id}.zarr")


def label_row_url(data_root: str, label_id: str) -> str:
    return storage.join(data_root, "manifest", "labels", f"{label_id}.parquet")


def publish_labels(data_root: str, row: dict[str, Any]) -> bool:
    """Make a label set visible (sfm/data_contracts/label_row.schema.json), as :func:`publish` a survey: False
    when its row exists already."""
    return _publish_row(label_row_url(data_root, row["label_id"]), "label_row", row, row.get("name", "?"))


def get_label_row(data_root: str, label_id: str) -> dict[str, Any] | None:
    return _read_row(label_row_url(data_root, label_id), "label_row")


def label_rows(data_root: str) -> list[dict[str, Any]]:
    """Every published label set, sorted by label_id."""
    folder = storage.join(data_root, "manifest", "labels")
    ids = sorted(name[: -len(".parquet")] for name in storage.list_dir(folder) if name.endswith(".parquet"))
    return [row for row in (get_label_row(data_root, i) for i in ids) if row]
