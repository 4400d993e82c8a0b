"""Field SEG-Y (issue 18): pre-stack files refused as pre-stack, line numbers preferred over CDP
coordinates, exact IBM floats, and the sample axis starting at the recording delay.

Every case is a generated file; the store is compared with segyio's reading, or ibm2ieee's values for IBM.
"""

from __future__ import annotations

import numpy as np
import pytest
import segyio
import zarr

from sfm.errors import SFMError
from sfm.formats.contracts import read_store_attrs
from sfm.ingest.survey import ingest_survey
from support import ingest_cases as cases
from support.ibm_words import ibm2ieee_float32, ingest_words

pytestmark = pytest.mark.integration

NS = 16


def generated(tmp_path, name: str, shape=(6, 5, NS), **options):
    """(path, amplitude [IL, XL, NS], file header, trace records) of a format-5 file from synth."""
    amplitude = cases.volume(shape, seed=7)
    path = cases.write(tmp_path / name, amplitude, **options)
    head, records = cases.traces(path, shape[2])
    return path, amplitude, head, records


def refusal(path, tmp_path, **settings) -> str:
    with pytest.raises(SFMError) as err:
        ingest_survey(str(path), str(tmp_path / "root"), **settings)
    message = str(err.value)
    assert "\n" not in message and path.name in message
    assert not (tmp_path / "root" / "surveys").exists() or not any((tmp_path / "root" / "surveys").iterdir())
    return message


# --------------------------------------------------------------------------------------------
# pre-stack


def test_shot_gather_is_refused_naming_its_offsets(tmp_path):
    # 6 shots (byte 9) x 5 channels (byte 21): a full "grid" of one trace each, offsets along the spread
    path, _, head, records = generated(tmp_path, "shots.sgy", iline_byte=9, xline_byte=21)
    channel = np.tile(np.arange(5), 6)
    cases.set_fields(records, 37, 100 + 50 * channel)
    cases.set_fields(records, 189, 0)
    cases.set_fields(records, 193, 0)
    cases.rewrite(path, head, records)
    message = refusal(path, tmp_path)
    assert "pre-stack data: 5 offsets from 100 to 300 (trace bytes 37-40)" in message
    assert "1 trace per location at bytes 9/21" in message and "shot gather" in message
    assert "stack the gathers, or select one offset" in message
    assert "pre-stack" in refusal(path, tmp_path, iline_byte=9, xline_byte=21)  # whatever bytes are given


def test_single_cdp_gather_is_refused_as_pre_stack(tmp_path):
    path, _, head, records = generated(tmp_path, "cdp.sgy", shape=(1, 12, NS))
    for byte, value in ((189, 1200), (193, 3400), (21, 77), (181, 60500000), (185, 607300000)):
        cases.set_fields(records, byte, value)  # one location at every byte pair
    cases.set_fields(records, 37, 25 * np.arange(12))
    cases.rewrite(path, head, records)
    message = refusal(path, tmp_path)
    assert "pre-stack data: 12 offsets from 0 to 275" in message
    assert "all 12 traces at one location (bytes 189/193 = 1200/3400): a single gather" in message
    assert "inline/crossline grid" not in message


def test_cdp_gathers_are_refused_with_traces_per_location(tmp_path):
    path, _, head, records = generated(tmp_path, "gathers.sgy", shape=(4, 3, NS))
    gathers = np.repeat(records, 3, axis=0)  # each location three times, at offsets 100, 200, 300
    cases.set_fields(gathers, 37, np.tile([100, 200, 300], 12))
    cases.rewrite(path, head, gathers)
    message = refusal(path, tmp_path)
    assert "3 offsets from 100 to 300" in message
    assert "3.0 traces per (inline, crossline) location at bytes 189/193" in message


def test_common_offset_cube_ingests(tmp_path):
    path, amplitude, head, records = generated(tmp_path, "common-offset.sgy")
    cases.set_fields(records, 37, 450)  # one offset, not 0: still post-stack
    cases.rewrite(path, head, records)
    row = ingest_survey(str(path), str(tmp_path / "root"))
    assert np.array_equal(zarr.open_group(row["store_url"], mode="r")["amplitude"][...], amplitude)


# --------------------------------------------------------------------------------------------
# line numbers before CDP coordinates


def regular_coordinates(records: np.ndarray, shape) -> None:
    """CDP X/Y (181/185) on an unrotated 25 m grid: X along crosslines, Y along inlines."""
    i, j = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    cases.set_fields(records, 181, 600000 + 25 * j.ravel())
    cases.set_fields(records, 185, 6070000 + 25 * i.ravel())
    cases.set_fields(records, 71, 1, width=2)


def test_line_numbers_at_221_win_over_regular_cdp_coordinates(tmp_path):
    path, amplitude, head, records = generated(tmp_path, "bytes-221.sgy", iline_byte=221, xline_byte=225)
    regular_coordinates(records, amplitude.shape)
    cases.rewrite(path, head, records)
    row = ingest_survey(str(path), str(tmp_path / "root"))
    attrs = read_store_attrs(row["store_url"])
    assert (attrs["iline_byte"], attrs["xline_byte"], attrs["byte_locations"]) == (221, 225, "detected")
    group = zarr.open_group(row["store_url"], mode="r")
    assert list(group["inline"][...]) == list(range(100, 106))
    assert list(group["crossline"][...]) == list(range(300, 305))
    assert np.array_equal(group["amplitude"][...], amplitude)


def test_cdp_coordinates_are_taken_last_and_said_so(tmp_path):
    path, amplitude, head, records = generated(tmp_path, "coords-only.sgy")
    regular_coordinates(records, amplitude.shape)
    for byte in (189, 193, 21):
        cases.set_fields(records, byte, 0)  # no line numbers anywhere
    cases.rewrite(path, head, records)
    row = ingest_survey(str(path), str(tmp_path / "root"))
    attrs = read_store_attrs(row["store_url"])
    said = "detected (CDP coordinates 181/185: no line-number pair formed a grid)"
    assert (attrs["iline_byte"], attrs["xline_byte"], attrs["byte_locations"]) == (181, 185, said)
    assert row["details"]["byte_locations"] == said and "CDP coordinates 181/185" in row["message"]
    assert set(attrs["byte_pairs_rejected"]) == {"189/193", "9/21", "221/225"}
    group = zarr.open_group(row["store_url"], mode="r")
    assert list(group["inline"][...]) == list(range(600000, 600125, 25))  # X varies along crossline j...
    assert np.array_equal(group["amplitude"][...], amplitude.transpose(1, 0, 2))  # ...so it is the first axis


# --------------------------------------------------------------------------------------------
# IBM floats


@pytest.mark.parametrize("endian", ["big", "little"])
def test_ibm_samples_equal_ibm2ieee_through_ingest(tmp_path, endian):
    shape = (5, 4, 160)  # 3200 samples: every edge word and random ones
    amplitude = cases.volume(shape)
    path = cases.write(tmp_path / f"ibm-{endian}.sgy", amplitude, sample_format=1, endian=endian)
    head, records = cases.traces(path, shape[2])
    words = ingest_words(int(np.prod(shape))).reshape(20, shape[2])
    cases.set_ibm_words(records, words, endian)
    cases.rewrite(path, head, records)
    row = ingest_survey(str(path), str(tmp_path / "root"))
    expected = ibm2ieee_float32("ingest", words.ravel()).reshape(words.shape).copy()
    overflow = ~np.isfinite(expected)
    expected[overflow] = 0.0  # ingest replaces inf by 0 and counts it
    stored = zarr.open_group(row["store_url"], mode="r")["amplitude"][...].reshape(20, shape[2])
    assert np.array_equal(stored.view(np.uint32), expected.view(np.uint32))  # bit for bit, signed zeros too
    assert read_store_attrs(row["store_url"])["stats"]["nonfinite_replaced"] == int(overflow.sum()) > 0
    unnormalised = (words & 0xF00000 == 0) & (words & 0xFFFFFF != 0) & ~overflow
    assert unnormalised.sum() > 100 and (stored[unnormalised] != 0).any()


# --------------------------------------------------------------------------------------------
# sample axis


@pytest.mark.parametrize("delay", [20, -8])
def test_sample_axis_starts_at_the_delay_like_segyio(tmp_path, delay):
    path, amplitude, head, records = generated(tmp_path, f"delay{delay}.sgy", sample_interval_us=2000)
    cases.set_fields(records, 109, delay, width=2)
    cases.rewrite(path, head, records)
    with segyio.open(str(path)) as f:
        expected = np.asarray(f.samples)
    row = ingest_survey(str(path), str(tmp_path / "root"))
    group = zarr.open_group(row["store_url"], mode="r")
    assert expected[0] == delay and np.array_equal(group["sample"][...], expected)
    assert read_store_attrs(row["store_url"])["sample_start_ms"] == delay == row["sample_start_ms"]
    assert np.array_equal(group["amplitude"][...], amplitude)


def test_traces_with_different_delays_are_refused(tmp_path):
    path, _, head, records = generated(tmp_path, "delays.sgy")
    cases.set_fields(records, 109, 0, width=2)
    cases.set_fields(records[7:9], 109, 40, width=2)
    cases.rewrite(path, head, records)
    message = refusal(path, tmp_path)
    assert "delay recording time (trace bytes 109-110) is 0 ms in 28 of 30 traces but 40 ms in trace #8" in message
