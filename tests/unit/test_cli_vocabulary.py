"""One vocabulary (issue 55): a model reference resolved the same way by every command that names a model, ``--set``
reaching the config of ``sfm train`` and of the flows, ``sfm --version``, the empty registry's one line, the old
spellings still working for one release with one line of notice, and enumerations refused in one line.

Everything runs in this process on a registry of two tiny models (an encoder and a task model): what each entry
point calls (the fine-tune flow's ``--encoder``, the pretrain flow's ``--init-from``, ``sfm predict --model``,
``sfm registry``) is called as the entry calls it. The flows' own runs with ``--set`` are in
tests/integration/test_installed_package.py (fine-tune, predict) and test_flow_bad_input.py (pretrain).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sfm.cli import build_parser, main
from sfm.config import DATA_ROOT, JobConfig
from sfm.errors import SFMError
from sfm.model import registry

LINEAGE = {"run_pathspec": "test", "manifest_version": "m0", "code_version": "t", "surveys": []}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """sfm-mae v1 (a tiny encoder, the champion) and sfm-faults v1 (a binary task model on it)."""
    from sfm.model import build_model, mae_config, save
    from sfm.model.segmenter import Segmenter, Task, save_segmenter

    tmp = tmp_path_factory.mktemp("vocabulary")
    torch.manual_seed(0)
    encoder = build_model(mae_config("tiny", crop=(16, 16, 16)))
    save(encoder, str(tmp / "encoder"))
    save_segmenter(Segmenter(encoder, Task()), str(tmp / "faults"))
    data_root = str(tmp / "data")
    cfg = JobConfig().override(["data.crop=[16,16,16]"]).to_dict()
    registry.register(data_root, "sfm-mae", str(tmp / "encoder"), config=cfg, metrics={"masked_nmse": 1.0},
                      lineage=LINEAGE)
    registry.register(data_root, "sfm-faults", str(tmp / "faults"), config=cfg, metrics={"ap": 0.5},
                      lineage={**LINEAGE, "task": "binary", "encoder": "sfm-mae:v1"}, force_champion=True)
    return data_root


def notices(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("sfm: deprecated:")]


def test_every_command_resolves_a_model_reference_the_same_way(root, capsys):
    from sfm.finetune.run import encoder_at
    from sfm.ops.pipeline import resolve_init_from
    from sfm.predict.task_model import load_task_model

    cfg = JobConfig().override(["data.crop=[16,16,16]"])
    v1 = registry.version_url(root, "sfm-mae", 1)
    # --encoder sfm-mae:v1 (the fine-tune flow), by reference or by the version's folder: the same lineage
    assert encoder_at("sfm-mae:v1", root, cfg)[:2] == (v1, "sfm-mae:v1")
    assert encoder_at(v1, root, cfg) == encoder_at("sfm-mae", root, cfg)
    # --init-from sfm-mae:latest (the pretrain flow, sfm train): the version's folder
    assert resolve_init_from(JobConfig().override(["data.crop=[16,16,16]"], init_from="sfm-mae:latest"),
                             root).train.init_from == v1
    # sfm predict --model sfm-faults (and the predict flow): its champion
    model = load_task_model("sfm-faults", root)
    assert (model.name, model.version, model.url, model.data_root) == \
        ("sfm-faults", 1, registry.version_url(root, "sfm-faults", 1), root)
    assert load_task_model(registry.version_url(root, "sfm-faults", 1), "elsewhere").sha256 == model.sha256
    # sfm registry show sfm-mae:champion, by reference or by folder
    assert main(["registry", "show", "sfm-mae:champion", "--data-root", root]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert main(["registry", "show", v1]) == 0
    assert json.loads(capsys.readouterr().out) == shown and (shown["version"], shown["url"]) == (1, v1)
    # the same refusals: one line naming the forms, a task model is no encoder, an encoder no task model
    for bad in ("sfm-mae:v9", "sfm-nothing:v1", "sfm-mae:v1:v2"):
        assert main(["registry", "show", bad, "--data-root", root]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(SFMError, match="is not an encoder"):
        encoder_at("sfm-faults:v1", root, cfg)
    with pytest.raises(SFMError, match="sfm-mae"):
        load_task_model("sfm-mae", root)
    assert not notices(capsys.readouterr().err)


def test_old_spellings_work_with_one_line_of_notice(root, capsys):
    from sfm.finetune.run import encoder_at
    from sfm.ops.pipeline import resolve_init_from

    parser = build_parser()
    assert parser.parse_args(["ingest", "a.sgy", "--out", "r"]).data_root == "r"
    assert parser.parse_args(["ingest-labels", "l.npy", "--survey", "s", "--out", "r"]).data_root == "r"
    assert parser.parse_args(["ingest", "a.sgy"]).data_root == DATA_ROOT
    err = capsys.readouterr().err
    assert notices(err) == ["sfm: deprecated: sfm ingest --out r works in this release only; write sfm ingest "
                            "--data-root r", "sfm: deprecated: sfm ingest-labels --out r works in this release only; "
                            "write sfm ingest-labels --data-root r"]

    assert main(["registry", "show", "sfm-mae:v1", "--data-root", root]) == 0
    new = capsys.readouterr().out
    assert main(["registry", "show", "--model", "sfm-mae", "--version", "1", "--data-root", root]) == 0
    out, err = capsys.readouterr()
    assert out == new and len(notices(err)) == 1 == len(err.splitlines()) and "registry show sfm-mae:v1" in err

    cfg = JobConfig().override(["data.crop=[16,16,16]"])
    assert encoder_at("v1", root, cfg) == encoder_at("sfm-mae:v1", root, cfg)
    assert notices(capsys.readouterr().err) == ["sfm: deprecated: --encoder v1 works in this release only; write "
                                                "--encoder sfm-mae:v1"]
    assert resolve_init_from(cfg.override(init_from="champion"), root).train.init_from == \
        registry.version_url(root, "sfm-mae", 1)
    assert len(notices(capsys.readouterr().err)) == 1

    assert main(["train", "--surveys", "s3://b/a.zarr", "--run-root", "/tmp/run", "--dry-run",
                 "train.max_steps=7"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["job"]["config"]["train"]["max_steps"] == 7
    assert notices(err) == ["sfm: deprecated: sfm train train.max_steps=7 works in this release only; write "
                            "sfm train --set train.max_steps=7"]


def test_set_reaches_the_config_after_the_named_parameters(capsys):
    from sfm.flows import flow_command
    from sfm.ops.cluster import flow_job

    # sfm train: --set (repeated, or several in one) wins over a flag naming the same key
    assert main(["train", "--surveys", "s3://b/a.zarr", "--run-root", "/tmp/run", "--dry-run", "--procs-per-node", "2",
                 "--set", "train.max_steps=7", "--set", "data.batch_size=3;dist.procs_per_node=1"]) == 0
    job = json.loads(capsys.readouterr().out)["job"]["config"]
    assert (job["train"]["max_steps"], job["data"]["batch_size"], job["dist"]["procs_per_node"]) == (7, 3, 1)
    # a flow's start: its parameters (defaulting to the config's values), then its one --set string
    job = flow_job({"train": {"max_steps": 50}}, "train.max_steps=7; data.batch_size=3", max_steps=50, nodes=2)
    assert (job.train.max_steps, job.data.batch_size, job.dist.nodes) == (7, 3, 2)
    assert flow_job({}, "", max_steps=9).train.max_steps == 9
    with pytest.raises(SFMError, match=r"--set cluster.gpu=8: \[cluster\] is read when the flow is built"):
        flow_job({}, "cluster.gpu=8")
    with pytest.raises(SFMError, match="--set 'train.max_steps' must look like section.key=value"):
        flow_job({}, "train.max_steps")
    # sfm flow joins a repeated --set into the one the flow reads, and names packaged configs
    command = flow_command("pretrain", ["--config", "config", "quality_cpu", "run", "--set", "a.b=1",
                                        "--set=c.d=[1,2]"])
    assert command[2:] == ["--config", "config", str(Path(command[1]).parents[1] / "configs" / "quality_cpu.toml"),
                           "run", "--set", "a.b=1;c.d=[1,2]"]


def test_sfm_version_and_the_empty_registry(tmp_path, capsys):
    import sfm

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    line = capsys.readouterr().out.strip()
    code = registry.code_version()
    assert line.startswith(f"sfm {sfm.__version__}") and (code in line) and "\n" not in line

    assert main(["registry", "list", "--data-root", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert f"no model registered in {tmp_path}" in err and "sfm flow pretrain run" in err


def test_enumerations_are_refused_in_one_line(capsys):
    from sfm.config import PredictConfig
    from sfm.ops.cluster import flow_job

    parser = build_parser()
    for args in (["ingest", "a.sgy", "--layout", "zarr"], ["predict", "--model", "m", "--survey", "s", "--out", "o",
                                                          "--device", "gpu"], ["flow", "pretrian"],
                 ["iam-policy", "--data-root", "s3://b/p", "--partition", "aws-eu"]):
        with pytest.raises(SystemExit):
            parser.parse_args(args)
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "error: argument" in err and "--help)" in err, err  # one line
    assert "{auto,cpu,cuda,cuda:N}" in parser._subparsers._group_actions[0].choices["predict"].format_help()
    # the flows' start: their parameters reach the job, checked in one line (the pretrain flow's, the predict flow's)
    for named, words in ((dict(strategy="zero9"), "dist.strategy = 'zero9' is not a strategy; use one of ddp"),
                         (dict(launcher="mpirun"), "dist.launcher = 'mpirun' is not valid; use one of torchrun")):
        with pytest.raises(SFMError, match=words) as err:
            flow_job({}, "", **named).validate()
        assert "\n" not in str(err.value)
    for named, words in ((dict(output="probs"), "predict.output = 'probs' is not valid"),
                         (dict(layout="zarr"), "predict.layout = 'zarr'"), (dict(overlap=1.5), "predict.overlap"),
                         (dict(device="gpu"), "device 'gpu' is not a device")):
        with pytest.raises(SFMError, match=words) as err:
            flow_job({}, "", **named).predict.check()
        assert "\n" not in str(err.value)
    PredictConfig().check()
