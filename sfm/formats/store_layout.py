"""The store layout's constants: the bricks' codec, the statistics kept, the shards' size, and how shard rows
split into parts (the settings themselves are :class:`sfm.config.IngestConfig`)."""

from __future__ import annotations

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


def split_runs(count: int, parts: int) -> list[tuple[int, int]]:
    """``count`` consecutive items (shard rows) split into at most ``parts`` contiguous runs [(lo, hi)], as even
    as can be: the parts of an ingest or a prediction."""
    parts = max(1, min(parts, count))
    return [(count * k // parts, count * (k + 1) // parts) for k in range(parts)]
