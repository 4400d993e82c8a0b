"""An error the user can fix reads as one line wherever it happens (sfm.user_errors): an unreachable bucket named in
a training job is reported by the rank that met it, by its node's launcher and by the command or the flow step that
started them, each in one line, with no traceback and a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.flowrun import fast_job_toml, run_flow

from conftest import free_port

pytestmark = pytest.mark.long(3)

DEAD = "http://127.0.0.1:{port}"  # nothing listens there: connections are refused at once
ATTEMPTS = "2"  # AWS_MAX_ATTEMPTS: botocore retries a refused connection with backoff (10 attempts: about a minute)


def user_error_lines(output: str, command: str) -> list[str]:
    return [line for line in output.splitlines() if f"sfm {command}: error: " in line]


@pytest.mark.timeout(300)
def test_an_unreachable_bucket_in_a_training_job_is_one_line_from_the_rank_and_the_command(tmp_path, s3_server):
    env = {**os.environ, **s3_server.env(), "SFM_S3_ENDPOINT_URL": DEAD.format(port=free_port()),
           "AWS_MAX_ATTEMPTS": ATTEMPTS}
    proc = subprocess.run(
        [sys.executable, "-m", "sfm.cli", "train", "--surveys", "s3://no-bucket/surveys/0123456789abcdef.zarr",
         "--run-root", str(tmp_path / "run"), "--set", "model.preset=tiny;train.max_steps=2;data.retry_seconds=1"],
        env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = user_error_lines(proc.stderr, "train")
    assert len(lines) == 2, proc.stderr[-3000:]  # the rank's, then the node's
    assert "s3://no-bucket/surveys/0123456789abcdef.zarr" in lines[0], lines
    assert "training failed on node 0" in lines[1], lines
    assert "sfm: rank 0 failed (" in proc.stderr, proc.stderr[-3000:]  # its exit status, or the signal that ended it
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]


@pytest.mark.timeout(600)
def test_an_unreachable_bucket_in_the_flows_training_job_is_one_line_from_the_rank_and_the_step(
        tmp_path, metaflow_env, s3_server, segy_dir):
    """The data root is reachable while the flow ingests; its training nodes are given an endpoint that refuses
    (``[cluster] env``, the pretrain step's environment), so the bucket the training job names is unreachable
    from the ranks."""
    bucket = s3_server.make_bucket("user-errors")
    dead = DEAD.format(port=free_port())
    config = tmp_path / "job.toml"
    config.write_text(fast_job_toml(train={"max_steps": 2}, data={"retry_seconds": 1},
                                    cluster={"env": f"SFM_S3_ENDPOINT_URL={dead},AWS_MAX_ATTEMPTS={ATTEMPTS}"}))
    env = {**metaflow_env, **s3_server.env()}
    result = run_flow(env, cwd=str(tmp_path), top_level={"config": [("config", str(config))]},
                      data_root=f"{bucket}/sfm", surveys=str(segy_dir / "f3.sgy"),
                      held_out=str(segy_dir / "Format1msb.sgy"))
    assert result.status == "failed"
    output = result.stdout + result.stderr
    assert "/ingest/" in output and "/pretrain/" in output, output[-3000:]  # ingested, failed in training
    rank_lines = user_error_lines(output, "train")
    assert rank_lines and all(f"{bucket}/sfm/surveys/" in line for line in rank_lines), output[-4000:]
    lines = output.splitlines()  # Metaflow prints the headline, then the line
    step_lines = [lines[i + 1] for i, line in enumerate(lines[:-1]) if line.rstrip().endswith("sfm input error:")]
    assert step_lines and all("training failed on node 0" in line for line in step_lines), output[-4000:]
    assert "Traceback" not in output, output[-4000:]
