"""Random 3D crops from survey stores, deterministic by sample index.

Sample ``i`` of a stream is a pure function of ``(seed, i)``: its survey (weighted by live volume),
its origin, and the crop itself. A rank's batches are ranges of sample indices interleaved with the
other ranks', so ranks never share a sample, a resumed run sees exactly the batches an uninterrupted
run would have seen (the position is just the step number), and no state needs saving but the step.

Values are normalised per survey from the stored statistics: clipped to the 0.1/99.9 percentiles,
then standardised with the stored mean and std; dead traces (``trace_mask`` False) are 0.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from sfm import storage
from sfm.errors import SFMError

_MAX_DRAWS = 64  # origins tried per sample before giving up on the live-fraction threshold


@dataclass
class _Survey:
    store_url: str
    amplitude: object  # zarr.Array [IL, XL, NS]
    live_cells: np.ndarray  # [IL+1, XL+1] int64 summed-area table of trace_mask
    trace_mask: np.ndarray  # [IL, XL] bool
    shape: tuple[int, int, int]
    clip: tuple[float, float]
    mean: float
    std: float


def open_store(store_url: str) -> _Survey:
    import zarr

    try:
        group = zarr.open_group(storage.zarr_store(store_url, read_only=True), mode="r")
    except FileNotFoundError as err:
        raise SFMError(f"survey store {store_url} does not exist; ingest the survey first") from err
    attrs = dict(group.attrs)
    stats = attrs["stats"]
    mask = np.asarray(group["trace_mask"][...], dtype=bool)
    table = np.zeros((mask.shape[0] + 1, mask.shape[1] + 1), dtype=np.int64)
    table[1:, 1:] = mask.cumsum(0).cumsum(1)
    pct = stats["percentiles"]
    amp = group["amplitude"]
    return _Survey(store_url, amp, table, mask, tuple(amp.shape), (pct["0.1"], pct["99.9"]),
                   float(stats["mean"]), float(stats["std"]) or 1.0)


class CropSampler:
    """Random crops [1, D, H, W] float32 from a set of survey stores.

    Args:
        store_urls: survey stores (local paths or s3:// URLs).
        crop: (D, H, W) voxels along (inline, crossline, sample).
        seed: stream seed; the same seed gives the same crops.
        min_live_fraction: crops whose fraction of live traces is below this are never returned.
    """

    def __init__(self, store_urls: list[str], crop: tuple[int, int, int], seed: int = 0,
                 min_live_fraction: float = 0.5, read_threads: int = 8):
        if not store_urls:
            raise SFMError("no survey stores to read; ingest at least one survey")
        self.crop = tuple(int(c) for c in crop)
        self.seed = int(seed)
        self.min_live_fraction = float(min_live_fraction)
        surveys = [open_store(url) for url in store_urls]
        self.surveys = [s for s in surveys if all(n >= c for n, c in zip(s.shape, self.crop))]
        if not self.surveys:
            shapes = ", ".join(f"{s.store_url}: {s.shape}" for s in surveys)
            raise SFMError(f"every survey is smaller than the crop {self.crop} ({shapes}); set data.crop smaller")
        live = np.array([s.trace_mask.sum() * s.shape[2] for s in self.surveys], dtype=np.float64)
        if live.sum() == 0:
            raise SFMError("the surveys have no live traces; check trace_mask of the stores")
        self.weights = live / live.sum()
        self._pool = ThreadPoolExecutor(max_workers=read_threads, thread_name_prefix="sfm-read")

    def locate(self, index: int) -> tuple[int, tuple[int, int, int]]:
        """The (survey number, crop origin) of sample ``index``: a pure function of (seed, index)."""
        rng = np.random.default_rng([self.seed, int(index)])
        d, h, w = self.crop
        for _ in range(_MAX_DRAWS):
            k = int(rng.choice(len(self.surveys), p=self.weights))
            s = self.surveys[k]
            i0 = int(rng.integers(0, s.shape[0] - d + 1))
            j0 = int(rng.integers(0, s.shape[1] - h + 1))
            t0 = int(rng.integers(0, s.shape[2] - w + 1))
            t = s.live_cells
            live = t[i0 + d, j0 + h] - t[i0, j0 + h] - t[i0 + d, j0] + t[i0, j0]
            if live >= self.min_live_fraction * d * h:
                return k, (i0, j0, t0)
        raise SFMError(
            f"no crop of {self.crop} with at least {self.min_live_fraction:.0%} live traces found in {_MAX_DRAWS} "
            "draws; lower data.min_live_fraction or use a smaller crop"
        )

    def read(self, index: int) -> np.ndarray:
        """Sample ``index`` as float32 [1, D, H, W], normalised."""
        k, (i0, j0, t0) = self.locate(index)
        s = self.surveys[k]
        d, h, w = self.crop
        try:
            raw = np.asarray(s.amplitude[i0 : i0 + d, j0 : j0 + h, t0 : t0 + w], dtype=np.float32)
        except Exception as err:
            raise SFMError(f"reading {s.store_url} region [{i0}:{i0 + d}, {j0}:{j0 + h}, {t0}:{t0 + w}] failed: "
                           f"{type(err).__name__}: {err}; check the store is reachable") from err
        x = (np.clip(raw, *s.clip) - s.mean) / s.std
        x *= s.trace_mask[i0 : i0 + d, j0 : j0 + h, None]
        return x[None].astype(np.float32, copy=False)

    def read_many(self, indices: list[int]) -> np.ndarray:
        """Samples [len(indices), 1, D, H, W], read concurrently."""
        return np.stack(list(self._pool.map(self.read, indices)))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class BatchStream:
    """The batches one rank trains on, prefetched in a background thread.

    Batch ``step`` of rank ``r`` holds samples ``(step * world_size + r) * batch_size + [0, batch_size)``,
    so the ranks' streams are disjoint and every batch is a function of its step alone.
    ``state_dict()`` is the next step; ``load_state_dict`` continues from there.
    """

    def __init__(self, sampler: CropSampler, batch_size: int, rank: int = 0, world_size: int = 1,
                 start_step: int = 0, prefetch: int = 2):
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.prefetch = int(prefetch)
        self.step = int(start_step)
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def indices(self, step: int) -> list[int]:
        first = (step * self.world_size + self.rank) * self.batch_size
        return list(range(first, first + self.batch_size))

    def batch(self, step: int) -> np.ndarray:
        """Batch ``step`` as float32 [B, 1, D, H, W] (no prefetch)."""
        return self.sampler.read_many(self.indices(step))

    def _produce(self, start: int) -> None:
        step = start
        while not self._stop.is_set():
            try:
                item = (step, self.batch(step), None)
            except Exception as err:  # handed to the consumer, raised there
                item = (step, None, err)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            step += 1

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        if self._thread is None:
            self._queue = queue.Queue(maxsize=max(1, self.prefetch))
            self._thread = threading.Thread(target=self._produce, args=(self.step,), daemon=True,
                                            name="sfm-prefetch")
            self._thread.start()
        step, data, err = self._queue.get()
        if err is not None:
            raise err
        assert step == self.step, (step, self.step)
        self.step += 1
        return data

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.sampler.seed, "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("load_state_dict before iterating")
        self.step = int(state["step"])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sampler.close()

