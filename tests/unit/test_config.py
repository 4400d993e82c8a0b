"""The job config: every setting validated in one place, with the key and the fix in one line."""

from __future__ import annotations

import tomllib

import pytest

from sfm.errors import SFMError


def resolved(config: dict, **named):
    """The job the flow's ``start`` (and ``sfm train``) resolves from a TOML dict and named parameters."""
    from sfm.config import JobConfig
    from sfm.ops import pipeline

    return pipeline.job_config(JobConfig.from_dict(config).override(**named))


def test_job_settings_are_validated_with_the_key_and_the_fix():
    for kwargs, words in ((dict(max_steps=-5),
                           "train.max_steps = -5 must be at least 1; give a positive one: --max-steps N (the pretrain flow)"),
                          (dict(preset="gigantic"), "valid presets are tiny, mini"),
                          (dict(config={"data": {"augment": "rotate"}}), "data.augment names rotate"),
                          (dict(config={"train": {"snapshots": [1.5]}}), "train.snapshots"),
                          (dict(config={"data": {"client": "curl"}}), "data.client = 'curl' is not valid"),
                          (dict(config={"data": {"batch_dtype": "int8"}}), "but ingest.dtype = 'float32'; set ingest"),
                          (dict(config={"model": {"decoder_mask_ratio": 1.0}}), "model.decoder_mask_ratio = 1.0"),
                          (dict(config={"model": {"decoder_mask_ratio": 0.5}}, cp=2, procs_per_node=2),
                           "not implemented with dist.cp = 2"),
                          (dict(config={"train": {"optimizer": "sgd"}}), "train.optimizer = 'sgd' is not valid"),
                          (dict(launcher="mpirun"), "dist.launcher = 'mpirun' is not valid; use one of torchrun, "
                           "accelerate"),
                          (dict(nodes=0), "dist.nodes = 0 must be at least 1; pass --nodes 1 or more"),
                          (dict(config={"dist": {"procs_per_node": -1}}),
                           "dist.procs_per_node = -1 must be at least 1; pass --procs-per-node 1 or more"),
                          (dict(config={"train": {"optimizer": "muon"}}, strategy="fsdp2-full", procs_per_node=2),
                           "fsdp2-full's shards do not hold; use dist.strategy = ddp")):
        config = kwargs.pop("config", {})
        with pytest.raises(SFMError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            resolved(config, **kwargs)
    resolved({})  # the defaults pass
    assert resolved({"model": {"decoder_mask_ratio": 0.5}}).model.decoder_mask_ratio == 0.5
    resolved({"ingest": {"dtype": "int8"}, "data": {"batch_dtype": "int8"}})
    resolved({"train": {"optimizer": "muon"}}, procs_per_node=2)  # DDP: whole matrices


def test_overrides_and_named_parameters_take_one_path():
    """The named parameters of the flows and the CLI (None: not given, the config's value stays), then the
    ``section.key=value`` items of ``--set`` (several in one, separated by ';'), which win; a name that is not a
    parameter is a bug."""
    from sfm.config import PARAMETERS, JobConfig

    cfg = JobConfig.from_dict({"dist": {"nodes": 4}}).override(["train.max_steps=9", "dist.cp=2;data.crop=[8,8,16]"],
                                                                 cp=1, nodes=None, preset="mini", ingest_parts=3)
    assert (cfg.train.max_steps, cfg.dist.cp, cfg.dist.nodes, cfg.model.preset, cfg.ingest.parts) == \
        (9, 2, 4, "mini", 3)
    assert cfg.data.crop == (8, 8, 16)
    assert JobConfig().override("train.max_steps=9; ;dist.cp=2").to_dict() == \
        JobConfig().override(["train.max_steps=9", "dist.cp=2"]).to_dict()  # a flow's one string
    assert JobConfig.from_toml(None, ["train.max_steps=9"]).to_dict() == JobConfig().override(["train.max_steps=9"]).to_dict()
    assert all(JobConfig().override(**{name: None}).to_dict() == JobConfig().to_dict() for name in PARAMETERS)
    with pytest.raises(SFMError, match="--set 'train.max_steps' must look like section.key=value"):
        JobConfig().override(["train.max_steps"])
    with pytest.raises(TypeError, match="max_stepz is not a job parameter"):
        JobConfig().override(max_stepz=3)


def test_keys_no_release_reads_are_unknown():
    """0.1.0 has no earlier configs to carry: the fault probe's old keys are refused like any other."""
    from sfm.config import JobConfig

    with pytest.raises(SFMError, match="unknown config key 'eval.probe_train_volumes'"):
        JobConfig.from_dict({"eval": {"crops": 8, "probe_train_volumes": 8}})
    with pytest.raises(SFMError, match="unknown config key 'eval.probe_test_volumes'; valid keys in \\[eval\\]"):
        JobConfig.from_toml(None, ["eval.probe_test_volumes=4"])


def test_values_take_the_type_of_their_field():
    from sfm.config import JobConfig

    cfg = JobConfig.from_dict({"data": {"crop": 48, "region_bricks": [1.0, 2, 3], "min_live_fraction": 1,
                                        "augment": "swap"},
                               "model": {"patch": [4, 4, 8]}, "train": {"betas": 0.9, "snapshots": 0.5,
                                                                        "compile": "yes", "max_steps": 7.0},
                               "eval": {"budgets": [1, 4, 16]}})
    assert cfg.data.crop == (48, 48, 48) and cfg.data.region_bricks == (1, 2, 3)
    assert cfg.data.min_live_fraction == 1.0 and isinstance(cfg.data.min_live_fraction, float)
    assert cfg.model.patch == (4, 4, 8) and cfg.train.betas == (0.9, 0.9) and cfg.train.snapshots == (0.5,)
    assert cfg.train.compile is True and cfg.train.max_steps == 7 and isinstance(cfg.train.max_steps, int)
    assert cfg.eval.budgets == (1, 4, 16)
    cfg.set("model.patch", None)  # the preset's
    assert cfg.model.patch is None
    with pytest.raises(SFMError, match=r"config key 'train.max_steps' got 7.5: not an integer; expected int$"):
        cfg.set("train.max_steps", 7.5)
    with pytest.raises(SFMError, match=r"config key 'data.crop' got \['a'\].*; expected tuple\[int, int, int\]$"):
        cfg.set("data.crop", ["a"])


@pytest.mark.parametrize("settings, words", [
    ({"crop": [16, 0, 16]}, "data.crop = [16, 0, 16] is not a crop shape; give 3 positive sizes"),
    ({"crop": [16, 16]}, "data.crop = [16, 16] is not a crop shape"),
    ({"align": "sideways"}, "data.align = 'sideways' is not valid; use one of voxel, brick"),
    ({"augment": "flip_inline, rotate"}, "data.augment names rotate; use any of flip_inline"),
    ({"min_live_fraction": 1.5}, "data.min_live_fraction = 1.5 must be in [0, 1]"),
    ({"batch_dtype": "int4"}, "data.batch_dtype = 'int4' is not valid; use one of float32, float16, int8"),
    ({"client": "curl"}, "data.client = 'curl' is not valid"),
    ({"batch_size": 0}, "data.batch_size = 0 must be at least 1"),
    ({"read_threads": 0}, "data.read_threads = 0 must be at least 1"),
    ({"workers": -1}, "data.workers = -1 must be at least 0"),
    ({"prefetch": 0}, "data.prefetch = 0 must be at least 1"),
    ({"cache_mb": -1}, "data.cache_mb = -1 must be at least 0 (0: no brick cache)"),
    ({"crops_per_region": 0}, "data.crops_per_region = 0 must be at least 1 (1: a fetch per crop)"),
    ({"crops_per_region": 4, "region_bricks": [2, 0, 2]}, "data.region_bricks = [2, 0, 2] must be 3 positive brick"),
    ({"regions_in_flight": -1}, "data.regions_in_flight = -1 must be at least 0 (0: automatic)"),
    ({"pool_mb": -2}, "data.pool_mb = -2 must be at least 0 (0: automatic)"),
])
def test_each_bad_data_setting_is_one_line_naming_it(settings, words):
    """The data settings are checked once, by their section (JobConfig.validate calls it): the loader builds
    from a checked section and checks none of them again."""
    from sfm.config import DataConfig, JobConfig

    for check in (JobConfig.from_dict({"data": settings}).validate, DataConfig(**settings).check):
        with pytest.raises(SFMError) as err:
            check()
        assert words in str(err.value) and "\n" not in str(err.value)


def test_config_imports_no_layer_above_it():
    import ast
    from pathlib import Path

    import sfm.config

    tree = ast.parse(Path(sfm.config.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert not {m for m in imported if m.split(".")[:2] in (["sfm", "data"], ["sfm", "model"], ["sfm", "ingest"])}


def test_the_finetune_section_and_the_champion_metric_are_checked():
    from sfm.config import EvalConfig, FinetuneConfig, JobConfig

    assert isinstance(EvalConfig().finetune, FinetuneConfig)  # one recipe type: the evaluation's is [eval.finetune]
    for override, named in (("finetune.lrs=[]", "finetune.lrs"), ("finetune.held_out=1", "finetune.held_out"),
                            ("finetune.steps=-1", "finetune.steps"), ("eval.finetune.overlap=1", "eval.finetune.overlap"),
                            ("finetune.lrs_unet=[0.001, 0]", "finetune.lrs_unet"),
                            ("registry.champion_metric=ft_ap_gain_b16", "registry.champion_metric")):
        with pytest.raises(SFMError, match=named):
            JobConfig.from_toml(None, [override]).validate()
    JobConfig.from_toml(None, ["registry.champion_metric=ft_ap_gain_b4", "finetune.head=unetr"]).validate()


def test_the_evaluations_recipe_is_a_nested_table_and_configs_written_before_read_as_they_meant(tmp_path):
    """``[eval.finetune]`` is a FinetuneConfig: set by key or whole, written to TOML and read back alike; the keys
    the recipe had before it (a registered version's record, a user's file) are read as their new names."""
    from sfm.config import JobConfig

    path = tmp_path / "job.toml"
    path.write_text("[eval]\nbudgets = [1]\n[eval.finetune]\nsteps = 7\nlrs = [0.01]\n")
    cfg = JobConfig.from_toml(path, ["eval.finetune.mirror=true"])
    assert (cfg.eval.finetune.steps, cfg.eval.finetune.lrs, cfg.eval.finetune.mirror) == (7, (0.01,), True)
    assert cfg.finetune.steps == 0 and cfg.finetune.lrs == (1e-3, 3e-3)  # the fine-tune flow's own recipe
    assert (cfg.finetune.head, cfg.eval.finetune.head) == ("unetr", "linear")  # a model's voxels; an encoder's tokens
    assert JobConfig.from_dict(tomllib.loads(cfg.to_toml())).to_dict() == cfg.to_dict()
    with pytest.raises(SFMError, match=r"'eval.finetune' is a table"):
        cfg.set("eval.finetune", 3)
    with pytest.raises(SFMError, match=r"unknown config key 'eval.finetune.stepz'; valid keys in \[eval.finetune\]"):
        cfg.set("eval.finetune.stepz", 3)
    old = JobConfig.from_dict({"eval": {"finetune_steps": 150, "finetune_lr": 1e-3, "finetune_lr_random": 0.0,
                                        "test_augment": True, "validate_every": 10},
                               "finetune": {"lr": 3e-3, "lr_random": 1e-2, "test_augment": False}})
    e, f = old.eval.finetune, old.finetune
    assert (e.steps, e.lrs, e.lrs_random, e.mirror, e.validate_every) == (150, (1e-3,), (1e-3,), True, 10)
    assert (f.lrs, f.lrs_random, f.mirror) == ((3e-3,), (1e-2,), False)


def test_deepspeed_strategies_refuse_muon_context_parallelism_and_a_missing_extra(monkeypatch):
    """Refused at the flow's start, in one line each: Muon (ZeRO's optimiser sees flat partitions, and
    DeepSpeed's own Muon is not the project's), cp > 1, and DeepSpeed not installed."""
    import sys

    for strategy in ("deepspeed-zero2", "deepspeed-zero3"):
        assert resolved({}, strategy=strategy, nodes=2).dist.strategy == strategy
        with pytest.raises(SFMError, match=f"train.optimizer = muon .* which {strategy}'s shards do not hold"):
            resolved({"train": {"optimizer": "muon"}}, strategy=strategy, procs_per_node=2)
        with pytest.raises(SFMError, match=f"dist.cp = 2 runs with dist.strategy = ddp .*; {strategy} with context"):
            resolved({}, strategy=strategy, procs_per_node=2, cp=2)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if the extra were not installed
    with pytest.raises(SFMError, match=r"^dist.strategy = deepspeed-zero3 needs DeepSpeed: pip install 'sfm\[deepspeed\]'"):
        resolved({}, strategy="deepspeed-zero3", procs_per_node=2)
    resolved({}, strategy="deepspeed-zero3")  # one process trains without it


def test_the_process_group_backend_is_the_configured_one_or_follows_the_device():
    """``dist.backend = auto`` (the default): nccl on CUDA, gloo on CPU, for the trainer and the fine-tune ranks
    alike; a named backend is used as it is."""
    from sfm.config import JobConfig

    auto = JobConfig.from_toml(None, []).dist
    assert (auto.backend_for(cuda=True), auto.backend_for(cuda=False)) == ("nccl", "gloo")
    named = JobConfig.from_toml(None, ["dist.backend=gloo"]).dist
    assert (named.backend_for(cuda=True), named.backend_for(cuda=False)) == ("gloo", "gloo")
