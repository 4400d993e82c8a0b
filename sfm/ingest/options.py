"""The store layout's constants: the bricks' codec, the statistics kept, the threads ingest uses
(the settings themselves are :class:`sfm.config.IngestConfig`)."""

from __future__ import annotations

import os
from typing import Any

from sfm.config import CODEC_NAMES, IngestConfig, codec_settings  # noqa: F401  (CODEC_NAMES: the choices)

STORE_VERSION = 1
PERCENTILES = (0.1, 1, 50, 99, 99.9)
PERCENTILE_TRACES = 4096  # evenly spaced traces kept for the percentiles (all traces of smaller surveys)
TRANSFORM_TRACES = 1024  # evenly spaced traces read first to fix the float16 / int8 transform
SHARD_BYTES = 64 << 20  # target size of one shard (bricks along the sample axis)
FLOAT16_MAX = 65504.0
INT8_MAX = 127  # int8 stores use -127..127 (symmetric: -128 is never written)
# The bricks' codec, "cname[:clevel]" over byte-shuffled 1 MiB blocks. The default (IngestConfig.codec,
# shared with the CLI and the flow) is zstd level 1; BENCHMARKS.md "Ingest" has why.
DEFAULT_CODEC = IngestConfig.codec


def codec_spec(codec: str) -> dict[str, Any]:
    """The Blosc settings of the amplitude bricks for ``codec`` = "cname[:clevel]" (clevel 1 if not given)."""
    cname, clevel = codec_settings(codec)
    return {"cname": cname, "clevel": clevel, "shuffle": "shuffle", "blocksize": 1 << 20}


AMPLITUDE_CODEC = codec_spec(DEFAULT_CODEC)



def ingest_threads(cfg: IngestConfig, remote: bool = False) -> int:
    """Threads to use. Writing a local store is CPU work (page-cache copies), so one thread per core
    (more only thrash the caches, BENCHMARKS.md "Ingest"); PUTs to S3 wait on the network, so two
    more threads keep the cores busy meanwhile."""
    return int(cfg.workers) or min(16, (os.cpu_count() or 1) + (2 if remote else 0))
