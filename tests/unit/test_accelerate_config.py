"""An Accelerate config file, as `accelerate config` writes it, maps onto the job where sfm can honour it
(precision, machines, processes per machine, FSDP2, DeepSpeed ZeRO 2/3 with its JSON's batch,
accumulation and clipping) and is refused in one line naming the file and the key otherwise: a conflict
with the job, or what Accelerate would silently turn into something else."""

from __future__ import annotations

import pytest
from support.accelerate_files import FSDP2, ZERO2, write_config, write_json

from sfm.config import JobConfig
from sfm.distributed import accelerate_config
from sfm.errors import SFMError


def mapped(path: str, **job: object) -> JobConfig:
    """The job (defaults, with ``job``'s dotted settings) after the Accelerate config at ``path``."""
    cfg = JobConfig()
    for key, value in job.items():
        cfg.set(key.replace("__", "."), value)
    cfg.set("dist.accelerate_config", path)
    accelerate_config.apply(cfg)
    return cfg


def refusal(path: str, **job: object) -> str:
    with pytest.raises(SFMError) as err:
        mapped(path, **job)
    message = str(err.value)
    assert "\n" not in message and path in message, message
    return message


def test_plain_configs_give_the_size_precision_and_ddp(tmp_path):
    cfg = mapped(write_config(tmp_path / "nodes.yaml", num_machines=2, num_processes=16, mixed_precision="bf16",
                              main_process_ip="10.0.0.1", main_process_port=29500, machine_rank=1))
    assert (cfg.dist.nodes, cfg.dist.procs_per_node, cfg.dist.strategy, cfg.train.mixed_precision) == \
        (2, 8, "ddp", "bf16")
    cpu = mapped(write_config(tmp_path / "cpu.json", "MULTI_CPU", use_cpu=True, num_processes=2))
    assert (cpu.dist.nodes, cpu.dist.procs_per_node, cpu.dist.strategy, cpu.train.mixed_precision) == \
        (1, 2, "ddp", "no")
    one = mapped(write_config(tmp_path / "one.yaml", "NO", num_processes=1), dist__strategy="fsdp2-full")
    assert (one.dist.procs_per_node, one.dist.strategy) == (1, "fsdp2-full")  # NO says nothing of the strategy


def test_fsdp2_maps_to_the_fsdp2_strategies(tmp_path):
    full = mapped(write_config(tmp_path / "full.yaml", "FSDP", fsdp_config=FSDP2))
    assert full.dist.strategy == "fsdp2-full" and full.train.grad_checkpointing is False
    zero2 = mapped(write_config(tmp_path / "zero2.yaml", "FSDP", fsdp_config={
        **FSDP2, "fsdp_reshard_after_forward": False, "fsdp_activation_checkpointing": True}))
    assert zero2.dist.strategy == "fsdp2-zero2" and zero2.train.grad_checkpointing is True


def test_deepspeed_inline_maps_the_stage_accumulation_and_clipping(tmp_path):
    """The mapping's output only: deepspeed-zero2/3 become valid strategies with the DeepSpeed branch."""
    cfg = mapped(write_config(tmp_path / "z3.yaml", "DEEPSPEED", num_processes=4, deepspeed_config={
        **ZERO2, "zero_stage": 3, "gradient_accumulation_steps": 4, "gradient_clipping": 0.5}))
    assert (cfg.dist.strategy, cfg.train.grad_accum, cfg.train.grad_clip, cfg.dist.procs_per_node) == \
        ("deepspeed-zero3", 4, 0.5, 4)
    assert mapped(write_config(tmp_path / "z2.yaml", "DEEPSPEED", deepspeed_config=ZERO2)).dist.strategy == \
        "deepspeed-zero2"


def test_deepspeed_json_maps_batch_accumulation_clipping_and_precision(tmp_path):
    write_json(tmp_path / "ds.json", {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 16,
                                      "gradient_accumulation_steps": 4, "gradient_clipping": 0.25,
                                      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}},
                                      "bf16": {"enabled": True}, "steps_per_print": 1000})
    path = write_config(tmp_path / "ds.yaml", "DEEPSPEED", mixed_precision=None,
                        deepspeed_config={"deepspeed_config_file": "ds.json", "zero3_init_flag": False})
    cfg = mapped(path)  # 2 x 4 x 2 ranks = train_batch_size 16
    assert (cfg.dist.strategy, cfg.data.batch_size, cfg.train.grad_accum, cfg.train.grad_clip,
            cfg.train.mixed_precision) == ("deepspeed-zero2", 2, 4, 0.25, "bf16")
    # "auto" leaves the job's; train_batch_size alone gives the per-rank batch; no bf16 section: fp32
    write_json(tmp_path / "auto.json", {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": 12,
                                        "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 3}})
    auto = mapped(write_config(tmp_path / "auto.yaml", "DEEPSPEED", mixed_precision=None, num_processes=3,
                               deepspeed_config={"deepspeed_config_file": str(tmp_path / "auto.json")}),
                  train__grad_accum=2)
    assert (auto.dist.strategy, auto.data.batch_size, auto.train.grad_accum, auto.train.mixed_precision) == \
        ("deepspeed-zero3", 2, 2, "no")


def test_the_job_keeps_what_it_sets_and_takes_the_rest(tmp_path):
    path = write_config(tmp_path / "fsdp.yaml", "FSDP", num_processes=4, fsdp_config=FSDP2)
    cfg = mapped(path, dist__procs_per_node=4, dist__strategy="fsdp2-full", data__batch_size=2)
    assert (cfg.dist.procs_per_node, cfg.dist.strategy, cfg.data.batch_size) == (4, "fsdp2-full", 2)
    assert mapped("", dist__procs_per_node=3).dist.procs_per_node == 3  # no file: nothing happens


@pytest.mark.parametrize("case", [
    "conflict-nodes", "conflict-strategy", "conflict-precision", "fsdp1", "offload", "size-wrap", "layer-class",
    "full-state-dict", "fp16", "zero1", "ds-offload", "zero3-init", "ds-beside-file", "precision-beside-file",
    "ds-optimizer", "ds-tuning", "ds-batch", "ds-micro-and-global", "ds-fp16", "indivisible", "unknown-key", "xla", "sagemaker",
    "dynamo", "parallelism", "gpu-ids", "debug", "use-cpu-on-gpus", "fsdp-under-ddp", "missing-json"])
def test_what_cannot_be_honoured_is_refused_in_one_line(case, tmp_path):
    yaml = tmp_path / "accel.yaml"
    json_file = tmp_path / "ds.json"
    fsdp = {"distributed_type": "FSDP", "fsdp_config": FSDP2}

    def ds_file(content: dict, **ds: object) -> dict:
        """A config naming ds.json, which will hold ``content``."""
        return {"distributed_type": "DEEPSPEED", "mixed_precision": None, "json": content,
                "deepspeed_config": {"deepspeed_config_file": "ds.json", **ds}}

    settings, job, words = {
        "conflict-nodes": ({"num_machines": 2, "num_processes": 4}, {"dist__nodes": 3},
                           "num_machines: 2 means dist.nodes = 2, but the job has dist.nodes = 3"),
        "conflict-strategy": (fsdp, {"dist__strategy": "fsdp2-zero2"}, "fsdp_config.fsdp_reshard_after_forward: "
                              "true means dist.strategy = 'fsdp2-full', but the job has dist.strategy = 'fsdp2-zero2'"),
        "conflict-precision": ({"mixed_precision": "no"}, {"train__mixed_precision": "bf16"},
                               "mixed_precision: \"no\" means train.mixed_precision = 'no'"),
        "fsdp1": ({**fsdp, "fsdp_config": {**FSDP2, "fsdp_version": 1}}, {}, "fsdp_config.fsdp_version: 1 is FSDP1"),
        "offload": ({**fsdp, "fsdp_config": {**FSDP2, "fsdp_offload_params": True}}, {},
                    "fsdp_config.fsdp_offload_params: true is not honoured"),
        "size-wrap": ({**fsdp, "fsdp_config": {**FSDP2, "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}}, {},
                      "fsdp_auto_wrap_policy: \"SIZE_BASED_WRAP\""),
        "layer-class": ({**fsdp, "fsdp_config": {**FSDP2, "fsdp_transformer_layer_cls_to_wrap": "BertLayer"}}, {},
                        "its transformer layer is Block"),
        "full-state-dict": ({**fsdp, "fsdp_config": {**FSDP2, "fsdp_state_dict_type": "FULL_STATE_DICT"}}, {},
                            "use SHARDED_STATE_DICT"),
        "fp16": ({"mixed_precision": "fp16"}, {}, "mixed_precision: \"fp16\" is not a precision sfm trains in"),
        "zero1": ({"distributed_type": "DEEPSPEED", "deepspeed_config": {**ZERO2, "zero_stage": 1}}, {},
                  "deepspeed_config.zero_stage: 1 is not a ZeRO stage sfm runs"),
        "ds-offload": ({"distributed_type": "DEEPSPEED", "deepspeed_config": {**ZERO2, "offload_optimizer_device":
                                                                              "cpu"}}, {},
                       "deepspeed_config.offload_optimizer_device: \"cpu\" is not honoured"),
        "zero3-init": ({"distributed_type": "DEEPSPEED", "deepspeed_config": {**ZERO2, "zero3_init_flag": True}}, {},
                       "zero3_init_flag: true is not honoured"),
        "ds-beside-file": (ds_file({"zero_optimization": {"stage": 2}}, zero_stage=2), {},
                           "deepspeed_config.zero_stage: 2 is ignored by Accelerate beside deepspeed_config_file"),
        "precision-beside-file": ({**ds_file({"zero_optimization": {"stage": 2}}), "mixed_precision": "bf16"}, {},
                                  "mixed_precision: \"bf16\" is ignored by Accelerate beside deepspeed_config_file"),
        "ds-optimizer": (ds_file({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}), {},
                         "optimizer: {\"type\": \"AdamW\"} is not honoured"),
        "ds-tuning": (ds_file({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}), {},
                      "zero_optimization.stage3_param_persistence_threshold: 0 is not honoured"),
        "ds-batch": (ds_file({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4,
                              "train_batch_size": 32}), {},
                     "train_batch_size: 32 must equal data.batch_size x train.grad_accum x data-parallel ranks, but "
                     "the job has 4 x 1 x 2 = 8"),
        "ds-micro-and-global": (ds_file({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 8,
                                         "train_batch_size": 32}), {}, "train_batch_size: 32 must equal"),
        "ds-fp16": (ds_file({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}), {},
                    "fp16.enabled: true is not a precision sfm trains in"),
        "indivisible": ({"num_machines": 2, "num_processes": 3}, {}, "num_processes: 3 (over all machines) does not "
                        "divide by num_machines: 2"),
        "unknown-key": ({"megatron_lm_config": {"megatron_lm_tp_degree": 2}}, {}, "megatron_lm_config"),
        "xla": ({"distributed_type": "XLA"}, {}, "distributed_type: \"XLA\" is not launched by sfm"),
        "sagemaker": ({"compute_environment": "AMAZON_SAGEMAKER"}, {}, "compute_environment: \"AMAZON_SAGEMAKER\""),
        "dynamo": ({"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, {}, "use NO and train.compile = true"),
        "parallelism": ({**fsdp, "parallelism_config": {"parallelism_config_cp_size": 2}}, {},
                        "context parallelism is [dist] cp"),
        "gpu-ids": ({"gpu_ids": "0,1"}, {}, "gpu_ids: \"0,1\" is not honoured"),
        "debug": ({"debug": True}, {}, "debug: true is not honoured"),
        "use-cpu-on-gpus": ({"use_cpu": True}, {"cluster__gpu": 8}, "use_cpu: true, but the job asks for 8 GPUs"),
        "fsdp-under-ddp": ({"fsdp_config": FSDP2}, {}, "fsdp_config: {"),
        "missing-json": ({"distributed_type": "DEEPSPEED", "mixed_precision": None,
                          "deepspeed_config": {"deepspeed_config_file": "absent.json"}}, {}, "does not exist"),
    }[case]
    if case == "sagemaker":  # not a ClusterConfig: Accelerate writes a SageMakerConfig there
        yaml.write_text("compute_environment: AMAZON_SAGEMAKER\ndistributed_type: DATA_PARALLEL\n")
        path = str(yaml)
    else:
        if "json" in settings:
            write_json(json_file, settings.pop("json"))
        path = write_config(yaml, **settings)
    assert words in refusal(path, **job)


def test_a_missing_or_unreadable_file_is_refused_in_one_line(tmp_path):
    assert "does not exist" in refusal(str(tmp_path / "nope.yaml"))
    (tmp_path / "bad.yaml").write_text("distributed_type: [MULTI_GPU\n")
    assert "is not valid YAML" in refusal(str(tmp_path / "bad.yaml"))
    (tmp_path / "list.yaml").write_text("- MULTI_GPU\n")
    assert "holds no settings" in refusal(str(tmp_path / "list.yaml"))
