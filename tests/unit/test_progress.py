"""Progress without a terminal is plain lines, at most one per interval, each with the count, the figures and
the ETA; on a terminal it is tqdm's bar."""

from __future__ import annotations

import io

from sfm import progress
from sfm.progress import Progress, duration


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_come_at_most_once_per_interval_with_count_figures_and_eta(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    out = io.StringIO()
    p = Progress(100, "pretrain", every_s=30, file=out)
    p.update()  # the first update prints at once
    for _ in range(9):
        clock.now += 2
        p.update()  # 18 s: nothing more
    p.set(loss="0.5000", **{"samples/s": "12.0"})
    clock.now += 12
    p.update()  # 30 s after the first line
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue()
    assert lines[0].startswith("pretrain: step 1/100 (1.0%), elapsed 0s")
    # 11 steps in 30 s: 89 more take 242 s
    assert lines[1] == "pretrain: step 11/100 (11.0%), loss 0.5000, samples/s 12.0, elapsed 30s, ETA 4m02s"
    p.close()  # nothing counted since the last line: nothing printed
    assert len(out.getvalue().splitlines()) == 2


def test_close_prints_the_last_count_and_a_resume_restarts_the_rate(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    out = io.StringIO()
    p = Progress(10, "ingest s1", unit="column", every_s=60, file=out)
    p.reset(4)  # resumed with 4 done: the rate counts only what this process does
    clock.now += 3
    p.update(2)
    clock.now += 3
    p.update(2)
    p.close()
    lines = out.getvalue().splitlines()
    assert lines == ["ingest s1: column 6/10 (60.0%), elapsed 3s, ETA 6s",
                     "ingest s1: column 8/10 (80.0%), elapsed 6s, ETA 3s"]


def test_a_disabled_progress_prints_nothing():
    out = io.StringIO()
    p = Progress(5, "pretrain", file=out, enabled=False)
    p.update()
    p.close()
    assert out.getvalue() == ""


def test_a_terminal_gets_a_bar_not_lines():
    out = Terminal()
    p = Progress(5, "pretrain", every_s=0, file=out)
    p.update(5)
    p.close()
    assert "\r" in out.getvalue() and "5/5" in out.getvalue()


def test_durations_read_as_a_person_would():
    assert [duration(s) for s in (0, 59.9, 61, 3600, 3725, 90000)] == ["0s", "59s", "1m01s", "1h00m", "1h02m",
                                                                         "1d01h"]


def test_quantities_read_in_three_figures():
    assert [progress.quantity(v) for v in (850, 12_345, 1_523_000, 4.07e9, 0.5)] == ["850", "12.3k", "1.52M", "4.07G", "0.5"]
