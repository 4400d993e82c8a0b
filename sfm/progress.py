"""Progress a person can follow: a tqdm bar on a terminal, plain lines everywhere else.

A flow task's output reaches Metaflow line by line, and a Slurm log is a file: a bar's carriage returns
would pile up into one line printed when the step ends. So when the stream is not a terminal,
:class:`Progress` prints one plain line every ``every_s`` seconds instead::

    pretrain: step 120/4000 (3.0%), loss 0.4123, 45.2 samples/s, MFU 12.3%, elapsed 2m10s, ETA 1h10m

The ETA comes from the rate of this process's own updates since it started (a resumed run counts only
what it did itself).
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

DEFAULT_EVERY_S = 30.0  # [train] log_every_s's default; ingest and evaluation use the job's value too


def duration(seconds: float) -> str:
    """``seconds`` as 45s, 2m10s, 1h05m or 3d04h."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def quantity(value: float) -> str:
    """``value`` in three significant figures or so: 850, 12.3k, 1.52M, 4.07G."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


class Progress:
    """``total`` units of work named ``desc`` (counted in ``unit``), reported on ``file`` (stderr).

    ``update(n)`` counts work done; ``set(**fields)`` sets the figures shown beside the count (values are
    printed as given: format them first). ``enabled=False`` reports nothing (another rank's). On a
    terminal a tqdm bar; otherwise a line at the first update, then at most every ``every_s`` seconds,
    and a last one at :meth:`close` when anything was counted since the previous line.
    """

    def __init__(self, total: int, desc: str, *, unit: str = "step", every_s: float = DEFAULT_EVERY_S,
                 enabled: bool = True, file: IO[str] | None = None):
        self.total, self.desc, self.unit, self.every_s = int(total), desc, unit, float(every_s)
        self.file = file if file is not None else sys.stderr
        self.enabled = enabled
        self.n = 0
        self.fields: dict[str, Any] = {}
        self._bar = None
        if enabled and _is_terminal(self.file):
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit=unit, mininterval=2, file=self.file)
        self._start_n, self._started = 0, time.monotonic()
        self._printed_at: float | None = None
        self._printed_n = 0

    def reset(self, n: int = 0) -> None:
        """Continue from ``n`` units done (a resume or a rollback); the rate restarts from here."""
        self.n = self._start_n = self._printed_n = int(n)
        self._started = time.monotonic()
        if self._bar is not None:
            self._bar.reset(total=self.total)
            self._bar.update(self.n)

    def set(self, **fields: Any) -> None:
        self.fields.update(fields)
        if self._bar is not None:
            self._bar.set_postfix(self.fields)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled:
            now = time.monotonic()
            if self._printed_at is None or now - self._printed_at >= self.every_s:
                self._print(now)

    def line(self, now: float | None = None) -> str:
        """The plain progress line as it stands."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._started
        done = self.n - self._start_n
        share = f" ({self.n / self.total:.1%})" if self.total else ""
        parts = [f"{self.desc}: {self.unit} {self.n}/{self.total}{share}"]
        parts += [f"{key} {value}" for key, value in self.fields.items()]
        parts.append(f"elapsed {duration(elapsed)}")
        if done > 0 and self.total:
            parts.append(f"ETA {duration((self.total - self.n) * elapsed / done)}")
        return ", ".join(parts)

    def _print(self, now: float) -> None:
        print(self.line(now), file=self.file, flush=True)
        self._printed_at, self._printed_n = now, self.n

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.n > self._printed_n:
            self._print(time.monotonic())


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
