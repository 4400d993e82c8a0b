"""HyperPod Slurm: `sfm slurm-script` renders an sbatch script whose launch logic runs here in dry-run
mode for a fake 2-node allocation (data root on a loopback S3 server), and `sfm train` trains one
node for real, then resumes from its checkpoint when started again (what a requeued job does)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import PROJECT, free_port
from sfm.ingest import survey as ingest
from sfm.synth import survey as synth
from sfm.ops.cluster import EFA_ENV
from sfm.config import JobConfig
from sfm.errors import SFMError
from sfm.ops.slurm import SbatchOptions, expand_hostlist, render_sbatch

P5EN = PROJECT / "sfm" / "configs" / "hyperpod_p5en.toml"


def tiny_store(tmp: Path, data_root: str, seed: int = 0) -> str:
    """A small synthetic survey ingested into ``data_root``; returns its store URL."""
    sgy = synth.synth_survey(str(tmp / f"tiny-{seed}.sgy"), shape=(40, 40, 48), seed=seed)["segy"]
    return ingest.ingest_survey(sgy, data_root, chunk=16)["store_url"]


def sfm_cli(*args: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfm.cli", *args], cwd=PROJECT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def test_expand_hostlist_like_scontrol():
    assert expand_hostlist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_hostlist("ip-10-1-2-3,gpu-[8-10]-a,login") == ["ip-10-1-2-3", "gpu-8-a", "gpu-9-a", "gpu-10-a",
                                                                   "login"]
    assert expand_hostlist("solo") == ["solo"]
    with pytest.raises(SFMError, match="bad range"):
        expand_hostlist("node[a-b]")


def test_config_toml_round_trips():
    cfg = JobConfig.from_toml(P5EN, ["train.max_steps=7", "model.patch=[8, 8, 8]"])
    assert JobConfig.from_dict(tomllib.loads(cfg.to_toml())).to_dict() == cfg.to_dict()


def test_sbatch_refuses_node_local_paths():
    with pytest.raises(SFMError, match="--run-root runs/a must be an s3:// URL or an absolute path"):
        render_sbatch(JobConfig().override(nodes=2, procs_per_node=8), SbatchOptions(data_root="s3://b/sfm",
                                                                                     run_root="runs/a"))


@pytest.mark.timeout(300)
def test_sbatch_script_dry_run_on_two_fake_nodes(s3_env, tmp_path):
    root = s3_env.make_bucket("sfm-slurm") + "/sfm"
    store = tiny_store(tmp_path, root)
    tiny_store(tmp_path, root, seed=1)  # held out below
    run_root = root + "/runs/job-a"
    script = tmp_path / "pretrain.sbatch"
    made = sfm_cli("slurm-script", "--config", str(P5EN), "--data-root", root, "--held-out", "tiny-1",
                   "--run-root", run_root, "--nodes", "2", "--time", "1-00:00:00", "--partition", "p5en",
                   "--auto-resume", "--out", str(script), "train.max_steps=123", env=s3_env.env())
    assert made.returncode == 0, made.stderr
    text = script.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=p5en", "#SBATCH --time=1-00:00:00", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@120", "#SBATCH --open-mode=append", "trap requeue USR1",
                 'scontrol requeue "$SLURM_JOB_ID"', 'scontrol show hostnames "$SLURM_JOB_NODELIST"',
                 "--auto-resume=1", "export FI_PROVIDER=efa"):
        assert line in text, line
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0

    # the launch logic for a fake 2-node allocation; no Slurm on this machine, so no scontrol either
    assert shutil.which("scontrol") is None
    env = {**os.environ, **s3_env.env(), "SFM_DRY_RUN": "1", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "hp-p5en-[07-08]", "SLURM_RESTART_COUNT": "1"}
    env.pop("FI_PROVIDER", None)
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    plans = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [p["launch_node"]["node_rank"] for p in plans] == [0, 1]
    port = 20000 + (4242 * 16 + 1) % 20000
    for plan in plans:
        assert {k: v for k, v in plan["launch_node"].items() if k != "node_rank"} == \
            {"nodes": 2, "procs_per_node": 8, "main_addr": "hp-p5en-07", "main_port": port}
        job = plan["job"]
        assert job["run_root"] == run_root and job["surveys"] == [store]  # tiny-1 held out
        assert job["config"]["train"]["max_steps"] == 123 and job["config"]["model"]["preset"] == "large"
        assert job["config"]["dist"] == {**job["config"]["dist"], "nodes": 2, "procs_per_node": 8}
        assert plan["environment"] == {**EFA_ENV, "NCCL_DEBUG": "WARN"}
    assert f"rendezvous hp-p5en-07:{port}" in proc.stderr

    # a node command that fails (here: a held-out name the manifest lacks) fails the whole script
    bad = script.read_text().replace("--held-out tiny-1", "--held-out no-such-survey")
    script.write_text(bad)
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "no-such-survey is not a published survey" in proc.stderr


@pytest.mark.timeout(400)
def test_sfm_train_one_node_then_resume(tmp_path):
    root = str(tmp_path / "data")
    tiny_store(tmp_path, root)
    run_root = str(tmp_path / "run")
    common = ["--data-root", root, "--run-root", run_root, "--nodes", "1", "--node-rank", "0",
              "--procs-per-node", "1", "--main-addr", "127.0.0.1", "--main-port", str(free_port()),
              "data.batch_size=2", "train.checkpoint_every=2", "train.log_every=2", "train.warmup_steps=1",
              "train.threads_per_process=1"]
    first = sfm_cli("train", *common, "train.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["resumed_from_step"] == 0 and summary["world_size"] == 1
    assert summary["model_url"] == os.path.join(run_root, "final")
    assert (Path(run_root) / "final" / "model.safetensors").is_file()

    # started again with the same run root (as a requeued Slurm job is): continues from step 4
    again = sfm_cli("train", *common, "train.max_steps=6")
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads(again.stdout.strip().splitlines()[-1])
    assert resumed["steps"] == 6 and resumed["resumed_from_step"] == 4


def test_sfm_train_bad_input_is_one_line(tmp_path):
    proc = sfm_cli("train", "--data-root", str(tmp_path / "empty"), "--run-root", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no published surveys" in proc.stderr
    proc = sfm_cli("train", "--surveys", "s3://b/a.zarr", "--run-root", "run", "--nodes", "2", "--node-rank", "2")
    assert proc.returncode == 2 and "--node-rank 2 is outside 0..1" in proc.stderr
