"""Stores ingested with ``ingest.layout = "mdio"`` (issue 19, output half) read and exported by the real MDIO
library (multidimio 1.1.3 in its own environment, tests/support/mdio_env.py): what ``mdio.open_mdio`` sees,
the SEG-Y ``mdio.mdio_to_segy`` writes read back by segyio against the original file, sfm's own loader on
the same store, the parts ingest byte for byte, and the refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import segyio
from support import ingest_cases as cases
from support.crop_stores import crops_of
from support.mdio_env import describe, mdio_to_segy

from sfm.config import IngestConfig, JobConfig
from sfm.errors import SFMError
from sfm.formats import segy
from sfm.ingest import parts
from sfm.ingest.survey import ingest_survey

MDIO = IngestConfig(layout="mdio")
REVISION = {segyio.BinField.SEGYRevision, segyio.BinField.SEGYRevisionMinor}  # MDIO writes rev 1's 16-bit code
UNASSIGNED = {segyio.TraceField.UnassignedInt1, segyio.TraceField.UnassignedInt2}  # bytes 233-240: MDIO drops them


def _traces(path: Path, endian: str = "big") -> dict[tuple[int, int], tuple[np.ndarray, dict]]:
    """{(inline, crossline): (samples float64 [NS], header fields)} of every trace segyio reads in ``path``."""
    out = {}
    with segyio.open(str(path), ignore_geometry=True, endian=endian) as f:
        for t in range(f.tracecount):
            header = {k: v for k, v in f.header[t].items() if k not in UNASSIGNED}
            key = (header[segyio.TraceField.INLINE_3D], header[segyio.TraceField.CROSSLINE_3D])
            out[key] = (np.asarray(f.trace[t], dtype=np.float64), header)
    return out


def _file_headers(path: Path, endian: str = "big") -> tuple[bytes, dict, np.ndarray]:
    with segyio.open(str(path), ignore_geometry=True, endian=endian) as f:
        return bytes(f.text[0]), dict(f.bin), np.asarray(f.samples)


def _expected_stats(traces: dict) -> dict:
    values = np.concatenate([samples for samples, _ in traces.values()])
    return {"count": values.size, "sum": values.sum(), "sumSquares": np.square(values).sum(),
            "min": values.min(), "max": values.max()}


def _check_mdio_view(store: str, src: Path, domain: str, endian: str = "big") -> dict:
    """What MDIO sees in ``store``: its dims, root attributes, statsV1 and coordinates against the SEG-Y ``src``."""
    seen = describe(store)
    traces = _traces(src, endian)
    _, _, samples = _file_headers(src, endian)
    assert seen["dims"] == ["inline", "crossline", domain] and seen["dtype"] == "float32"
    assert seen["has_file_header"] and {"headers", "trace_mask", "cdp_x", "cdp_y", domain} <= set(seen["variables"])
    attrs = seen["attrs"]
    assert attrs["apiVersion"] == "1.1.3" and attrs["name"] == f"PostStack3D{domain.capitalize()}"
    assert attrs["attributes"] == {"surveyType": "3D", "gatherType": "stacked", "defaultVariableName": "amplitude"}
    assert attrs["survey_name"] == src.stem and attrs["stats"]["count"] == seen["stats"]["count"]  # sfm's kept
    assert seen["live_traces"] == len(traces)
    expected = _expected_stats(traces)
    assert seen["stats"]["count"] == expected["count"]
    for key in ("sum", "sumSquares", "min", "max"):  # float32 partial sums: to about 1e-7 of the total
        assert seen["stats"][key] == pytest.approx(expected[key], rel=1e-6, abs=1e-6 * expected["sumSquares"] ** 0.5)
    assert seen["stats"]["histogram"] == {"counts": [], "binCenters": []}
    lines = np.array(sorted(traces))
    assert seen["coords"]["inline"] == sorted(set(lines[:, 0].tolist()))
    assert seen["coords"]["crossline"] == sorted(set(lines[:, 1].tolist()))
    assert np.array_equal(seen["coords"][domain], samples)
    return seen


def _check_export(store: str, src: Path, out: Path, sample_format: str, endian: str = "big") -> None:
    """``mdio_to_segy`` of ``store`` read back by segyio: the original's live traces (exactly), every kept
    trace header field, the binary header (the revision as MDIO writes it) and the textual header."""
    mdio_to_segy(store, out, sample_format)
    original, exported = _traces(src, endian), _traces(out)
    assert sorted(exported) == sorted(original)
    for key, (samples, header) in original.items():
        assert np.array_equal(exported[key][0], samples), key
        assert exported[key][1] == header, key
    text, binary, samples = _file_headers(src, endian)
    text_out, binary_out, samples_out = _file_headers(out)
    assert np.array_equal(samples_out, samples)
    # the text (segyio decodes EBCDIC) comes back character for character but where one is no printable
    # ASCII (Format1msb ends in an EBCDIC control byte): MDIO's export writes a space there
    differ = [k for k in range(3200) if text_out[k] != text[k]]
    assert len(differ) < 32 and all(text_out[k] == 0x20 and not 32 <= text[k] < 127 for k in differ)
    assert {k: v for k, v in binary_out.items() if k not in REVISION} == \
           {k: v for k, v in binary.items() if k not in REVISION}


@pytest.mark.parametrize("name, sample_format, endian", [
    ("f3.sgy", "store", "big"),  # 2-byte integers, exported as such
    ("Format1msb.sgy", "spec", "big"),  # IBM floats: MDIO's default rev 1 export
    ("Format5lsb.sgy", "store", "little"),  # little-endian IEEE floats, exported big-endian IEEE
])
def test_real_surveys_open_and_export_with_mdio(name, sample_format, endian, segy_dir, tmp_path):
    src = segy_dir / name
    row = ingest_survey(str(src), str(tmp_path / "root"), MDIO)
    _check_mdio_view(row["store_url"], src, "time", endian)
    _check_export(row["store_url"], src, tmp_path / "out.sgy", sample_format, endian)


@pytest.mark.parametrize("dtype", ["int8", "float16"])
def test_quantised_stores_export_what_sfm_decodes(dtype, segy_dir, tmp_path):
    """MDIO decodes the CF scale_factor / add_offset of an int8 or float16 store: its export holds the stored
    values decoded (amplitude = stored * scale + offset), float32, on every live trace."""
    import zarr

    src = segy_dir / "Format5lsb.sgy"
    row = ingest_survey(str(src), str(tmp_path / "root"), IngestConfig(layout="mdio", dtype=dtype))
    mdio_to_segy(row["store_url"], tmp_path / "out.sgy", "store")
    group = zarr.open_group(row["store_url"], mode="r")
    transform = group.attrs["amplitude_transform"]
    stored = group["amplitude"][...].astype(np.float64)
    decoded = (stored * transform["scale"] + transform["offset"]).astype(np.float32)
    original, exported = _traces(src, "little"), _traces(tmp_path / "out.sgy")
    assert sorted(exported) == sorted(original)
    inlines, crosslines = list(group["inline"][...]), list(group["crossline"][...])
    for (il, xl), (samples, header) in exported.items():
        assert np.array_equal(samples, decoded[inlines.index(il), crosslines.index(xl)]), (il, xl)
        assert header == original[(il, xl)][1]
    amplitude = np.stack([original[k][0] for k in sorted(original)])
    error = np.abs(np.stack([exported[k][0] for k in sorted(original)]) - amplitude)
    if dtype == "int8":  # within half a step inside the clip range, saturated beyond it
        inside = (amplitude >= transform["clip"][0]) & (amplitude <= transform["clip"][1])
        assert 0 < error[inside].max() <= transform["scale"] * 0.5 * 1.001 and (~inside).any()
    else:  # float16's 11-bit significand
        assert 0 < error.max() <= np.abs(amplitude - transform["offset"]).max() * 2.0**-11


def _holes_survey(path: Path, shape=(20, 14, 40), delay_ms: int = 96) -> Path:
    """A generated IEEE survey, 25 traces missing, every trace recorded from ``delay_ms``."""
    cases.write(path, cases.volume(shape, seed=4))
    head, records = cases.traces(path, shape[2])
    cases.set_fields(records, 109, delay_ms, width=2)
    keep = np.ones(len(records), dtype=bool)
    keep[np.random.default_rng(8).choice(len(records), 25, replace=False)] = False
    return cases.rewrite(path, head, records[keep])


def test_survey_with_holes_and_delay_in_depth_opens_exports_and_loads(tmp_path):
    src = _holes_survey(tmp_path / "holes.sgy")
    sfm_row = ingest_survey(str(src), str(tmp_path / "sfm"), IngestConfig(chunk=8))
    row = ingest_survey(str(src), str(tmp_path / "mdio"), IngestConfig(chunk=8, layout="mdio", domain="depth"))
    seen = _check_mdio_view(row["store_url"], src, "depth")
    assert seen["coords"]["depth"][:2] == [96, 100] and seen["live_traces"] == 20 * 14 - 25
    _check_export(row["store_url"], src, tmp_path / "out.sgy", "store")

    samplers = [crops_of([r["store_url"]], (8, 8, 16), seed=3) for r in (sfm_row, row)]
    for i in range(6):  # sfm's loader reads the mdio layout as it reads its own
        crop = samplers[1].read([i])
        assert np.array_equal(crop, samplers[0].read([i])) and np.abs(crop).max() > 0
    zattrs = json.loads((Path(row["store_url"]) / "zarr.json").read_text())["attributes"]
    assert zattrs["name"] == "PostStack3DDepth" and "createdOn" not in zattrs


def test_mdio_layout_parts_and_reruns_write_the_one_task_store(tmp_path, monkeypatch):
    """4 scan parts and 4 write parts (out of order) give the one-task mdio store byte for byte, headers and
    statsV1 included; so does a second one-task ingest."""
    monkeypatch.setattr(segy, "PIECE_BYTES", 1 << 20)
    src = _holes_survey(tmp_path / "parts.sgy", shape=(64, 24, 200))
    cfg = IngestConfig(chunk=16, layout="mdio", domain="depth")
    one = ingest_survey(str(src), str(tmp_path / "one"), cfg)
    again = ingest_survey(str(src), str(tmp_path / "again"), cfg)
    digests = cases.store_digests(Path(one["store_url"]))
    assert cases.store_digests(Path(again["store_url"])) == digests
    assert any(k.startswith("headers/c/") for k in digests) and "segy_file_header/zarr.json" in digests

    root = str(tmp_path / "parts")
    scans = parts.plan_scans(str(src), "key", root, cfg, parts=4)
    writes = parts.plan_writes([parts.scan_part(s, cfg) for s in reversed(scans)], root, cfg)
    assert len(writes) == 4
    for k in (2, 0, 3, 1):
        parts.write_part(writes[k], cfg)
    row = parts.publish_parts(writes, root)
    assert cases.store_digests(Path(row["store_url"])) == digests


@pytest.mark.parametrize("setting, message", [
    ({"layout": "zarr"}, r"ingest\.layout = 'zarr' is not a store layout; use sfm, or mdio"),
    ({"domain": "twt"}, r"ingest\.domain = 'twt' is not a sample domain; use time or depth"),
    ({"layout": "MDIO"}, r"ingest\.layout = 'MDIO' is not a store layout"),
])
def test_bad_layout_settings_are_refused_in_one_line(setting, message):
    with pytest.raises(SFMError, match=message) as err:
        IngestConfig(**setting).check()
    assert "\n" not in str(err.value)
    job = JobConfig.from_dict({"ingest": setting})
    with pytest.raises(SFMError, match=message):
        job.validate()


def test_cli_refuses_a_bad_layout_before_reading_any_file(tmp_path):
    for flags, message in ((["--layout", "mdi0"], "argument --layout: invalid choice: 'mdi0'"),
                           (["--domain", "Depth"], "argument --domain: invalid choice: 'Depth'")):
        proc = subprocess.run([sys.executable, "-m", "sfm.cli", "ingest", str(tmp_path / "missing.sgy"), "--data-root",
                               str(tmp_path / "root"), *flags], capture_output=True, text=True)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sfm ingest: error: ") and message in lines[0], proc.stderr


def test_mdio_layout_on_s3_is_the_local_store(tmp_path, s3_env):
    """Into a bucket on the loopback S3 server (header chunks and the file header PUT like the rest): the same
    objects, byte for byte, as the local store."""
    import hashlib

    from sfm import storage

    src = _holes_survey(tmp_path / "s3.sgy", shape=(24, 20, 60))
    cfg = IngestConfig(chunk=8, layout="mdio")
    local = ingest_survey(str(src), str(tmp_path / "local"), cfg)
    bucket = s3_env.make_bucket("mdio-out")
    remote = ingest_survey(str(src), f"{bucket}/root", cfg)
    prefix = remote["store_url"][len(f"{bucket}/"):] + "/"
    keys = s3_env.keys(bucket[len("s3://"):], prefix)
    remote_digests = {k[len(prefix):]: hashlib.sha256(storage.read_bytes(f"{bucket}/{k}")).hexdigest() for k in keys}
    assert remote_digests == cases.store_digests(Path(local["store_url"]))
