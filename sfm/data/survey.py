"""The surveys a process reads: what the data path knows of one survey, :class:`SurveyInfo` (shape, bricks,
live traces, the normalisation from the stored statistics), the origins a crop may start at
(:class:`CropOrigins`), and :class:`Surveys`, the surveys of a job with their stores opened in each
process that reads them."""


from __future__ import annotations

import collections
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from sfm.errors import SFMError

from sfm.data.bricks import BrickReader
from sfm.storage.resilient_store import ResilientStore, open_survey_store

log = logging.getLogger(__name__)
_local = threading.local()


def _scratch(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array [*shape] of this thread's, reused."""
    n = int(np.prod(shape))
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < n:
        buf = _local.buf = np.empty(n, dtype=np.float32)
    return buf[:n].reshape(shape)


@dataclass
class SurveyInfo:
    """What the data path needs to know about one survey; small enough to send to worker processes."""

    store_url: str
    name: str
    shape: tuple[int, int, int]  # (IL, XL, NS)
    bricks: tuple[int, int, int]  # the read unit: chunk shape (the inner chunk when sharded)
    trace_mask: np.ndarray  # [IL, XL] bool
    live_cells: np.ndarray  # [IL+1, XL+1] summed-area table of trace_mask
    clip: tuple[float, float]  # stored 0.1 / 99.9 percentiles (amplitude units)
    mean: float
    std: float
    scale: float = 1.0  # amplitude = stored * scale + offset (float16 and int8 stores; identity for float32)
    offset: float = 0.0

    version: str = ""  # what tells two ingests at one URL apart (source digest and store layout)
    stored_dtype: str = "float32"  # the store's value type (float32, float16 or int8)
    source_kind: str = "segy"  # segy: the store's own amplitude; mdio: an MDIO store's, read in place

    @property
    def identity(self) -> str:
        """Everything a normalised region of this survey depends on (names pooled regions)."""
        return (f"{self.store_url}|{self.version}|{self.shape}|{self.bricks}|{self.clip}|{self.mean!r}|"
                f"{self.std!r}|{self.scale!r}|{self.offset!r}")

    def normalise_into(self, stored: np.ndarray, dst: np.ndarray) -> None:
        """``dst = (clip(amplitude, p0.1, p99.9) - mean) / std`` from stored values, in three passes:
        the clip is done in stored units (the decode is increasing), decode and standardise fold into
        one multiply-add. (Cutting the passes into cache-sized blocks, or two passes through torch,
        saved under 0.05 s of CPU per GB: a brick just decoded is still in the L3 cache.) A float16
        ``dst`` is computed in float32 first: stored amplitudes may exceed float16's range."""
        lo, hi = ((c - self.offset) / self.scale for c in self.clip)
        if min(dst.strides) >= 0 and (dst.dtype != np.float32 or not dst.flags.c_contiguous):
            # a region of the pool, or a float16 batch: torch's casts and strided writes cost a
            # quarter of numpy's
            import torch

            x = torch.from_numpy(_scratch(stored.shape))
            x.copy_(torch.from_numpy(stored)).clamp_(lo, hi)
            x.mul_(self.scale / self.std).add_((self.offset - self.mean) / self.std)
            torch.from_numpy(dst).copy_(x)
            return
        if dst.dtype != np.float32:  # flipped float16 destination (torch takes no negative strides)
            scratch = _scratch(stored.shape)
            self.normalise_into(stored, scratch)
            np.copyto(dst, scratch, casting="same_kind")
            return
        np.clip(stored, lo, hi, out=dst, casting="unsafe")
        dst *= np.float32(self.scale / self.std)
        dst += np.float32((self.offset - self.mean) / self.std)

    @staticmethod
    def copy_stored_into(stored: np.ndarray, dst: np.ndarray) -> None:
        """``dst = stored``, unnormalised (int8 batches: the device normalises)."""
        np.copyto(dst, stored)

    def affine(self, negate: bool = False) -> tuple[float, float, float, float]:
        """``(lo, hi, a, b)``: :meth:`normalise_into` as ``clamp(stored, lo, hi) * a + b``, in float32
        (what an :class:`sfm.data.int8_batch.Int8Batch` carries per sample); ``negate``: ``a`` and ``b``
        negated, so the sample arrives with its polarity inverted (exactly the negated float32 values)."""
        lo, hi = ((c - self.offset) / self.scale for c in self.clip)
        a, b = float(np.float32(self.scale / self.std)), float(np.float32((self.offset - self.mean) / self.std))
        return (float(np.float32(lo)), float(np.float32(hi)), -a if negate else a, -b if negate else b)

    def live_traces(self, i0: int, j0: int, d: int, h: int) -> int:
        t = self.live_cells
        return int(t[i0 + d, j0 + h] - t[i0, j0 + h] - t[i0 + d, j0] + t[i0, j0])

    def crop_origins(self, d: int, h: int, min_live_fraction: float, step: tuple[int, int]) -> "CropOrigins":
        """Every (inline, crossline) origin on the ``step`` grid whose d x h window of traces is at
        least ``min_live_fraction`` live, from the summed-area table in one vectorised pass."""
        t = self.live_cells
        a, b = step
        n_i, n_j = (self.shape[0] - d) // a + 1, (self.shape[1] - h) // b + 1
        i, j = np.arange(n_i)[:, None] * a, np.arange(n_j)[None, :] * b
        live = t[i + d, j + h] - t[i, j + h] - t[i + d, j] + t[i, j]
        return CropOrigins(live >= min_live_fraction * d * h - 1e-9, step)


class CropOrigins:
    """The allowed origins of one survey as a bool grid; ``pick(r)`` is the r-th allowed one, so an
    origin is drawn uniformly among them with one integer draw (no rejection loop that can run out)."""

    def __init__(self, allowed: np.ndarray, step: tuple[int, int]):
        self.allowed = allowed  # [n_i, n_j] bool
        self.step = step
        self.before_row = np.concatenate([[0], np.cumsum(allowed.sum(axis=1))])  # allowed origins in rows < i
        self.count = int(self.before_row[-1])

    def pick(self, r: int) -> tuple[int, int]:
        i = int(np.searchsorted(self.before_row, r, side="right")) - 1
        j = int(np.flatnonzero(self.allowed[i])[r - self.before_row[i]])
        return i * self.step[0], j * self.step[1]


def open_amplitude(attrs: dict, group, client: str = "auto", retry_seconds: float = 120.0):
    """The amplitude zarr array of a survey store's ``group`` (root attributes ``attrs``): its own
    ``amplitude``, or for an MDIO reference (``source_kind`` "mdio") the variable of ``amplitude_url``,
    opened through :func:`open_survey_store` (read where it is)."""
    import zarr

    if attrs.get("source_kind") != "mdio":
        return group["amplitude"]
    url = attrs["amplitude_url"]
    try:
        return zarr.open_group(open_survey_store(url, client, retry_seconds), mode="r")[attrs["variable"]]
    except (FileNotFoundError, KeyError) as err:
        raise SFMError(f"MDIO store {url} (registered as survey {attrs.get('survey_id')}) is gone or has no "
                       f"{attrs.get('variable')!r}; restore it, or register the store it moved to with `sfm ingest`"
                       ) from err


def read_survey_info(store_url: str, store=None, client: str = "auto", retry_seconds: float = 120.0
                     ) -> tuple[SurveyInfo, Any]:
    """The survey's :class:`SurveyInfo` and its opened amplitude zarr array (of the MDIO store an MDIO
    reference names: :func:`open_amplitude`)."""
    import zarr

    store = store if store is not None else open_survey_store(store_url, client, retry_seconds)
    try:
        group = zarr.open_group(store, mode="r")
        attrs = dict(group.attrs)
        mask = np.asarray(group["trace_mask"][...], dtype=bool)
        amp = open_amplitude(attrs, group, client, retry_seconds)
    except SFMError:
        raise
    except (FileNotFoundError, KeyError) as err:
        raise SFMError(f"survey store {store_url} does not exist or is incomplete ({type(err).__name__}: {err}); "
                       "ingest the survey first") from err
    except Exception as err:
        raise SFMError(f"cannot open survey store {store_url}: {type(err).__name__}: {err}; check the URL, the "
                       "S3 endpoint and credentials") from err
    from sfm.formats.contracts import read_store_attrs

    read_store_attrs(attrs, f"survey store {store_url}")  # the survey_store contract, checked on read
    stats = attrs.get("stats")
    if not stats or "percentiles" not in stats:
        raise SFMError(f"survey store {store_url} has no statistics in its attributes; re-ingest the survey")
    if tuple(amp.shape[:2]) != mask.shape:
        raise SFMError(f"survey store {store_url}: its amplitude {list(amp.shape)} does not match its trace_mask "
                       f"{list(mask.shape)} (the MDIO store changed since it was registered?); register it again")
    table = np.zeros((mask.shape[0] + 1, mask.shape[1] + 1), dtype=np.int32 if mask.size < 2**31 else np.int64)
    table[1:, 1:] = mask.cumsum(0, dtype=table.dtype).cumsum(1, dtype=table.dtype)
    pct = stats["percentiles"]
    transform = attrs.get("amplitude_transform") or {}
    amp_attrs = dict(amp.attrs)
    scale = float(transform.get("scale", amp_attrs.get("scale_factor", 1.0)))
    offset = float(transform.get("offset", amp_attrs.get("add_offset", 0.0)))
    info = SurveyInfo(
        store_url=store_url,
        name=str(attrs.get("survey_name") or attrs.get("name") or attrs.get("survey_id") or store_url),
        shape=tuple(int(n) for n in amp.shape), bricks=tuple(int(n) for n in amp.chunks), trace_mask=mask,
        live_cells=table, clip=(float(pct["0.1"]), float(pct["99.9"])), mean=float(stats["mean"]),
        std=float(stats["std"]) or 1.0, scale=scale, offset=offset,
        version=f"{attrs.get('checksum', '')}|{attrs.get('store', {})}", stored_dtype=str(np.dtype(amp.dtype)),
        source_kind=str(attrs.get("source_kind", "segy")),
    )
    return info, amp


class Surveys:
    """The surveys a process reads, as a sequence of :class:`SurveyInfo` (``surveys[k]``), with the live handles
    to read them: each survey's store, amplitude array and brick reader.

    The infos are small and travel to DataLoader workers; the handles (S3 clients, the readers' buffers) do
    not survive pickling or a fork, so a copy reopens the stores in the process that reads, on first use.
    Surveys smaller than the crop along any axis are left out: no crop fits them.

    Args:
        store_urls: survey stores (local paths or s3:// URLs).
        data: the checked ``JobConfig.data``: its ``crop``, ``client`` and ``retry_seconds``
            (:func:`sfm.storage.resilient_store.open_survey_store`), and ``batch_dtype`` (int8 batches need int8 stores).
        brick_reader: read through :mod:`sfm.data.bricks` where the store layout allows (a third less CPU than
            zarr's read path); False: always through zarr.
    """

    def __init__(self, store_urls: list[str], data, brick_reader: bool = True):
        if not store_urls:
            raise SFMError("no survey stores to read; ingest at least one survey")
        self.client, self.retry_seconds = data.client, float(data.retry_seconds)
        self.brick_reader = bool(brick_reader)
        crop = tuple(int(c) for c in data.crop)
        opened = [read_survey_info(url, open_survey_store(url, self.client, self.retry_seconds), self.client,
                                   self.retry_seconds) for url in store_urls]
        fits = [all(n >= c for n, c in zip(info.shape, crop)) for info, _ in opened]
        if not any(fits):
            shapes = ", ".join(f"{info.store_url}: {info.shape}" for info, _ in opened)
            raise SFMError(f"every survey is smaller than the crop {crop} ({shapes}); set data.crop smaller")
        self.info = [info for (info, _), ok in zip(opened, fits) if ok]
        if data.batch_dtype == "int8":
            self._check_int8()
        self._arrays = [amp for (_, amp), ok in zip(opened, fits) if ok]
        # where each amplitude is read: an MDIO store's, for a reference
        self._stores: list[ResilientStore] = [a.store_path.store for a in self._arrays]
        self._readers = self._brick_readers()
        self._pid: int | None = os.getpid()
        self._lock = threading.Lock()

    def _check_int8(self) -> None:
        """int8 batches deliver stored int8 values: every survey must be an int8 store of sfm's own."""
        other = [s for s in self.info if s.stored_dtype != "int8"]
        mdio = [s for s in other if s.source_kind == "mdio"]
        if mdio:
            raise SFMError(f"data.batch_dtype = \"int8\" delivers stored int8 values, but survey {mdio[0].name} "
                           f"({mdio[0].store_url}) is an MDIO store read in place ({mdio[0].stored_dtype}); set "
                           "data.batch_dtype to float16, or export it to SEG-Y and ingest that with --dtype int8")
        if other:
            raise SFMError(f"data.batch_dtype = \"int8\" delivers stored int8 values, but survey store "
                           f"{other[0].store_url} holds {other[0].stored_dtype}; ingest with --dtype int8 or "
                           "set data.batch_dtype to float16")

    def __len__(self) -> int:
        return len(self.info)

    def __getitem__(self, k: int) -> SurveyInfo:
        return self.info[k]

    def __iter__(self) -> Iterator[SurveyInfo]:
        return iter(self.info)

    # ---- the live handles, (re)opened in each process that reads ---------------------------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_stores=[], _arrays=[], _readers=[], _lock=None, _pid=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def open(self) -> None:
        """Open the stores in this process, unless they are: clients do not survive a fork."""
        if self._pid == os.getpid() and self._arrays:
            return
        import zarr

        with self._lock:
            if self._pid == os.getpid() and self._arrays:
                return
            stores, arrays = [], []
            for s in self.info:
                store = open_survey_store(s.store_url, self.client, self.retry_seconds)
                try:
                    group = zarr.open_group(store, mode="r")
                    amp = open_amplitude(dict(group.attrs), group, self.client, self.retry_seconds)
                except Exception as err:
                    raise SFMError(f"cannot reopen survey store {s.store_url}: {type(err).__name__}: {err}; check "
                                   "the S3 endpoint is reachable") from err
                arrays.append(amp)
                stores.append(amp.store_path.store)
            self._stores, self._arrays = stores, arrays
            self._readers = self._brick_readers()
            self._pid = os.getpid()

    def _brick_readers(self) -> list[BrickReader | None]:
        return [BrickReader.for_array(a) if self.brick_reader else None for a in self._arrays]

    def store(self, k: int) -> ResilientStore:
        """Survey ``k``'s store in this process (where its amplitude is read)."""
        self.open()
        return self._stores[k]

    def array(self, k: int):
        """Survey ``k``'s amplitude zarr array in this process."""
        self.open()
        return self._arrays[k]

    def reader(self, k: int) -> BrickReader | None:
        """Survey ``k``'s brick reader in this process; None: its layout is read through zarr."""
        self.open()
        return self._readers[k]

    def retrying(self, on: bool) -> None:
        """Let transient read failures be retried (``on``), or make the reads still running give up."""
        for store in self._stores:
            store.closed = not on

    def fetch_stats(self) -> dict[str, int]:
        """Bytes, requests and retries this process has fetched from storage so far."""
        return {k: sum(getattr(s, k) for s in self._stores) for k in ("bytes_fetched", "requests", "retries")}

    def read_cpu(self) -> dict[str, float]:
        """Thread CPU seconds this process's brick readers spent receiving, decoding and normalising."""
        spent: collections.Counter = collections.Counter()
        for reader in self._readers:
            if reader is not None:
                spent.update(reader.cpu)
        return {phase: float(spent.get(phase, 0.0)) for phase in ("receive", "decode", "normalise")}
