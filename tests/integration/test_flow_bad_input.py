"""A bad --surveys entry fails the run at once with a one-line error naming it; nothing is published."""

from __future__ import annotations

import pytest
from support.flowrun import run_flow


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["missing", "not-segy"])
def test_bad_survey_entry_fails_with_one_line(tmp_path, metaflow_env, segy_dir, kind):
    if kind == "missing":
        bad = tmp_path / "landing" / "no-such-survey.sgy"
        expected = "does not exist"
    else:
        bad = tmp_path / "notes.sgy"
        bad.write_text("this is a text file, not seismic\n" * 200)
        expected = "not readable SEG-Y"
    good = segy_dir / "f3.sgy"
    data_root = tmp_path / "data"
    result = run_flow(metaflow_env, cwd=str(tmp_path), data_root=str(data_root),
                         surveys=f"{good},{bad}", held_out=str(segy_dir / "Format1msb.sgy"))
    assert result.status == "failed"
    output = result.stdout + result.stderr
    error_lines = [line for line in output.splitlines() if str(bad) in line and expected in line]
    assert error_lines, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    # nothing published: no manifest rows, no survey stores, no training outputs
    assert not (data_root / "manifest").exists()
    assert not (data_root / "surveys").exists()
    assert not (data_root / "registry").exists()


@pytest.mark.timeout(300)
def test_bad_job_settings_fail_in_start_before_any_ingest(tmp_path, metaflow_env, segy_dir):
    """An unknown preset, given by --set (issue 55: --set reaches the job, after the parameters: --preset tiny is
    overridden), fails the run's first step in one line naming it, not retried, nothing ingested."""
    data_root = tmp_path / "data"
    result = run_flow(metaflow_env, cwd=str(tmp_path), data_root=str(data_root), surveys=str(segy_dir / "f3.sgy"),
                      held_out=str(segy_dir / "Format1msb.sgy"), preset="tiny",
                      set="train.lr=1e-3;model.preset=gigantic")
    assert result.status == "failed"
    output = result.stdout + result.stderr
    assert [line for line in output.splitlines() if "unknown model preset 'gigantic'" in line and "tiny" in line]
    assert "Traceback" not in output and "/ingest/" not in output, output[-3000:]  # failed in start
    assert output.count("/start/1 ") and "Retrying" not in output
    assert not (data_root / "surveys").exists() and not (data_root / "manifest").exists()
