"""Survey stores for the loader tests: a synthetic SEG-Y with traces removed, ingested by sfm.ingest.survey.

The holes are real: the traces are missing from the SEG-Y file itself, so ``trace_mask`` and the
statistics are what ingest derives from such a file.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import zarr

from sfm import data
from sfm.config import DataConfig
from sfm.distributed.launch import environment_for_workers
from sfm.ingest import survey as ingest
from sfm.synth import survey as synth

TRACE_HEADER = 240
FILE_HEADER = 3600


def dead_traces(shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """[IL, XL] bool: True where a trace is missing. An interior block (a third of the inlines, a
    quarter of the crosslines, so windows have live fractions from under a half to 1) plus 1 %
    scattered traces; the outer ring stays live so the grid keeps its extent."""
    il, xl = shape
    dead = np.zeros(shape, dtype=bool)
    dead[il // 3 : il // 3 + il // 3, xl // 4 : xl // 4 + xl // 4] = True
    dead |= np.random.default_rng(seed).random(shape) < 0.01
    dead[[0, -1], :] = False
    dead[:, [0, -1]] = False
    return dead


def segy_with_holes(path: Path, shape: tuple[int, int, int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Write a synthetic survey to ``path`` with :func:`dead_traces` removed from the file.

    Returns (amplitude [IL, XL, NS] float32 as written, live [IL, XL] bool).
    """
    amplitude, _ = synth.synthesize_volume(shape, seed)
    full = path.with_suffix(".full.sgy")
    synth.write_segy(full, amplitude)  # format 5, inline-sorted: trace n is (n // XL, n % XL)
    data = full.read_bytes()
    full.unlink()
    trace_bytes = TRACE_HEADER + 4 * shape[2]
    assert len(data) == FILE_HEADER + shape[0] * shape[1] * trace_bytes
    live = ~dead_traces(shape[:2], seed)
    traces = np.frombuffer(data, dtype=np.uint8, offset=FILE_HEADER).reshape(-1, trace_bytes)
    path.write_bytes(data[:FILE_HEADER] + traces[live.ravel()].tobytes())
    return amplitude, live


def survey_with_holes(tmp: Path, data_root: str, shape=(48, 40, 64), seed: int = 0, chunk: int = 16,
                      **ingest_options) -> tuple[str, np.ndarray, np.ndarray]:
    """Ingest :func:`segy_with_holes` into ``data_root``; returns (store URL, amplitude, live mask)."""
    sgy = Path(tmp) / f"holes-{seed}-{'x'.join(map(str, shape))}.sgy"
    amplitude, live = segy_with_holes(sgy, shape, seed)
    row = ingest.ingest_survey(str(sgy), data_root, chunk=chunk, **ingest_options)
    return row["store_url"], amplitude, live


@pytest.fixture(scope="module")
def surveys(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("crops")
    root = str(tmp / "root")
    a_url, a_amp, a_live = survey_with_holes(tmp, root, shape=(48, 40, 64), seed=0)
    b_url, b_amp, b_live = survey_with_holes(tmp, root, shape=(40, 40, 48), seed=1)
    return SimpleNamespace(tmp=tmp, urls=[a_url, b_url], amp=[a_amp, b_amp], live=[a_live, b_live])


def data_config(crop=(16, 16, 16), *, augment=(), **settings) -> DataConfig:
    """A checked ``[data]`` section: ``crop``, the augmentations named in ``augment`` (none unless given) and
    any other settings (the section's defaults otherwise)."""
    cfg = DataConfig(crop=tuple(crop), augment=",".join(augment), **settings)
    cfg.check()
    return cfg


def crops_of(urls, crop=(16, 16, 16), *, rank=0, world=1, slab=None, epoch=0, brick_reader=True,
          **settings) -> data.CropDataset:
    """The crops of ``urls`` by sample index (``.locate``, ``.read``), from :func:`data_config` settings."""
    dataset = data.crop_dataset(urls, data_config(crop, **settings), rank, world, slab=slab, brick_reader=brick_reader)
    dataset.set_epoch(epoch)
    return dataset


def stream(urls, *, batch=4, rank=0, world=1, workers=0, start=0, num_batches=None, crop=(16, 16, 16),
           slab=None, epoch=0, **settings) -> data.BatchStream:
    """A BatchStream over ``urls`` (16^3 crops unless ``crop=`` says otherwise) from :func:`data_config`
    settings, with each worker given this process's environment."""
    dataset = crops_of(urls, crop, rank=rank, world=world, slab=slab, epoch=epoch, batch_size=batch, **settings)
    dataset.start_batch, dataset.num_batches = start, num_batches
    return data.BatchStream(dataset, workers=workers, worker_init=environment_for_workers())


def expected_crop(surveys, crops: data.CropDataset, index: int) -> np.ndarray:
    """Sample ``index`` computed from the generator's own amplitude, the stored statistics and the
    crop's location, independently of the loader's read path."""
    c = crops.locate(index)
    url = surveys.urls[surveys.urls.index(crops.surveys[c.survey].store_url)]
    stats = dict(zarr.open_group(url, mode="r").attrs)["stats"]
    lo, hi = stats["percentiles"]["0.1"], stats["percentiles"]["99.9"]
    k = surveys.urls.index(url)
    region = tuple(slice(o, o + e) for o, e in zip(c.origin, c.extent))
    x = (np.clip(surveys.amp[k][region].astype(np.float64), lo, hi) - stats["mean"]) / stats["std"]
    x *= surveys.live[k][region[:2]][:, :, None]
    return as_delivered(x, c)


def as_delivered(x: np.ndarray, c) -> np.ndarray:
    """The source box ``x`` [D, H, W] of crop ``c`` flipped, swapped, time-reversed and negated as the
    loader delivers it."""
    if c.reverse_time:
        x = x[:, :, ::-1]
    if c.invert:
        x = -x
    if c.flip_inline:
        x = x[::-1]
    if c.flip_crossline:
        x = x[:, ::-1]
    if c.swap:
        x = x.transpose(1, 0, 2)
    return x
