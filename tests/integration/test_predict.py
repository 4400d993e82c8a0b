"""`sfm predict` on a small generated survey with dead traces (issue 49): the parts blend the windows as running
each window alone and blending in memory does; the store opens in xarray with the survey's coordinates; the
SEG-Y export carries the source's headers (from the source SEG-Y, or from an MDIO-layout store's headers); a
part killed mid-way is run again alone and the published store equals an uninterrupted run's; user errors
are one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import segyio
import torch
import xarray as xr
import zarr
from support import ingest_cases as cases
from support.predict_reference import SurveyValues, blended

from sfm import cli, storage
from sfm.model import registry
from sfm.ingest.survey import ingest_survey
from sfm.model import build_model, mae_config
from sfm.model.io import save as save_mae
from sfm.model.segmenter import Segmenter, Task, save_segmenter
from sfm.predict import PredictOptions, plan_prediction, predict, run_part

SHAPE = (70, 45, 12)  # 5 shard rows of 16 inlines; fewer samples than the crop: one padded window
CROP = (16, 16, 16)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Windows of 16^3 voxels are too small to share between threads: torch's second thread only spins."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A survey with dead traces ingested twice (sfm and mdio layouts), a binary task model registered as
    sfm-faults v1 and a 3-class one exported to a folder."""
    tmp = tmp_path_factory.mktemp("predict")
    src = cases.write(tmp / "small.sgy", cases.volume(SHAPE, seed=3))
    keep = np.ones(SHAPE[0] * SHAPE[1], bool)
    keep[[5, 6, 7, 300, 1001, 2000, 3140]] = False
    cases.drop_traces(src, SHAPE[2], keep)
    root = tmp / "data"
    store = ingest_survey(str(src), str(root), chunk=16)["store_url"]
    mdio_store = ingest_survey(str(src), str(tmp / "mdio-data"), chunk=16, layout="mdio")["store_url"]
    torch.manual_seed(0)
    binary = Segmenter(build_model(mae_config("tiny", crop=CROP)), Task())
    save_segmenter(binary, str(tmp / "binary"))
    registry.register(str(root), "sfm-faults", str(tmp / "binary"), config={}, metrics={}, force_champion=True,
                      lineage={"run_pathspec": "test", "manifest_version": "m1", "code_version": "t", "surveys": []})
    three = Segmenter(build_model(mae_config("tiny", crop=(16, 8, 16))), Task.parse("classes:3"))
    save_segmenter(three, str(tmp / "three"))
    return {"tmp": tmp, "src": src, "root": str(root), "store": store, "mdio_store": mdio_store,
            "binary": binary.eval(), "three": three.eval()}


def whole(shape):
    return tuple((0, n) for n in shape)


def test_parts_blend_like_every_window_alone_and_open_in_xarray(small):
    out = small["tmp"] / "faults.zarr"
    result = predict(PredictOptions(model="sfm-faults:v1", survey=small["store"], out=str(out),
                                    data_root=small["root"], parts=3, mirror=True))
    assert result["published"] and result["ran"] == [0, 1, 2]
    ds = xr.open_zarr(out)
    survey = xr.open_zarr(small["store"])
    assert ds.probability.dims == ("inline", "crossline", "sample") and ds.probability.shape == SHAPE
    for name in ("inline", "crossline", "sample", "cdp_x", "cdp_y", "trace_mask"):
        np.testing.assert_array_equal(ds[name].values, survey[name].values)
    expected = blended(small["binary"], SurveyValues(small["store"]), whole(SHAPE), 0.5, mirror=True)[0]
    got = ds.probability.values
    mask = survey.trace_mask.values
    np.testing.assert_allclose(got[mask], expected[mask], atol=2e-6)
    assert (got[~mask] == 0).all() and not os.path.exists(out / ".predict")
    assert ds.attrs["model"]["name"] == "sfm-faults" and ds.attrs["model"]["version"] == 1
    assert ds.attrs["stats"]["count"] == int(mask.sum()) * SHAPE[2]


def test_several_classes_as_probabilities_and_as_classes(small):
    probs = predict(PredictOptions(model=str(small["tmp"] / "three"), survey=small["store"],
                                   out=str(small["tmp"] / "three.zarr"), parts=2))
    classes = predict(PredictOptions(model=str(small["tmp"] / "three"), survey=small["store"],
                                     out=str(small["tmp"] / "three-classes.zarr"), output="classes"))
    p = xr.open_zarr(probs["out"]).probability
    assert p.dims == ("inline", "crossline", "sample", "class") and p.shape == (*SHAPE, 3)
    expected = np.moveaxis(blended(small["three"], SurveyValues(small["store"]), whole(SHAPE), 0.5, False), 0, -1)
    mask = xr.open_zarr(small["store"]).trace_mask.values
    np.testing.assert_allclose(p.values[mask], expected[mask], atol=2e-6)
    c = xr.open_zarr(classes["out"]).classes.values
    assert c.dtype == np.uint8
    clear = np.sort(expected, axis=-1)[..., -1] - np.sort(expected, axis=-1)[..., -2] > 1e-4
    np.testing.assert_array_equal(c[mask & clear.all(axis=-1)], expected.argmax(-1)[mask & clear.all(axis=-1)])
    assert sum(classes["stats"]["class_counts"]) == int(mask.sum()) * SHAPE[2]


def headers_of(path):
    with segyio.open(path, ignore_geometry=True) as f:
        return [dict(h) for h in f.header], np.stack([f.trace[t] for t in range(f.tracecount)])


def test_segy_export_carries_the_source_headers(small, tmp_path):
    out, sgy = tmp_path / "classes.zarr", tmp_path / "classes.sgy"
    predict(PredictOptions(model="sfm-faults", survey=small["store"], out=str(out), data_root=small["root"],
                           output="classes", segy=str(sgy), overlap=0.25))
    source_headers, _ = headers_of(small["src"])
    exported, samples = headers_of(sgy)
    assert exported == source_headers  # every field of every trace, in the source's order
    ds = xr.open_zarr(out)
    il = np.searchsorted(ds.inline.values, [h[segyio.su.iline] for h in exported])
    xl = np.searchsorted(ds.crossline.values, [h[segyio.su.xline] for h in exported])
    np.testing.assert_array_equal(samples, ds.classes.values[il, xl])

    # an MDIO-layout store whose source SEG-Y is gone: the export is rebuilt from the store's headers
    moved = small["src"].with_suffix(".away")
    os.rename(small["src"], moved)
    try:
        out2, sgy2 = tmp_path / "mdio.zarr", tmp_path / "mdio.sgy"
        predict(PredictOptions(model="sfm-faults", survey=small["mdio_store"], out=str(out2),
                               data_root=small["root"], layout="mdio", segy=str(sgy2), overlap=0.25))
    finally:
        os.rename(moved, small["src"])
    rebuilt, values = headers_of(sgy2)
    keys = (segyio.su.iline, segyio.su.xline, segyio.su.cdpx, segyio.su.cdpy, segyio.su.scalco, segyio.su.ns)
    by_cell = {(h[segyio.su.iline], h[segyio.su.xline]): [h[k] for k in keys] for h in source_headers}
    assert len(rebuilt) == len(source_headers)
    assert all([h[k] for k in keys] == by_cell[(h[segyio.su.iline], h[segyio.su.xline])] for h in rebuilt)
    mdio = zarr.open_group(str(out2), mode="r")
    assert mdio.attrs["attributes"]["defaultVariableName"] == "probability" and "statsV1" in mdio["probability"].attrs
    assert "headers" in mdio and xr.open_zarr(out2).probability.dims == ("inline", "crossline", "time")
    il = np.searchsorted(mdio["inline"][...], [h[segyio.su.iline] for h in rebuilt])
    xl = np.searchsorted(mdio["crossline"][...], [h[segyio.su.xline] for h in rebuilt])
    np.testing.assert_array_equal(values, mdio["probability"][...][il, xl])


def shard_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "probability").rglob("*")) if p.is_file()}


def test_a_killed_part_is_run_again_alone_and_the_store_equals_an_uninterrupted_run(small, tmp_path):
    opts = dict(model="sfm-faults:v1", survey=small["store"], data_root=small["root"], parts=3, mirror=True,
                batch_size=1)
    whole_run = predict(PredictOptions(out=str(tmp_path / "whole.zarr"), **opts))
    out = tmp_path / "killed.zarr"
    plan = plan_prediction(PredictOptions(out=str(out), **opts))
    for k in (0, 2):
        run_part(plan, k)
    cmd = [sys.executable, "-m", "sfm.cli", "predict", "--model", "sfm-faults:v1", "--survey", small["store"],
           "--out", str(out), "--data-root", small["root"], "--parts", "3", "--part", "1", "--mirror",
           "--batch-size", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    first_row = out / "probability" / "c" / "1"  # part 1 writes shard rows 1 and 2
    deadline = time.monotonic() + 300
    while not (first_row.exists() and any(first_row.rglob("*"))) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert not (out / ".predict" / "part-1.json").exists() and not (out / "zarr.json").exists()  # mid-way
    with pytest.raises(Exception, match="part 2 of 3 was not written"):
        from sfm.predict import publish_prediction

        publish_prediction(plan)
    rows_of_others = [p for r in ("0", "3", "4") for p in (out / "probability" / "c" / r).rglob("*")
                      if p.is_file()]
    written = {p: p.stat().st_mtime_ns for p in rows_of_others}
    rerun = predict(PredictOptions(out=str(out), **opts))
    assert rerun["ran"] == [1] and rerun["reused"] == [0, 2] and rerun["published"]
    assert shard_files(out) == shard_files(tmp_path / "whole.zarr")
    assert rerun["stats"] == whole_run["stats"]
    assert json.loads((out / "zarr.json").read_text())["attributes"]["stats"] == whole_run["stats"]
    assert written and {p: p.stat().st_mtime_ns for p in rows_of_others} == written  # parts 0 and 2 not rewritten


def test_piped_sfm_predict_prints_progress_lines(small, tmp_path):
    """Without a terminal (a cluster log), `sfm predict` reports each part's windows in plain lines: done of all,
    the voxels per second and the ETA, the last at 100 %; no bar's carriage returns."""
    cmd = [sys.executable, "-m", "sfm.cli", "predict", "--model", "sfm-faults:v1", "--survey", small["store"],
           "--out", str(tmp_path / "piped.zarr"), "--data-root", small["root"], "--parts", "2", "--batch-size", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\r" not in proc.stderr
    for part in (1, 2):
        lines = [line for line in proc.stderr.splitlines() if line.startswith(f"predict part {part}/2: window ")]
        assert len(lines) >= 2, proc.stderr  # one at the first windows, one at the end
        done = [re.match(r"predict part \d/2: window (\d+)/(\d+) \(", line).groups() for line in lines]
        assert int(done[0][0]) < int(done[-1][0]) == int(done[-1][1]) > 0, lines
        assert re.search(r", voxels/s [\d.]+[kMG]?, elapsed \d+s, ETA \d+s$", lines[0]), lines[0]
        assert lines[-1].split(", ")[0].endswith("(100.0%)")
    assert json.loads(proc.stdout)["published"]


def test_user_errors_are_one_line(small, tmp_path, capsys):
    base = ["predict", "--survey", small["store"], "--data-root", small["root"]]
    encoder = tmp_path / "encoder"
    save_mae(build_model(mae_config("tiny", crop=CROP)), str(encoder))
    published = tmp_path / "done.zarr"
    predict(PredictOptions(model="sfm-faults", survey=small["store"], out=str(published), data_root=small["root"],
                           overlap=0.0))
    cases_ = [
        (["--model", "sfm-salt:v1", "--out", str(tmp_path / "a.zarr")], "model 'sfm-salt' is not in the registry"),
        (["--model", "sfm-faults:v7", "--out", str(tmp_path / "a.zarr")], "no version v7"),
        (["--model", str(encoder), "--out", str(tmp_path / "a.zarr")], "is not a task model"),
        (["--model", "sfm-faults", "--out", str(published)], "already holds a published store"),
        (["--model", "sfm-faults", "--out", str(published), "--mirror"], "already holds a published store"),
        (["--model", str(small["tmp"] / "three"), "--out", str(tmp_path / "a.zarr"), "--segy", str(tmp_path / "a.sgy")],
         "--segy writes one value per sample"),
    ]
    for extra, message in cases_:
        assert cli.main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("sfm predict: error:") and message in err and "\n" not in err, err
    nothing = ["predict", "--model", "sfm-faults", "--survey", str(tmp_path / "none.sgy"), "--data-root", small["root"],
               "--out", str(tmp_path / "b.zarr")]  # a SEG-Y is ingested first (tests/integration/test_finetune_arms.py)
    assert cli.main(nothing) == 2
    assert "nothing there" in capsys.readouterr().err
    unknown = ["predict", "--model", "sfm-faults", "--survey", "0123456789abcdef", "--data-root", small["root"],
               "--out", str(tmp_path / "b.zarr")]
    assert cli.main(unknown) == 2
    assert "is not a survey published in" in capsys.readouterr().err
    # an unfinished store planned with other settings is refused, not mixed
    plan_prediction(PredictOptions(model="sfm-faults", survey=small["store"], out=str(tmp_path / "c.zarr"),
                                   data_root=small["root"], parts=2))
    assert cli.main([*base, "--model", "sfm-faults", "--out", str(tmp_path / "c.zarr"), "--parts", "3"]) == 2
    assert "unfinished prediction with other settings" in capsys.readouterr().err
    assert not [p for p in tmp_path.iterdir() if p.name[0] in "ab"]  # nothing written for the refused runs


def test_on_s3_survey_model_store_and_segy(small, s3_env, tmp_path):
    """A survey ingested into S3, the task model registered there, the store and the SEG-Y written there: the same
    values as the local prediction, nothing left beside the published store."""
    bucket = s3_env.make_bucket("predict")
    root = f"{bucket}/sfm"
    storage.upload(small["src"], f"{bucket}/landing/small.sgy")
    store = ingest_survey(f"{bucket}/landing/small.sgy", root, chunk=16)["store_url"]
    registry.register(root, "sfm-faults", str(small["tmp"] / "binary"), config={}, metrics={}, force_champion=True,
                      lineage={"run_pathspec": "test", "manifest_version": "m1", "code_version": "t", "surveys": []})
    opts = dict(model="sfm-faults:v1", data_root=root, parts=2, output="classes", overlap=0.25)
    remote = predict(PredictOptions(survey=store, out=f"{bucket}/out/faults.zarr", segy=f"{bucket}/out/faults.sgy",
                                    **opts))
    local = predict(PredictOptions(survey=small["store"], out=str(tmp_path / "faults.zarr"),
                                   segy=str(tmp_path / "faults.sgy"), **{**opts, "data_root": small["root"]}))
    assert remote["stats"] == local["stats"]
    storage.download(f"{bucket}/out/faults.sgy", tmp_path / "remote.sgy")
    assert (tmp_path / "remote.sgy").read_bytes() == (tmp_path / "faults.sgy").read_bytes()
    keys = s3_env.keys("predict", "out/")
    assert not [k for k in keys if ".predict/" in k or k.endswith(".partial")] and "out/faults.zarr/zarr.json" in keys
