"""int8 survey stores: amplitudes quantised in 254 steps across the 0.1-99.9 percentiles, saturating
beyond, holes stored as the integer that decodes to exactly 0; the loader's crops match the float32
store's within half a step.

The stores are real ingests of small synthetic SEG-Y files (under TRANSFORM_TRACES traces, so the
quantisation and the statistics see the same traces) with traces missing from the file.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zarr

from support import ingest_cases as cases
from support.crop_stores import as_delivered, crops_of, segy_with_holes, stream
from sfm import data
from sfm.config import INGEST_DTYPES, IngestConfig
from sfm.errors import SFMError
from sfm.formats.contracts import read_store_attrs
from sfm.ingest.survey import ingest_survey

CROP = (16, 16, 16)
F32_EPS = float(np.finfo(np.float32).eps)


def ingest(path, root, dtype: str) -> SimpleNamespace:
    """Ingest ``path`` as ``dtype``; the store's arrays, attributes and decoded amplitude (float64)."""
    url = ingest_survey(str(path), str(root), dtype=dtype, chunk=8)["store_url"]
    group = zarr.open_group(url, mode="r")
    attrs = read_store_attrs(url)
    stored = group["amplitude"][...]
    t = attrs.get("amplitude_transform", {"scale": 1.0, "offset": 0.0})
    return SimpleNamespace(url=url, group=group, attrs=attrs, t=t, stored=stored,
                           decoded=stored.astype(np.float64) * t["scale"] + t["offset"],
                           mask=np.asarray(group["trace_mask"][...]))


@pytest.fixture(scope="module")
def survey(tmp_path_factory):
    """A survey not centred on 0, with spikes far beyond the percentiles and a missing trace, ingested as int8."""
    tmp = tmp_path_factory.mktemp("int8")
    amplitude = cases.volume((12, 10, 40), seed=5) * 300.0 + 40.0
    amplitude[2, 3, 10], amplitude[5, 6, 20] = 3e4, -3e4
    path = cases.write(tmp / "int8.sgy", amplitude)
    live = np.ones((12, 10), dtype=bool)
    live[[4, 7], [4, 1]] = False
    cases.drop_traces(path, 40, live.ravel())
    return SimpleNamespace(amplitude=amplitude, live=live, store=ingest(path, tmp / "root", "int8"))


def within_clip(s) -> np.ndarray:
    """[IL, XL, NS] bool: live voxels between the 0.1 and 99.9 percentiles of the statistics."""
    pct = s.store.attrs["stats"]["percentiles"]
    return s.live[..., None] & (s.amplitude >= pct["0.1"]) & (s.amplitude <= pct["99.9"])


def test_int8_round_trip_is_within_half_a_step_inside_the_clip_range(survey):
    st = survey.store
    assert st.stored.dtype == np.int8 and st.attrs["dtype"] == "int8" and np.abs(st.stored).max() <= 127
    assert st.t["kind"] == "quantise" and st.t["stored_dtype"] == "int8" and st.t["stored_range"] == [-127, 127]
    pct = st.attrs["stats"]["percentiles"]
    assert st.t["scale"] == pytest.approx((pct["99.9"] - pct["0.1"]) / 254)
    inside = within_clip(survey)
    assert inside.sum() >= 0.99 * survey.live.sum() * survey.amplitude.shape[2]
    error = np.abs(st.decoded - survey.amplitude)[inside]
    assert error.max() <= st.t["scale"] / 2 * (1 + 1e-4)  # float32 arithmetic may round a hair past the half step
    # the statistics stay in amplitude units, from the samples as read
    assert st.attrs["stats"]["mean"] == pytest.approx(survey.amplitude[survey.live].astype(np.float64).mean(), rel=1e-5)


def test_int8_saturates_beyond_the_clip_range(survey):
    st = survey.store
    lo, hi = st.t["clip"]
    assert [lo, hi] == pytest.approx([st.t["offset"] - 127 * st.t["scale"], st.t["offset"] + 127 * st.t["scale"]])
    live = survey.live[..., None] & np.ones(survey.amplitude.shape, dtype=bool)
    above, below = live & (survey.amplitude > hi), live & (survey.amplitude < lo)
    assert above[2, 3, 10] and below[5, 6, 20]  # the spikes
    assert (st.stored[above] == 127).all() and (st.stored[below] == -127).all()
    np.testing.assert_allclose(st.decoded[above], hi)
    np.testing.assert_allclose(st.decoded[below], lo)


def test_int8_holes_decode_to_exactly_zero(survey):
    st = survey.store
    assert (st.mask == survey.live).all()
    assert st.stored[~survey.live].tolist() == [[st.t["hole_value"]] * 40] * 2
    assert st.t["hole_value"] != 0  # the survey is off centre: the offset, not the integer 0, makes holes 0
    assert (st.decoded[~survey.live] == 0.0).all()
    assert int(st.group["amplitude"].fill_value) == st.t["hole_value"]  # bricks never written read as holes


def test_int8_range_takes_in_zero_when_the_amplitudes_do_not(tmp_path):
    """All amplitudes positive: the range is widened down to 0, so holes still have an integer."""
    amplitude = cases.volume((8, 6, 24), seed=2) + 10.0
    path = cases.write(tmp_path / "positive.sgy", amplitude)
    live = np.ones((8, 6), dtype=bool)
    live[3, 3] = False
    cases.drop_traces(path, 24, live.ravel())
    st = ingest(path, tmp_path / "root", "int8")
    assert st.t["clip"][0] <= 0.0 < amplitude.min()
    assert (st.decoded[~live] == 0.0).all() and -127 <= st.t["hole_value"] <= 127
    hi = st.attrs["stats"]["percentiles"]["99.9"]
    inside = live[..., None] & (amplitude <= hi)
    assert np.abs(st.decoded - amplitude)[inside].max() <= st.t["scale"] / 2 * (1 + 1e-4)


def test_int8_store_gives_the_float32_crops(tmp_path):
    """The loader's crops (clipped to the percentiles, standardised) differ by at most half a step:
    scale / 2 in amplitude, scale / (2 std) once standardised, plus float32 rounding."""
    sgy = tmp_path / "holes.sgy"
    segy_with_holes(sgy, (32, 30, 48), seed=0)  # 960 cells: the quantisation and the statistics see every trace
    stores = {dtype: ingest_survey(str(sgy), str(tmp_path / dtype), chunk=16, dtype=dtype)["store_url"]
              for dtype in ("float32", "int8")}
    samplers = {dtype: crops_of([url], CROP, seed=13, augment=data.AUGMENTATIONS, brick_reader=False)
                for dtype, url in stores.items()}
    crops = {dtype: s.read(list(range(8))) for dtype, s in samplers.items()}
    attrs = read_store_attrs(stores["int8"])
    stats, scale = attrs["stats"], attrs["amplitude_transform"]["scale"]
    largest = max(abs(stats["percentiles"][p] - stats["mean"]) for p in ("0.1", "99.9")) / stats["std"]
    tolerance = 0.5 * scale / stats["std"] + 8 * F32_EPS * largest
    difference = np.abs(crops["int8"] - crops["float32"])
    assert difference.max() <= tolerance
    assert difference.max() > 0.25 * tolerance  # and the crops did come through the quantisation
    for s in samplers.values():
        s.close()


def test_int8_contract_holds_the_transform_to_account(survey):
    attrs = dict(survey.store.group.attrs)
    read_store_attrs(attrs)
    for key, value in (("hole_value", 300), ("kind", "standardise"), ("stored_dtype", "float16"), ("clip", None)):
        broken = {**attrs, "amplitude_transform": {**attrs["amplitude_transform"], key: value}}
        if value is None:
            del broken["amplitude_transform"][key]
        with pytest.raises(SFMError, match="breaks the survey_store contract"):
            read_store_attrs(broken)
    with pytest.raises(SFMError, match="amplitude_transform"):
        read_store_attrs({k: v for k, v in attrs.items() if k != "amplitude_transform"})


def test_a_bad_dtype_is_one_line_naming_the_choices():
    assert "int8" in INGEST_DTYPES
    with pytest.raises(SFMError) as err:
        IngestConfig(dtype="int4").check()
    message = str(err.value)
    assert "\n" not in message and "'int4'" in message
    assert all(dtype in message for dtype in INGEST_DTYPES)
    from sfm.cli import build_parser

    args = build_parser().parse_args(["ingest", "a.sgy", "--data-root", "root", "--dtype", "int8"])
    assert args.dtype == "int8"


def test_the_brick_reader_and_the_region_pool_read_int8_stores_as_zarr_does(survey, tmp_path):
    from sfm.data.bricks import BrickReader

    group = survey.store.group
    reader = BrickReader.for_array(group["amplitude"])
    assert reader is not None and reader.dtype == np.int8  # int8 bricks decoded by the brick reader
    crop = (8, 8, 8)
    direct = crops_of([survey.store.url], crop, seed=3, brick_reader=False)
    pooled = crops_of([survey.store.url], crop, seed=3, batch_size=4, crops_per_region=4,
                      pool_dir=str(tmp_path / "pool"))
    try:
        for i in range(8):
            c = pooled.locate(i)
            box = tuple(slice(o, o + e) for o, e in zip(c.origin, c.extent))
            expected = np.empty(crop, np.float32)
            direct.surveys[0].normalise_into(group["amplitude"][box], expected)
            expected *= survey.live[box[:2]][:, :, None]
            np.testing.assert_allclose(pooled.read([i])[0, 0], as_delivered(expected, c), rtol=1e-6, atol=1e-6)
    finally:
        direct.close(), pooled.close()


@pytest.fixture(scope="module")
def two_int8_surveys(tmp_path_factory):
    """Two int8 stores with holes and different statistics, and float32 stores of the same files."""
    tmp = tmp_path_factory.mktemp("int8-batches")
    urls = {"int8": [], "float32": []}
    for seed, shape in ((0, (32, 30, 48)), (1, (30, 32, 40))):
        sgy = tmp / f"holes-{seed}.sgy"
        segy_with_holes(sgy, shape, seed=seed)
        for dtype in urls:
            urls[dtype].append(ingest_survey(str(sgy), str(tmp / dtype), chunk=16, dtype=dtype)["store_url"])
    return SimpleNamespace(tmp=tmp, urls=urls)


@pytest.mark.parametrize("k, workers", [(1, 0), (4, 0), (4, 1)])
def test_int8_batches_normalise_on_the_device_to_the_float32_batches_of_the_same_store(two_int8_surveys, k, workers):
    """``batch_dtype = "int8"``: the stored values and each sample's clip and multiply-add travel; ``.float()``
    gives what the float32 batch of the same int8 stores holds (the same float32 operations), dead traces 0."""
    from sfm.data.int8_batch import DEAD, Int8Batch

    s = two_int8_surveys
    streams = {dtype: stream(s.urls["int8"], batch=4, num_batches=6, workers=workers, crop=CROP, seed=7,
                             augment=data.AUGMENTATIONS, batch_dtype=dtype, crops_per_region=k,
                             pool_dir=str(s.tmp / f"pool-{dtype}"))
               for dtype in ("int8", "float32")}
    try:
        seen_dead = 0
        for got, want in zip(streams["int8"], streams["float32"], strict=True):
            assert isinstance(got, Int8Batch) and got.values.dtype == torch.int8 and got.affine.shape == (4, 4)
            x = got.to("cpu").float()
            assert x.dtype == torch.float32 and x.shape == want.shape
            torch.testing.assert_close(x, want, rtol=0, atol=2 * F32_EPS * float(want.abs().max()))
            dead = got.values == DEAD
            seen_dead += int(dead.sum())
            assert (x[dead] == 0).all()
        assert seen_dead > 0  # the surveys' holes came through as the dead marker
    finally:
        for st in streams.values():
            st.close()


def test_int8_batches_need_int8_stores(two_int8_surveys):
    with pytest.raises(SFMError, match="holds float32; ingest with --dtype int8"):
        crops_of(two_int8_surveys.urls["float32"][:1], CROP, batch_dtype="int8")


def test_an_int8_batch_pins_and_moves_as_one(two_int8_surveys):
    from sfm.data.int8_batch import Int8Batch

    values = torch.tensor([[-128, -127, 0, 5, 127]], dtype=torch.int8).view(1, 1, 1, 1, 5)
    batch = Int8Batch(values, torch.tensor([[-100.0, 100.0, 0.5, 1.0]]))
    assert batch.shape == values.shape
    assert batch.to("cpu").float().flatten().tolist() == [0.0, -49.0, 1.0, 3.5, 51.0]  # clipped to +-100 first
