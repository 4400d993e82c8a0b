"""SEG-Y ingest (issue 3): every real and generated case becomes a faithful survey store, or one clear error.

Stores are compared with what segyio reads from the same file, on local disk and on a moto_server S3
(source file and data root both in the bucket).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from support import ingest_cases as cases
from support.ingest_cases import Backend, backend  # noqa: F401  (the local/S3 fixture)
import numpy as np
import pytest
import segyio
import zarr

from sfm import storage
from sfm.formats import manifest
from sfm.formats.contracts import read_store_attrs
from sfm.errors import SFMError
from sfm.ingest.survey import ingest_survey, open_survey

VALID = ["f3.sgy", "Format1msb.sgy", "Format5lsb.sgy", "Format8msb.sgy", "small.sgy", "small-lsb.sgy", "tiny.sgy",
         "rotated-small-rev2.sgy"]
INVALID = {  # file -> words its own error must contain
    "broken.sgy": "truncated",
    "long.sgy": "trace headers are missing or damaged",
    "small-ps.sgy": "pre-stack",
    "text.sgy": "no traces",
}



def segyio_reference(path: Path, endian: str) -> dict:
    """What segyio reads: the cube as float32, line numbers, and CDP coordinates with their scalar applied."""
    with segyio.open(str(path), endian=endian) as f:
        cube = segyio.tools.cube(f).astype(np.float32)
        scalar = f.attributes(segyio.TraceField.SourceGroupScalar)[:].astype(np.float64)
        factor = np.where(scalar < 0, -1.0 / np.where(scalar == 0, 1, scalar), np.where(scalar == 0, 1.0, scalar))
        x = f.attributes(segyio.TraceField.CDP_X)[:] * factor
        il_numbers = f.attributes(segyio.TraceField.INLINE_3D)[:]
        xl_numbers = f.attributes(segyio.TraceField.CROSSLINE_3D)[:]
        ilines, xlines = np.asarray(f.ilines), np.asarray(f.xlines)
    cdp_x = np.full((len(ilines), len(xlines)), np.nan)
    cdp_x[np.searchsorted(ilines, il_numbers), np.searchsorted(xlines, xl_numbers)] = x
    return {"cube": cube, "ilines": ilines, "xlines": xlines, "cdp_x": cdp_x}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", VALID)
def test_real_files_equal_segyio(backend, segy_dir, tmp_path, name):
    path = segy_dir / name
    compare = path
    if name == "rotated-small-rev2.sgy":  # rev 2 trace header extensions: segyio reads it only without them
        compare = cases.strip_trace_header_extensions(path, tmp_path / "rev2-stripped.sgy")
    endian = "little" if "lsb" in name else "big"
    ref = segyio_reference(compare, endian)
    row = ingest_survey(backend.source(path), backend.root, chunk=16)
    assert row["status"] == "ingested"
    group = backend.group(row["store_url"])
    assert np.array_equal(group["amplitude"][...], ref["cube"])
    assert np.array_equal(group["inline"][...], ref["ilines"])
    assert np.array_equal(group["crossline"][...], ref["xlines"])
    assert np.allclose(group["cdp_x"][...], ref["cdp_x"], equal_nan=True)
    assert group["trace_mask"][...].all()
    attrs = read_store_attrs(row["store_url"])
    assert attrs["endian"] == endian and attrs["shape"] == list(ref["cube"].shape)
    assert attrs["text_encoding"] == "ebcdic" and attrs["text_header"].startswith("C 1")
    assert attrs["stats"]["count"] == ref["cube"].size
    assert attrs["stats"]["mean"] == pytest.approx(ref["cube"].astype(np.float64).mean(), rel=1e-6, abs=1e-9)
    assert attrs["stats"]["percentiles"]["50"] == pytest.approx(np.percentile(ref["cube"], 50), rel=1e-6)
    assert backend.published() == [row["survey_id"]]
    if name == "f3.sgy":  # readable by xarray, with labelled coordinates
        ds = open_survey(row["store_url"])
        assert ds["amplitude"].dims == ("inline", "crossline", "sample")
        assert np.array_equal(ds["amplitude"].values, ref["cube"])
        assert list(ds["inline"].values) == list(ref["ilines"])
        assert "cdp_x" in ds.coords


@pytest.mark.timeout(300)
def test_invalid_files_fail_with_their_own_message(backend, segy_dir):
    messages = {}
    for name, words in INVALID.items():
        with pytest.raises(SFMError) as err:
            ingest_survey(backend.source(segy_dir / name), backend.root)
        message = str(err.value)
        assert words in message and name in message and "\n" not in message, message
        messages[name] = message
    assert len(set(messages.values())) == len(INVALID)
    assert backend.published() == []
    assert backend.stores() == []


@pytest.mark.parametrize("sample_format,endian", [(f, "big") for f in cases.FORMAT_VALUES]
                         + [(1, "little"), (3, "little"), (6, "little"), (11, "little"), (12, "little")])
def test_every_segyio_sample_format(tmp_path, sample_format, endian):
    path = tmp_path / f"format{sample_format}-{endian}.sgy"
    expected = cases.write_with_format(path, (5, 4, 12), sample_format, endian)
    row = ingest_survey(str(path), str(tmp_path / "root"))
    group = zarr.open_group(row["store_url"], mode="r")
    assert group["amplitude"].dtype == np.float32
    assert np.array_equal(group["amplitude"][...], expected)
    assert group.attrs["sample_format"] == sample_format and group.attrs["endian"] == endian


def test_unsupported_sample_format_is_named(tmp_path):
    path = cases.write(tmp_path / "fixed-point.sgy", cases.volume((3, 3, 8)))
    data = bytearray(path.read_bytes())
    data[3224:3226] = (4).to_bytes(2, "big")  # 4-byte fixed point with gain: segyio cannot read it
    path.write_bytes(bytes(data))
    with pytest.raises(SFMError, match="sample format 4 .*fixed-point.* not read by segyio"):
        ingest_survey(str(path), str(tmp_path / "root"))


# --------------------------------------------------------------------------------------------
# generated cases


def test_missing_traces_become_holes(backend, tmp_path):
    amplitude = cases.volume((12, 10, 24), seed=1)
    path = cases.write(tmp_path / "holes.sgy", amplitude)
    live = np.ones((12, 10), dtype=bool)
    live[3:6, 2:7] = False
    live[0, 9] = False  # a missing corner trace
    cases.drop_traces(path, 24, live.ravel())
    row = ingest_survey(backend.source(path), backend.root, chunk=8)
    group = backend.group(row["store_url"])
    stored = group["amplitude"][...]
    assert np.array_equal(group["trace_mask"][...], live)
    assert np.array_equal(stored[live], amplitude[live])
    assert not stored[~live].any() and np.isfinite(stored).all()
    assert np.isnan(group["cdp_x"][...][~live]).all()
    stats = json.loads(row["stats_json"])
    values = amplitude[live].astype(np.float64)
    assert stats["count"] == values.size
    assert stats["mean"] == pytest.approx(values.mean(), rel=1e-5, abs=1e-7)
    assert stats["std"] == pytest.approx(values.std(), rel=1e-5)
    assert stats["min"] == values.min() and stats["max"] == values.max()
    assert stats["percentiles"]["99.9"] == pytest.approx(np.percentile(amplitude[live], 99.9), rel=1e-6)
    assert row["details"]["holes"] == int((~live).sum())


def test_grid_much_sparser_than_its_traces_is_refused_with_the_override(backend, tmp_path):
    amplitude = cases.volume((20, 20, 8))
    path = cases.write(tmp_path / "sparse.sgy", amplitude)
    keep = np.zeros((20, 20), dtype=bool)
    keep[0, 0] = keep[19, 19] = keep[10, 3] = keep[4, 15] = True  # 4 traces spanning 400 cells
    source = backend.source(cases.drop_traces(path, 8, keep.ravel()))
    with pytest.raises(SFMError, match=r"100\.0 cells per trace.*--max-sparsity 100"):
        ingest_survey(source, backend.root, iline_byte=189, xline_byte=193)
    with pytest.raises(SFMError, match="--max-sparsity"):  # detection finds no other pair either
        ingest_survey(source, backend.root)
    assert backend.published() == [] and backend.stores() == []
    row = ingest_survey(source, backend.root, max_sparsity=100)
    assert row["shape"] == [20, 20, 8] and row["details"]["holes"] == 396


def test_duplicate_traces_name_the_first_pair(backend, tmp_path):
    path = cases.write(tmp_path / "dups.sgy", cases.volume((6, 5, 8)), first_inline=100, first_crossline=300)
    head, records = cases.traces(path, 8)
    cases.set_field(records, 17, 189, 101)  # trace #18 (inline 103) claims inline 101, crossline 302
    cases.set_field(records, 17, 193, 302)
    cases.set_field(records, 25, 189, 101)  # and a later one too
    cases.set_field(records, 25, 193, 302)
    source = backend.source(cases.rewrite(path, head, records))
    with pytest.raises(SFMError, match=r"duplicate traces: inline 101, crossline 302 appears at trace #8 and #18"):
        ingest_survey(source, backend.root)
    assert backend.published() == [] and backend.stores() == []


def test_pre_stack_is_refused_as_pre_stack(segy_dir, tmp_path):
    with pytest.raises(SFMError, match=r"small-ps.sgy is pre-stack data: 2 offsets"):
        ingest_survey(str(segy_dir / "small-ps.sgy"), str(tmp_path / "root"))
    with pytest.raises(SFMError, match="pre-stack"):  # whatever bytes are given
        ingest_survey(str(segy_dir / "small-ps.sgy"), str(tmp_path / "root"), iline_byte=189, xline_byte=193)


def test_byte_locations_detected_or_given(backend, tmp_path):
    amplitude = cases.volume((6, 5, 8))
    root = backend.root
    for il, xl in ((9, 21), (221, 225)):  # common pairs: found when 189/193 holds no grid
        path = cases.write(tmp_path / f"bytes-{il}.sgy", amplitude, iline_byte=il, xline_byte=xl)
        row = ingest_survey(backend.source(path), root)
        attrs = read_store_attrs(row["store_url"])
        assert (attrs["iline_byte"], attrs["xline_byte"], attrs["byte_locations"]) == (il, xl, "detected")
        assert "189/193" in attrs["byte_pairs_rejected"]
        assert np.array_equal(backend.group(row["store_url"])["amplitude"][...], amplitude)
    custom = backend.source(cases.write(tmp_path / "bytes-13.sgy", amplitude, iline_byte=13, xline_byte=29))
    with pytest.raises(SFMError, match="no valid inline/crossline grid at bytes 189/193.*--iline-byte/--xline-byte"):
        ingest_survey(custom, root)
    row = ingest_survey(custom, root, iline_byte=13, xline_byte=29)  # a position segyio has no name for
    assert row["details"]["byte_locations"] == "given"
    assert np.array_equal(backend.group(row["store_url"])["amplitude"][...], amplitude)
    with pytest.raises(SFMError, match="outside the 240-byte trace header"):
        ingest_survey(custom, root, iline_byte=239, xline_byte=29)


def test_crossline_sorted_equals_inline_sorted(backend, tmp_path):
    amplitude = cases.volume((9, 7, 16), seed=3)
    rows = [ingest_survey(backend.source(cases.write(tmp_path / f"{s}.sgy", amplitude, sorting=s)), backend.root,
                          chunk=4) for s in ("inline", "crossline")]
    arrays = [backend.group(r["store_url"])["amplitude"][...] for r in rows]
    assert rows[0]["survey_id"] != rows[1]["survey_id"]
    assert np.array_equal(arrays[0], amplitude) and np.array_equal(arrays[1], amplitude)


def test_byte_order_detection_and_override(backend, tmp_path):
    amplitude = cases.volume((4, 3, 8))
    root = backend.root
    little = backend.source(cases.write(tmp_path / "little.sgy", amplitude, endian="little"))  # no 3297 constant
    row = ingest_survey(little, root)
    assert row["details"]["endian"] == "little" and "format code" in row["details"]["endian_source"]
    with pytest.raises(SFMError, match="try --endian little"):
        ingest_survey(little, root, endian="big")
    constant = cases.set_byte_order_constant(cases.write(tmp_path / "constant.sgy", amplitude, endian="little"),
                                             "little")
    row = ingest_survey(backend.source(constant), root, endian="auto")
    assert "constant" in row["details"]["endian_source"]
    assert np.array_equal(backend.group(row["store_url"])["amplitude"][...], amplitude)
    garbage = tmp_path / "garbage.sgy"
    garbage.write_bytes(b"\x7f" * 4000)
    with pytest.raises(SFMError, match="no byte order gives a valid sample format.*--endian"):
        ingest_survey(backend.source(garbage), root)


def test_ascii_text_header_is_kept(backend, tmp_path):
    path = cases.ascii_text_header(cases.write(tmp_path / "ascii.sgy", cases.volume((3, 3, 8))),
                                   ["C 1 CLIENT: NORTH SEA TEST", "C 2 ASCII, NOT EBCDIC"])
    row = ingest_survey(backend.source(path), backend.root)
    attrs = read_store_attrs(row["store_url"])
    assert attrs["text_encoding"] == "ascii"
    assert attrs["text_header"].splitlines()[:2] == ["C 1 CLIENT: NORTH SEA TEST", "C 2 ASCII, NOT EBCDIC"]


def test_nan_samples_are_replaced_and_reported_or_refused(backend, tmp_path):
    amplitude = cases.volume((5, 4, 16))
    path = cases.write(tmp_path / "nan.sgy", amplitude)
    head, records = cases.traces(path, 16)
    cases.set_samples(records, 6, np.array([2, 3]), [np.nan, np.inf])  # trace #7: inline 101, crossline 302
    cases.set_samples(records, 13, np.array([0]), [-np.inf])
    cases.rewrite(path, head, records)
    source = backend.source(path)
    with pytest.raises(SFMError, match=r"NaN/inf samples \(first in trace #7, inline 101, crossline 302\).*"
                                       "--refuse-nonfinite"):
        ingest_survey(source, backend.root, nonfinite="refuse")
    assert backend.published() == [] and backend.stores() == []
    row = ingest_survey(source, backend.root)
    stored = backend.group(row["store_url"])["amplitude"][...]
    expected = amplitude.copy()
    expected[1, 2, [2, 3]] = 0.0
    expected[3, 1, 0] = 0.0
    assert np.array_equal(stored, expected)
    assert json.loads(row["stats_json"])["nonfinite_replaced"] == 3
    assert "3 NaN/inf samples replaced by 0" in row["message"]


def test_all_zero_survey(backend, tmp_path):
    path = cases.write(tmp_path / "zero.sgy", np.zeros((4, 4, 8), dtype=np.float32))
    row = ingest_survey(backend.source(path), backend.root)
    stats = json.loads(row["stats_json"])
    assert stats["all_zero"] is True and stats["count"] == 128 and stats["zero_traces"] == 16
    assert stats["std"] == 0.0 and stats["min"] == stats["max"] == 0.0
    assert not backend.group(row["store_url"])["amplitude"][...].any()


def test_float16_stores_standardised_values_and_the_transform(backend, tmp_path):
    amplitude = cases.volume((10, 9, 20), seed=5) * 300.0 + 40.0  # not standardised to start with
    path = cases.write(tmp_path / "half.sgy", amplitude)
    live = np.ones((10, 9), dtype=bool)
    live[4, 4] = False
    cases.drop_traces(path, 20, live.ravel())
    row = ingest_survey(backend.source(path), backend.root, dtype="float16", chunk=8)
    group = backend.group(row["store_url"])
    attrs = read_store_attrs(row["store_url"])
    t = attrs["amplitude_transform"]
    stored = group["amplitude"][...]
    assert stored.dtype == np.float16 and abs(float(stored[live].astype(np.float64).mean())) < 0.2
    decoded = stored.astype(np.float64) * t["scale"] + t["offset"]
    assert np.abs(decoded[live] - amplitude[live]).max() < 1e-3 * np.abs(amplitude).max()
    assert not decoded[~live].any()  # holes decode to exactly 0
    assert attrs["stats"]["mean"] == pytest.approx(amplitude[live].astype(np.float64).mean(), rel=1e-5)
    units = read_store_attrs(row["store_url"], stats_in_stored_units=True)["stats"]
    assert units["mean"] == pytest.approx((attrs["stats"]["mean"] - t["offset"]) / t["scale"])
    if backend.kind == "local":  # xarray decodes the CF scale_factor/add_offset back to amplitude
        ds = open_survey(row["store_url"])
        assert np.abs(ds["amplitude"].values[live] - amplitude[live]).max() < 1e-3 * np.abs(amplitude).max()


def test_contract_is_checked_when_a_store_is_read(tmp_path, segy_dir):
    row = ingest_survey(str(segy_dir / "small.sgy"), str(tmp_path / "root"))
    group = zarr.open_group(row["store_url"], mode="r+")
    attrs = dict(group.attrs)
    del attrs["stats"]
    group.attrs.put(attrs)
    with pytest.raises(SFMError, match=r"survey store .* breaks the survey_store contract at \(root\): 'stats'"):
        read_store_attrs(row["store_url"])
    with pytest.raises(SFMError, match="breaks the survey_store contract"):
        open_survey(row["store_url"])
    with pytest.raises(SFMError, match="does not exist"):
        read_store_attrs(str(tmp_path / "root" / "surveys" / "0000000000000000.zarr"))


def test_checksum_is_the_files_blake3_and_survey_id_its_prefix(tmp_path, segy_dir):
    import blake3

    row = ingest_survey(str(segy_dir / "small.sgy"), str(tmp_path / "root"))
    digest = blake3.blake3((segy_dir / "small.sgy").read_bytes()).hexdigest()  # what `b3sum small.sgy` prints
    attrs = read_store_attrs(row["store_url"])
    assert row["checksum"] == attrs["checksum"] == f"blake3:{digest}" and attrs["checksum_algorithm"] == "blake3"
    assert row["survey_id"] == digest[:16]
    from sfm.formats.segy import file_digest

    assert file_digest(str(segy_dir / "small.sgy")) == digest  # what sfm watch uses to know a file's survey


@pytest.mark.parametrize("codec,via", [("lz4", "cli"), ("zstd:3", "api")])
def test_codec_is_configurable(tmp_path, codec, via):
    from sfm.config import IngestConfig
    from sfm.formats.store_layout import DEFAULT_CODEC

    assert IngestConfig().codec == DEFAULT_CODEC  # the flow's [ingest] codec defaults to ingest's own
    amplitude = cases.volume((10, 9, 20), seed=2)
    src = str(cases.write(tmp_path / "c.sgy", amplitude))
    if via == "cli":
        proc = subprocess.run([sys.executable, "-m", "sfm.cli", "ingest", src, "--data-root", str(tmp_path / "root"),
                               "--codec", codec], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        row = json.loads(proc.stdout.splitlines()[0])
    else:
        row = ingest_survey(src, str(tmp_path / "root"), codec=codec)
    attrs = read_store_attrs(row["store_url"])
    cname, _, level = codec.partition(":")
    assert f"cname={cname} clevel={level or 1}" in attrs["store"]["codec"]
    assert np.array_equal(zarr.open_group(row["store_url"], mode="r")["amplitude"][...], amplitude)
    with pytest.raises(SFMError, match="not a Blosc codec"):
        ingest_survey(str(tmp_path / "c.sgy"), str(tmp_path / "root"), codec="gzip")


def test_flow_defaults_detect_byte_locations_and_write_128_bricks(tmp_path):
    from sfm.config import JobConfig
    from sfm.ops import pipeline

    cfg = JobConfig.from_toml()  # sfm/default.toml, as the flow's ingest step reads it
    assert (cfg.ingest.iline_byte, cfg.ingest.xline_byte, cfg.ingest.chunk) == (0, 0, 128)
    amplitude = cases.volume((6, 140, 20), seed=4)
    path = cases.write(tmp_path / "bytes-9.sgy", amplitude, iline_byte=9, xline_byte=21)
    root = str(tmp_path / "root")  # the flow's ingest steps, one after the other
    scans = pipeline.plan_ingest([{"url": str(path), "held_out": False}], root, cfg, "run-1")
    writes = pipeline.plan_writes([pipeline.scan_part(s, cfg) for s in scans], root, cfg)
    [ref] = pipeline.publish([pipeline.ingest(w, cfg) for w in writes], root)
    attrs = read_store_attrs(ref["store_url"])
    assert (attrs["iline_byte"], attrs["xline_byte"], attrs["byte_locations"]) == (9, 21, "detected")
    assert attrs["store"]["bricks"] == [6, 128, 20]  # 128^3, clipped to the survey
    assert np.array_equal(zarr.open_group(ref["store_url"], mode="r")["amplitude"][...], amplitude)
