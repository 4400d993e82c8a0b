"""Training on MDIO v1 stores as they are (issue 19, input half): stores written by the real MDIO library
(the ``mdio_stores`` fixture) registered with no copy read exactly what the SEG-Y they came from reads
once ingested; their statistics are the SEG-Y ingest's; their identity is their content; malformed
stores are refused with one line before anything is written; an S3 copy reads the same."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from support.crop_stores import crops_of
from sfm import data, storage
from sfm.data.bricks import BrickReader
from sfm.errors import SFMError
from sfm.formats import manifest
from sfm.formats.contracts import read_store_attrs, validate
from sfm.ingest.survey import ingest_survey, open_survey
from sfm.ops.slurm import training_surveys

CROP = (16, 16, 32)


@pytest.fixture(scope="module")
def registered(mdio_stores, tmp_path_factory):
    """{name: (MDIO row, SEG-Y row)}: each fixture store registered, and its SEG-Y ingested (16^3 bricks)."""
    root = tmp_path_factory.mktemp("mdio-root")
    out = {}
    for name, (mdio, sgy) in mdio_stores.items():
        out[name] = (ingest_survey(str(mdio), str(root / "mdio")), ingest_survey(str(sgy), str(root / "segy"), chunk=16))
    return out


def stored(row) -> tuple[data.SurveyInfo, object]:
    return data.read_survey_info(row["store_url"])


def read_raw(amp, region) -> np.ndarray:
    """The region's stored values through the brick reader (what the crop sampler reads)."""
    out = np.full(tuple(r.stop - r.start for r in region), np.nan, dtype=np.float32)
    BrickReader.for_array(amp).read_into(region, out, data.SurveyInfo.copy_stored_into)
    return out


@pytest.mark.parametrize("name", ["f3", "holes"])
def test_registered_mdio_reads_what_the_ingested_segy_reads(name, registered):
    mdio_row, segy_row = registered[name]
    assert mdio_row["status"] == "registered" and mdio_row["source_url"].endswith(f"{name}.mdio")
    info, amp = stored(mdio_row)
    segy_info, segy_amp = stored(segy_row)
    assert info.shape == segy_info.shape and info.source_kind == "mdio"
    np.testing.assert_array_equal(info.trace_mask, segy_info.trace_mask)
    il, xl, ns = info.shape
    whole = (slice(0, il), slice(0, xl), slice(0, ns))
    expected = np.asarray(segy_amp[...])
    got = read_raw(amp, whole)
    np.testing.assert_array_equal(got, expected)  # exact, holes included: 0 where MDIO holds NaN
    assert np.isfinite(got).all() and (got[~info.trace_mask] == 0).all()
    crossing = (slice(5, 37 if il > 37 else il), slice(3, 35 if xl > 35 else xl), slice(20, 70))  # across chunks
    np.testing.assert_array_equal(read_raw(amp, crossing), expected[crossing])
    zarr_path = np.asarray(amp[crossing])
    if name == "holes":
        assert np.isnan(zarr_path).any()  # the store itself holds NaN at the holes
        assert info.bricks == (16, 16, 32) and not info.trace_mask.all()


@pytest.mark.parametrize("brick_reader", [True, False])
def test_normalised_crops_equal_the_segy_ones(registered, brick_reader):
    mdio_row, segy_row = registered["holes"]
    kwargs = dict(seed=3, min_live_fraction=0.5, augment=data.AUGMENTATIONS, brick_reader=brick_reader)
    ours = crops_of([mdio_row["store_url"]], CROP, **kwargs)
    theirs = crops_of([segy_row["store_url"]], CROP, **kwargs)
    assert (ours.surveys.reader(0) is not None) == brick_reader
    indices = list(range(24))
    assert [ours.locate(i) for i in indices] == [theirs.locate(i) for i in indices]
    got, want = ours.read(indices), theirs.read(indices)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert ours.surveys.fetch_stats()["bytes_fetched"] > 0  # read from the MDIO store, through the counting store


@pytest.mark.parametrize("name", ["f3", "holes"])
def test_statistics_are_the_segy_ingests(name, registered):
    mdio_row, segy_row = registered[name]
    ours, theirs = json.loads(mdio_row["stats_json"]), json.loads(segy_row["stats_json"])
    assert ours.pop("fraction_read") == 1.0 and ours.pop("bytes_read") > 0
    for key in ("mean", "std"):
        assert ours.pop(key) == pytest.approx(theirs.pop(key), rel=1e-12, abs=1e-15)
    assert ours == theirs  # count, min, max, percentiles, zero and nonfinite counts: exactly
    attrs = read_store_attrs(mdio_row["store_url"])
    assert attrs["amplitude_url"] == mdio_row["source_url"] and attrs["checksum"].startswith("mdio-blake3:")
    ds = open_survey(mdio_row["store_url"])  # xarray: the MDIO store itself
    assert ds["amplitude"].shape == tuple(attrs["shape"]) and ds["amplitude"].dims[2] == attrs["sample_axis"]


def test_statistics_within_the_budget_read_evenly_spaced_columns(mdio_stores, tmp_path):
    from sfm.ingest import mdio_source

    src = mdio_source.inspect(str(mdio_stores["holes"][0]))
    column = 16 * 16 * 70 * 4
    stats = mdio_source.statistics(src, budget_bytes=3 * column)
    assert len(mdio_source.stats_columns(src, 3 * column)) == 3
    assert 0 < stats["fraction_read"] < 0.5 and stats["count"] == round(stats["fraction_read"] * 1410) * 70
    full = mdio_source.statistics(src, budget_bytes=1e9)
    assert full["bytes_read"] > stats["bytes_read"] and full["fraction_read"] == 1.0


def test_identity_is_the_content(mdio_stores, tmp_path):
    src = mdio_stores["holes"][0]
    root = str(tmp_path / "root")
    first = ingest_survey(str(src), root)
    assert ingest_survey(str(src), root)["status"] == "exists"
    copy = tmp_path / "elsewhere" / "renamed.mdio"
    shutil.copytree(src, copy)
    assert ingest_survey(str(copy), root)["status"] == "exists"  # same content: same survey
    assert ingest_survey(str(copy), str(tmp_path / "other"))["survey_id"] == first["survey_id"]
    amp = zarr.open_group(str(copy), mode="r+")["amplitude"]
    amp[0, 0, :] = np.asarray(amp[0, 0, :]) * 3 + 1  # one chunk rewritten
    changed = ingest_survey(str(copy), root)
    assert changed["status"] == "registered" and changed["survey_id"] != first["survey_id"]
    assert len(manifest.read(root)) == 2


def _break(store: Path, how: str) -> str:
    """Break a copy of a fixture store in one way; returns the words the refusal must hold."""
    amp_meta = store / "amplitude" / "zarr.json"
    meta = json.loads(amp_meta.read_text())
    if how == "no trace_mask":
        shutil.rmtree(store / "trace_mask")
        return "'trace_mask' is missing"
    if how == "dimension names":
        meta["dimension_names"] = ["crossline", "inline", "time"]
        amp_meta.write_text(json.dumps(meta))
        return "dimensions ['crossline', 'inline', 'time']"
    if how == "4-D":
        meta["shape"] += [1]
        meta["chunk_grid"]["configuration"]["chunk_shape"] += [1]
        meta["dimension_names"] += ["offset"]
        amp_meta.write_text(json.dumps(meta))
        return "is 4-D"
    if how == "uneven inlines":
        inline = zarr.open_array(str(store / "inline"), mode="r+")
        values = np.asarray(inline[...])
        values[10:] += 1  # a line missing after the 10th
        inline[...] = values
        return f"inline values are not evenly spaced (step 1 up to inline {values[9]}, then 2"
    if how == "no amplitude":
        shutil.rmtree(store / "amplitude")
        return "'amplitude' is missing"
    if how == "not v1":
        root = json.loads((store / "zarr.json").read_text())
        root["attributes"]["apiVersion"] = "0.9.2"
        (store / "zarr.json").write_text(json.dumps(root))
        return "not an MDIO v1 store"
    zarr.open_array(str(store / "trace_mask"), mode="r+")[...] = False
    return "no live trace"


@pytest.mark.parametrize("how", ["no trace_mask", "dimension names", "4-D", "uneven inlines", "no amplitude",
                                 "not v1", "no live trace"])
def test_malformed_stores_are_refused_with_one_line_before_anything_is_written(how, mdio_stores, tmp_path):
    store = tmp_path / "broken.mdio"
    shutil.copytree(mdio_stores["f3"][0], store)
    words = _break(store, how)
    root = tmp_path / "root"
    with pytest.raises(SFMError) as err:
        ingest_survey(str(store), str(root))
    message = str(err.value)
    assert "\n" not in message and f"MDIO store {store}" in message and words in message, message
    assert not root.exists()


def test_sfm_train_resolves_an_mdio_url_to_its_registration(registered, mdio_stores, tmp_path):
    mdio_row, _ = registered["f3"]
    root = mdio_row["store_url"].split("/surveys/")[0]
    url = str(mdio_stores["f3"][0])
    assert training_surveys(surveys=f"{url},{registered['holes'][1]['store_url']}", data_root=root) == [
        mdio_row["store_url"], registered["holes"][1]["store_url"]]
    with pytest.raises(SFMError, match=rf"^MDIO store {url} is not registered in {tmp_path}; register it first: "
                                       rf"sfm ingest {url} --data-root {tmp_path}$"):
        training_surveys(surveys=url, data_root=str(tmp_path))
    with pytest.raises(SFMError, match="int8.*is an MDIO store read in place"):
        crops_of([mdio_row["store_url"]], CROP, batch_dtype="int8")


def test_the_fixture_stores_fit_the_mdio_input_contract(mdio_stores):
    for mdio, _ in mdio_stores.values():
        validate("mdio_input", json.loads((Path(mdio) / "zarr.json").read_text()), str(mdio))


def test_an_s3_copy_registers_as_the_same_survey_and_reads_the_same(s3_env, mdio_stores, registered):
    bucket = s3_env.make_bucket("mdio-in")
    url = f"{bucket}/surveys/holes.mdio"
    storage.upload(mdio_stores["holes"][0], url)
    row = ingest_survey(url, f"{bucket}/sfm")
    local = registered["holes"][0]
    assert row["survey_id"] == local["survey_id"] and row["source_url"] == url
    assert json.loads(row["stats_json"])["count"] == json.loads(local["stats_json"])["count"]
    assert not [k for k in s3_env.keys("mdio-in", "sfm/") if "amplitude" in k]  # nothing copied
    kwargs = dict(seed=4, min_live_fraction=0.5)
    remote = crops_of([row["store_url"]], CROP, **kwargs)
    assert remote.surveys[0].store_url.startswith("s3://")
    np.testing.assert_allclose(remote.read([0, 1]),
                               crops_of([local["store_url"]], CROP, **kwargs).read([0, 1]), rtol=1e-6)
    assert remote.surveys.fetch_stats()["bytes_fetched"] > 0


def test_the_survey_store_contract_tells_the_two_kinds_apart(registered):
    mdio_attrs = read_store_attrs(registered["f3"][0]["store_url"])
    segy_attrs = read_store_attrs(registered["f3"][1]["store_url"])
    assert "source_kind" not in segy_attrs  # SEG-Y stores as they were
    for attrs, key in ((segy_attrs, "endian"), (segy_attrs, "source_size"), (mdio_attrs, "amplitude_url"),
                       (mdio_attrs, "sample_axis")):
        broken = {k: v for k, v in attrs.items() if k != key}
        with pytest.raises(SFMError, match=f"'{key}' is a required property"):
            validate("survey_store", broken, "store")
    with pytest.raises(SFMError, match="checksum"):
        validate("survey_store", {**mdio_attrs, "checksum": segy_attrs["checksum"]}, "store")
