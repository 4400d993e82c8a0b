"""SEG-Y edge cases for the ingest tests, made from sfm.synth.survey.write_segy plus raw byte edits.

Every helper writes a real SEG-Y file (segyio wrote the original) and returns what ingest should
store, so tests compare the store against an independent expectation.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import segyio
import zarr

from sfm import storage
from sfm.formats import manifest
from sfm.synth import survey as synth

FILE_HEADER = 3600
TRACE_HEADER = 240


def volume(shape=(12, 10, 24), seed: int = 0) -> np.ndarray:
    """A small synthetic amplitude volume [IL, XL, NS] float32."""
    amplitude, _ = synth.synthesize_volume(shape, seed)
    return amplitude


def write(path: Path, amplitude: np.ndarray, **options) -> Path:
    """sfm.synth.survey.write_segy laid out as ``options`` (:class:`sfm.synth.survey.SegyOptions` fields) say,
    format 5 by default; returns the path."""
    synth.write_segy(path, amplitude, synth.SegyOptions(**options))
    return Path(path)


def traces(path: Path, ns: int, bytes_per_sample: int = 4) -> tuple[bytes, np.ndarray]:
    """(file header bytes, trace records [T, 240 + ns * bytes] uint8, writable copy)."""
    data = Path(path).read_bytes()
    records = np.frombuffer(data, dtype=np.uint8, offset=FILE_HEADER).reshape(-1, TRACE_HEADER + ns * bytes_per_sample)
    return data[:FILE_HEADER], records.copy()


def rewrite(path: Path, head: bytes, records: np.ndarray) -> Path:
    Path(path).write_bytes(head + records.tobytes())
    return Path(path)


def drop_traces(path: Path, ns: int, keep: np.ndarray) -> Path:
    """Remove the traces where ``keep`` [T] (file order) is False."""
    head, records = traces(path, ns)
    return rewrite(path, head, records[keep])


def set_field(records: np.ndarray, trace: int, byte: int, value: int, endian: str = "big") -> None:
    """Write a 4-byte signed integer at 1-based ``byte`` of one trace header."""
    records[trace, byte - 1 : byte + 3] = np.frombuffer(int(value).to_bytes(4, endian, signed=True), dtype=np.uint8)


def set_fields(records: np.ndarray, byte: int, values, width: int = 4, endian: str = "big") -> None:
    """Write signed integers ``values`` (one, or one per trace) at 1-based ``byte`` of every trace header."""
    column = np.broadcast_to(np.asarray(values, dtype=np.int64), (len(records),))
    raw = column.astype(f"{'>' if endian == 'big' else '<'}i{width}").view(np.uint8).reshape(-1, width)
    records[:, byte - 1 : byte - 1 + width] = raw


def set_ibm_words(records: np.ndarray, words: np.ndarray, endian: str = "big") -> None:
    """Overwrite the samples of a format-1 file with raw IBM words [T, NS] uint32, in the file's byte order."""
    raw = words.astype(">u4" if endian == "big" else "<u4").view(np.uint8)
    records[:, TRACE_HEADER:] = raw.reshape(len(records), -1)


def set_samples(records: np.ndarray, trace: int, index: np.ndarray, values, endian: str = "big") -> None:
    """Overwrite IEEE float samples (format 5) of one trace."""
    dtype = ">f4" if endian == "big" else "<f4"
    samples = records[trace, TRACE_HEADER:].view(dtype)
    samples[index] = values


def ascii_text_header(path: Path, lines: list[str]) -> Path:
    """Replace the EBCDIC textual header by an ASCII one (40 lines of 80 characters)."""
    text = "".join(f"{line:<80.80}" for line in (lines + [""] * 40)[:40]).encode("ascii")
    data = bytearray(Path(path).read_bytes())
    data[:3200] = text
    Path(path).write_bytes(bytes(data))
    return Path(path)


def set_byte_order_constant(path: Path, endian: str) -> Path:
    """Write the SEG-Y rev 2 byte-order constant 0x01020304 at byte 3297 in ``endian`` order."""
    data = bytearray(Path(path).read_bytes())
    data[3296:3300] = (0x01020304).to_bytes(4, endian)
    Path(path).write_bytes(bytes(data))
    return Path(path)


# sample format -> (numpy dtype segyio returns, value range the test volume is scaled to)
FORMAT_VALUES = {
    1: (np.float32, None), 2: (np.int32, 1e6), 3: (np.int16, 3e4), 5: (np.float32, None), 6: (np.float64, None),
    8: (np.int8, 120), 9: (np.int64, 1e12), 10: (np.uint32, 1e6), 11: (np.uint16, 6e4), 12: (np.uint64, 1e12),
    16: (np.uint8, 250),
}


def write_with_format(path: Path, shape: tuple[int, int, int], sample_format: int, endian: str = "big",
                      seed: int = 0) -> np.ndarray:
    """A survey in any segyio sample format, written by segyio itself (spec.format). Integer formats get
    the amplitude scaled to most of the type's range (shifted to be positive for unsigned types).

    Returns the values segyio reads back, as float32 [IL, XL, NS] (the expected store)."""
    dtype, span = FORMAT_VALUES[sample_format]
    amplitude = volume(shape, seed).astype(np.float64)
    if span is not None:
        amplitude = amplitude / np.abs(amplitude).max() * span / 2
        if np.issubdtype(dtype, np.unsignedinteger):
            amplitude += span / 2
        amplitude = np.rint(amplitude)
    values = amplitude.astype(dtype)
    ni, nx, ns = shape
    spec = segyio.spec()
    spec.iline, spec.xline, spec.format, spec.endian = 189, 193, sample_format, endian
    spec.sorting = segyio.TraceSortingFormat.INLINE_SORTING
    spec.samples, spec.ilines, spec.xlines, spec.offsets = np.arange(ns) * 4.0, np.arange(ni) + 1, np.arange(nx) + 1, [0]
    with segyio.create(str(path), spec) as f:
        f.bin.update({segyio.BinField.Interval: 4000})
        for k, (i, j) in enumerate(np.ndindex(ni, nx)):
            f.header[k] = {segyio.TraceField.INLINE_3D: i + 1, segyio.TraceField.CROSSLINE_3D: j + 1,
                           segyio.TraceField.offset: 0}
            f.trace[k] = values[i, j]
    with segyio.open(str(path), endian=endian) as f:
        return segyio.tools.cube(f).astype(np.float32)


def strip_trace_header_extensions(src: Path, dst: Path) -> Path:
    """A SEG-Y rev 2 file with N extra 240-byte trace headers per trace, rewritten without them
    (and with byte 3507 = 0), so segyio can read it for comparison."""
    data = Path(src).read_bytes()
    extra = int.from_bytes(data[3506:3508], "big")
    ns = int.from_bytes(data[3220:3222], "big")
    rec = TRACE_HEADER * (1 + extra) + ns * 4
    records = np.frombuffer(data, dtype=np.uint8, offset=FILE_HEADER).reshape(-1, rec)
    kept = np.concatenate([records[:, :TRACE_HEADER], records[:, TRACE_HEADER * (1 + extra):]], axis=1)
    head = bytearray(data[:FILE_HEADER])
    head[3506:3508] = b"\x00\x00"
    Path(dst).write_bytes(bytes(head) + kept.tobytes())
    return Path(dst)


def store_digests(root: Path, without_source_url: bool = False) -> dict[str, str]:
    """Every file of a local store -> sha256; ``without_source_url``: the root zarr.json's source_url
    blanked (the one attribute that names where the SEG-Y was read from)."""
    import hashlib
    import json

    out = {}
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        data = path.read_bytes()
        if without_source_url and path == Path(root) / "zarr.json":
            meta = json.loads(data)
            assert meta["attributes"].pop("source_url")
            data = json.dumps(meta, sort_keys=True).encode()
        out[str(path.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return out


class Backend:
    """Where sources and the data root live: a local folder, or a bucket on the loopback S3 server."""

    def __init__(self, kind: str, tmp: Path, s3=None):
        self.kind = kind
        self.tmp = tmp
        if kind == "s3":
            self.bucket = s3.make_bucket(f"ingest-{uuid.uuid4().hex[:10]}")
            self.s3 = s3
            self.root = f"{self.bucket}/root"
        else:
            self.root = str(tmp / "root")

    def source(self, path: Path) -> str:
        if self.kind == "local":
            return str(path)
        url = f"{self.bucket}/landing/{Path(path).name}"
        storage.upload(path, url)
        return url

    def group(self, store_url: str):
        return zarr.open_group(storage.zarr_store(store_url, read_only=True), mode="r")

    def published(self) -> list[str]:
        return list(manifest.read(self.root)["survey_id"])

    def stores(self) -> list[str]:
        """Everything under surveys/ (object keys or file paths)."""
        if self.kind == "s3":
            bucket = self.bucket[len("s3://"):]
            return [k for k in self.s3.keys(bucket, "root/surveys/")]
        base = Path(self.root) / "surveys"
        return [str(p) for p in base.rglob("*") if p.is_file()] if base.exists() else []


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path) -> Backend:
    if request.param == "s3":
        return Backend("s3", tmp_path, request.getfixturevalue("s3_env"))
    return Backend("local", tmp_path)
