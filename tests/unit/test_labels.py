"""Label volumes in (sfm.ingest.labels): from .npy, SEG-Y and Zarr, sparse or dense, validated against the
survey's grid, content-addressed, published last; a label file that does not fit is refused in one line
with nothing written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support import ingest_cases

from sfm.errors import SFMError
from sfm.formats import manifest
from sfm.formats.label_store import open_labels
from sfm.ingest.labels import ingest_labels
from sfm.ingest.survey import ingest_survey
from sfm.synth.survey import SegyOptions, synth_survey, write_segy

SHAPE = (24, 20, 32)


@pytest.fixture(scope="module")
def survey(tmp_path_factory):
    """A generated survey (inlines 100.., crosslines 300..) ingested, and its fault labels."""
    tmp = tmp_path_factory.mktemp("labels")
    made = synth_survey(tmp / "s.sgy", shape=SHAPE, seed=3)
    root = str(tmp / "root")
    row = ingest_survey(made["segy"], root, chunk=8)
    return tmp, root, row, np.load(made["faults"])


def fresh_root(row: dict, tmp: Path) -> Path:
    """A data root holding the survey alone (its store and manifest row), for a test of its own."""
    import shutil

    root, source = tmp / "root", Path(row["store_url"]).parent.parent
    shutil.copytree(source / "surveys", root / "surveys")
    shutil.copytree(source / "manifest" / "rows", root / "manifest" / "rows")
    return root


def published_labels(root: str) -> list[str]:
    return [r["label_id"] for r in manifest.label_rows(root)]


def test_dense_npy_labels_are_stored_on_the_survey_grid_and_open_in_xarray(survey, tmp_path):
    _, _, row, faults = survey
    root = str(fresh_root(row, tmp_path))
    np.save(tmp_path / "faults.npy", faults)
    got = ingest_labels(str(tmp_path / "faults.npy"), row["survey_id"], root)
    assert got["status"] == "ingested" and got["survey_id"] == row["survey_id"]
    assert got["labelled_voxels"] == faults.size and got["classes"] == sorted(np.unique(faults).tolist())
    attrs, labels, mask = open_labels(got["store_url"])
    assert np.array_equal(labels[...], faults) and mask.all() and attrs["class_voxels"][1] == int(faults.sum())
    assert published_labels(root) == [got["label_id"]]
    import xarray as xr

    ds = xr.open_zarr(got["store_url"], zarr_format=3)
    assert ds["labels"].dims == ("inline", "crossline", "sample") and int(ds["inline"][0]) == 100
    again = ingest_labels(str(tmp_path / "faults.npy"), row["store_url"], root)  # by store URL this time
    assert again["status"] == "exists" and again["label_id"] == got["label_id"]


def test_labels_on_every_eighth_inline_keep_the_rest_unlabelled(survey, tmp_path):
    _, root, row, faults = survey
    sparse = np.full(SHAPE, -1, np.int16)
    sparse[::8] = faults[::8]
    np.save(tmp_path / "sparse.npy", sparse)
    got = ingest_labels(str(tmp_path / "sparse.npy"), row["survey_id"], root, ignore=-1)
    assert got["labelled_inlines"] == 3 and got["labelled_crosslines"] == SHAPE[1]
    _, labels, mask = open_labels(got["store_url"])
    expected = np.full(SHAPE, 255, np.uint8)
    expected[::8] = faults[::8]
    assert np.array_equal(labels[...], expected)
    assert np.array_equal(mask, np.repeat((np.arange(SHAPE[0]) % 8 == 0)[:, None], SHAPE[1], axis=1))


def test_a_segy_with_the_survey_geometry_gives_the_same_label_set_and_missing_traces_are_unlabelled(survey, tmp_path):
    _, root, row, faults = survey
    np.save(tmp_path / "f.npy", faults)
    from_npy = ingest_labels(str(tmp_path / "f.npy"), row["survey_id"], root)
    write_segy(tmp_path / "f.sgy", faults.astype(np.float32), SegyOptions())
    from_segy = ingest_labels(str(tmp_path / "f.sgy"), row["survey_id"], root)
    assert from_segy["label_id"] == from_npy["label_id"]  # content-addressed: the classes, not the file
    keep = np.ones(SHAPE[0] * SHAPE[1], bool)
    keep[:SHAPE[1]] = False  # the first inline's traces are missing
    write_segy(tmp_path / "g.sgy", faults.astype(np.float32), SegyOptions(sorting="crossline"))
    order = np.arange(SHAPE[0] * SHAPE[1]).reshape(SHAPE[:2]).T.ravel()  # file order of a crossline-sorted file
    ingest_cases.drop_traces(tmp_path / "g.sgy", SHAPE[2], keep[order])
    got = ingest_labels(str(tmp_path / "g.sgy"), row["survey_id"], root)
    _, labels, mask = open_labels(got["store_url"])
    assert not mask[0].any() and mask[1:].all()
    assert (labels[0] == 255).all() and np.array_equal(labels[1:], faults[1:])


def test_a_zarr_store_with_an_integer_variable_and_the_survey_coordinates(survey, tmp_path):
    import zarr

    _, root, row, faults = survey
    group = zarr.open_group(str(tmp_path / "l.zarr"), mode="w", zarr_format=3)
    group.create_array("faults", data=faults.astype(np.int32))
    group.create_array("amplitude", data=np.zeros(SHAPE, np.float32))
    group.create_array("inline", data=np.arange(100, 100 + SHAPE[0], dtype=np.int32))
    got = ingest_labels(str(tmp_path / "l.zarr"), row["survey_id"], root)
    assert got["labelled_voxels"] == faults.size
    group["inline"][0] = 99
    with pytest.raises(SFMError, match=r"l.zarr: inline numbers \[99\]"):
        ingest_labels(str(tmp_path / "l.zarr"), row["survey_id"], root)


def refused(call) -> str:
    with pytest.raises(SFMError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_label_segy_whose_grid_does_not_match_is_refused_in_one_line_with_nothing_published(survey, tmp_path):
    _, _, row, faults = survey
    root = fresh_root(row, tmp_path)
    cases = {  # the label file, and what the refusal names
        "shifted.sgy": (faults.astype(np.float32), SegyOptions(first_inline=104), r"inline numbers off .* grid"),
        "short.sgy": (faults[:, :, :16].astype(np.float32), SegyOptions(), "16 samples per trace"),
        "slow.sgy": (faults.astype(np.float32), SegyOptions(sample_interval_us=2000), "sample interval 2000 us"),
        "wide.sgy": (np.zeros((SHAPE[0], SHAPE[1] + 2, SHAPE[2]), np.float32), SegyOptions(), "crossline numbers off"),
        "halves.sgy": (faults + np.float32(0.5), SegyOptions(), "value 0.5 at inline 100, crossline 300, sample 0"),
    }
    for name, (values, options, match) in cases.items():
        write_segy(tmp_path / name, values, options)
        message = refused(lambda: ingest_labels(str(tmp_path / name), row["survey_id"], str(root)))
        assert message.startswith(f"label file {tmp_path / name}:") and __import__("re").search(match, message), message
    np.save(tmp_path / "small.npy", faults[:-1])
    assert "shape [23, 20, 32] does not match" in refused(
        lambda: ingest_labels(str(tmp_path / "small.npy"), row["survey_id"], str(root)))
    np.save(tmp_path / "float.npy", faults.astype(np.float32))
    assert "dtype float32 is not an integer class" in refused(
        lambda: ingest_labels(str(tmp_path / "float.npy"), row["survey_id"], str(root)))
    assert published_labels(str(root)) == [] and not (root / "labels").exists()  # nothing written


def test_the_cli_ingests_labels_and_refuses_a_mismatch_in_one_line(survey, tmp_path, capsys):
    import json

    from sfm.cli import main

    _, _, row, faults = survey
    root = fresh_root(row, tmp_path)
    write_segy(tmp_path / "bad.sgy", faults.astype(np.float32), SegyOptions(first_crossline=290))
    assert main(["ingest-labels", str(tmp_path / "bad.sgy"), "--survey", row["survey_id"],
                 "--data-root", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"sfm ingest-labels: error: label file {tmp_path / 'bad.sgy'}: ") and "\n" not in err
    np.save(tmp_path / "ok.npy", faults)
    assert main(["ingest-labels", str(tmp_path / "ok.npy"), "--survey", row["survey_id"],
                 "--data-root", str(root)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "ingested" and published_labels(str(root)) == [out["label_id"]]
