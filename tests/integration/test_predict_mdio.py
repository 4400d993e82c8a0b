"""`sfm predict` and MDIO (issue 49): an MDIO store read in place (registered by `sfm ingest`) is predicted with its
own coordinates; the prediction in the mdio layout carries its headers, so its SEG-Y export has the source's
inline, crossline and coordinate headers, and MDIO's own exporter (`mdio.mdio_to_segy`) writes the prediction."""

from __future__ import annotations

import numpy as np
import segyio
import torch
import xarray as xr
import zarr
from support.mdio_env import mdio_to_segy

from sfm.ingest.survey import ingest_survey
from sfm.model import build_model, mae_config
from sfm.model.segmenter import Segmenter, Task, save_segmenter
from sfm.predict import PredictOptions, predict

KEYS = (segyio.su.iline, segyio.su.xline, segyio.su.cdpx, segyio.su.cdpy, segyio.su.scalco)


def traces(path):
    """{(inline, crossline): (the header fields KEYS, the samples)} of a SEG-Y file."""
    with segyio.open(path, ignore_geometry=True) as f:
        return {(h[segyio.su.iline], h[segyio.su.xline]): ([h[k] for k in KEYS], f.trace[t])
                for t, h in enumerate(f.header)}


def test_an_mdio_store_is_predicted_in_place_and_exported_with_its_headers(mdio_stores, tmp_path):
    mdio_path, source = mdio_stores["holes"]  # depth, 16 x 16 x 32 chunks, 30 traces missing
    store = ingest_survey(str(mdio_path), str(tmp_path / "data"))["store_url"]
    torch.manual_seed(0)
    save_segmenter(Segmenter(build_model(mae_config("tiny", crop=(16, 16, 16))), Task()), str(tmp_path / "model"))
    out, sgy = tmp_path / "faults.zarr", tmp_path / "faults.sgy"
    predict(PredictOptions(model=str(tmp_path / "model"), survey=store, out=str(out), layout="mdio", segy=str(sgy),
                           output="classes", overlap=0.25, parts=2))

    ds, mdio = xr.open_zarr(out), xr.open_zarr(mdio_path, consolidated=False)
    assert ds.classes.dims == ("inline", "crossline", "depth")
    for name in ("inline", "crossline", "depth", "cdp_x", "cdp_y", "trace_mask"):
        np.testing.assert_array_equal(ds[name].values, mdio[name].values)
    values = ds.classes.values
    assert (values[~ds.trace_mask.values] == 0).all()
    group = zarr.open_group(str(out), mode="r")
    assert group.attrs["attributes"]["defaultVariableName"] == "classes" and "statsV1" in group["classes"].attrs

    expected = traces(source)
    il, xl = ds.inline.values, ds.crossline.values
    for path in (sgy, mdio_to_segy(out, tmp_path / "by-mdio.sgy", "store")):  # ours, then MDIO's own export
        written = traces(path)
        assert written.keys() == expected.keys(), path
        for cell, (fields, samples) in written.items():
            assert fields == expected[cell][0], (path, cell)
            i, j = int(np.searchsorted(il, cell[0])), int(np.searchsorted(xl, cell[1]))
            np.testing.assert_array_equal(samples, values[i, j])
