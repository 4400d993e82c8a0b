"""A long SEG-Y survey written quickly: one generated tile of inlines, repeated along the inlines with its
inline numbers moved on and its traces shifted in time by a different amount each repeat, so no two tiles
hold the same values (a read of the wrong brick row shows). Written record by record, never whole in memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from support import ingest_cases as cases


def long_survey(path: Path, tile: tuple[int, int, int], repeats: int, seed: int = 7) -> Path:
    """A format-5 SEG-Y of ``tile[0] * repeats`` inlines of ``tile[1]`` crosslines and ``tile[2]`` samples."""
    il, _, ns = tile
    first = cases.write(Path(path).with_suffix(".tile.sgy"), cases.volume(tile, seed=seed))
    head, records = cases.traces(first, ns)
    first.unlink()
    inlines = records[:, 188:192].copy().view(">i4")[:, 0]
    with open(path, "wb") as out:
        out.write(head)
        for r in range(repeats):
            block = records.copy()
            cases.set_fields(block, 189, inlines + r * il)
            samples = block[:, cases.TRACE_HEADER:].view(">f4")
            samples[:] = np.roll(samples, 5 * r, axis=1) * np.float32(1 + 0.1 * (r % 3))
            out.write(block.tobytes())
    return Path(path)
