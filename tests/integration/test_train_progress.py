"""A training run whose output is not a terminal (a flow task, a Slurm log) prints plain progress lines, from
rank 0 only, every ``train.log_every_s``: step/total, loss, samples/s, MFU and ETA; no bar, no carriage return.
The run's summary reports the speed of the whole run."""

from __future__ import annotations

import json
import re

import pytest
from support.training import make_job, make_survey_store, start_ranks

LINE = re.compile(r"^(?:\[rank \d\] )?pretrain: step (\d+)/12 \([\d.]+%\), loss [\d.]+, lr [\d.e+-]+, "
                  r"samples/s [\d.]+, voxels/s [\d.]+M, MFU (?:[\d.]+%|-), elapsed \w+, ETA \w+$")


@pytest.fixture(scope="module")
def survey_store(tmp_path_factory) -> str:
    return make_survey_store(tmp_path_factory, seed=21)


@pytest.mark.timeout(240)
def test_two_ranks_print_plain_progress_lines_from_rank_0(survey_store, tmp_path):
    job = make_job(survey_store, str(tmp_path / "run"), max_steps=12, every=12)
    job["config"]["train"].update(log_every=2, log_every_s=0.01)
    log = tmp_path / "train.log"
    proc = start_ranks(job, 2, log)
    assert proc.wait(timeout=200) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "\r" not in text
    lines = [line for line in text.splitlines() if "pretrain: step" in line]
    steps = [int(m.group(1)) for line in lines if (m := LINE.match(line))]
    # every line after the first log window carries the figures; the first (step 1) comes before any
    assert lines[0].startswith("pretrain: step 1/12") and len(steps) >= len(lines) - 1, lines
    assert steps == sorted(set(steps)) and steps[-1] == 12, lines  # one process prints: no step twice
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mfu"] is None or 0 < summary["mfu"] <= 1
    # the summary's speed is the whole run's, not its last window's: 6 windows of 2 steps, the same samples
    # each, so all of them together run at the harmonic mean of their rates
    rates = [h["samples_per_s"] for h in summary["history"] if "samples_per_s" in h]
    assert len(rates) == 6, summary["history"]
    assert summary["samples_per_s"] == pytest.approx(len(rates) / sum(1 / r for r in rates), rel=1e-9)
