"""Accelerate as the launcher (``[dist] launcher = "accelerate"``): the config sfm starts a node's processes
with, and the check a process started by ``accelerate launch`` makes of its environment.

:func:`sfm.distributed.launch.node_command` runs ``accelerate launch --config_file <launch_config> --max_restarts 0
-m sfm.train.trainer JOB.json`` on every node (in :mod:`sfm.distributed.rank_launcher`): Accelerate's multi-process
launch (torchrun in-process) with this node's rank and the rendezvous written in the file, so a node's
``~/.cache/huggingface/accelerate/default_config.yaml`` never changes the launch. The trainer creates its
``Accelerator`` as under torchrun (gloo ranks on CPU with ``cpu=True``).

Someone may also run ``accelerate launch [their flags or config] -m sfm.train.trainer JOB.json`` by hand.
Accelerate then tells the processes its settings through ``ACCELERATE_*`` / ``FSDP_*`` variables, which
the trainer does not act on (it applies the job's strategy and precision): :func:`check_environment` reads
them back into an Accelerate config and maps it through :mod:`sfm.distributed.accelerate_config`; a value
that disagrees with the job is refused in one line naming the variable.
"""

from __future__ import annotations

from typing import Any, MutableMapping

from sfm.config import JobConfig, TrainConfig
from sfm.distributed.accelerate_config import map_config, settle
from sfm.distributed.job import NodeLaunch
from sfm.errors import SFMError

# the variable accelerate launch sets for an Accelerate config key (as its plugins read it)
ENVIRONMENT = {
    "mixed_precision": "ACCELERATE_MIXED_PRECISION", "debug": "ACCELERATE_DEBUG_MODE",
    "enable_cpu_affinity": "ACCELERATE_CPU_AFFINITY", "use_cpu": "ACCELERATE_USE_CPU",
    "dynamo_config.dynamo_backend": "ACCELERATE_DYNAMO_BACKEND",
    "fsdp_config.fsdp_version": "FSDP_VERSION",
    "fsdp_config.fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_config.fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_config.fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
    "fsdp_config.fsdp_auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "fsdp_config.fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "fsdp_config.fsdp_state_dict_type": "FSDP_STATE_DICT_TYPE",
    "deepspeed_config.zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "deepspeed_config.gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "deepspeed_config.gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "deepspeed_config.offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "deepspeed_config.offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "deepspeed_config.zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "deepspeed_config.zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config.deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "deepspeed_config.deepspeed_moe_layer_cls_names": "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
}
# Accelerate's plugin switches and the distributed type each stands for; removed once checked
SWITCHES = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DEEPSPEED",
            "ACCELERATE_USE_MEGATRON_LM": "MEGATRON_LM"}
WHERE = "the accelerate launch environment"


def precision_of(train: TrainConfig, cuda: bool) -> str:
    """The mixed precision a training process runs with: ``train.mixed_precision``, ``auto`` resolved
    (bf16 on CUDA, no on CPU)."""
    if train.mixed_precision != "auto":
        return train.mixed_precision
    return "bf16" if cuda else "no"


def launch_config(launch: NodeLaunch, precision: str) -> dict[str, Any]:
    """The Accelerate config sfm starts a node with: its place in the job, the job's ``precision``, plain
    processes (``MULTI_GPU``: one process per GPU, or gloo ranks on CPU; ``NO`` for a one-process job).
    No plugin: the trainer applies the strategy."""
    world = launch.nodes * launch.procs_per_node
    return {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU" if world > 1 else "NO",
            "mixed_precision": precision, "use_cpu": False, "debug": False, "num_machines": launch.nodes,
            "num_processes": world, "machine_rank": launch.node_rank, "main_process_ip": launch.main_addr,
            "main_process_port": launch.main_port, "rdzv_backend": "static", "same_network": True,
            "gpu_ids": "all", "enable_cpu_affinity": False, "dynamo_config": {}}


def check_environment(cfg: JobConfig, environ: MutableMapping[str, str], *, cuda: bool, precision: str) -> None:
    """In a training process, before its Accelerator: what its ``accelerate launch`` environment stands
    for (:func:`environment_config`) must be the job's settings as the process runs them (``precision``
    resolved, on CUDA or not), or SFMError in one line naming the variable. Accelerate's plugin switches
    are then removed from ``environ``: the trainer applies the strategy itself."""
    if not any(name in environ for name in (*ENVIRONMENT.values(), *SWITCHES)):
        return  # not started by accelerate launch
    conf = environment_config(environ)
    if cuda and str(conf.get("use_cpu", "")).lower() in ("true", "1"):
        raise SFMError(f"{WHERE}: ACCELERATE_USE_CPU={conf['use_cpu']}, but the trainer trains on this node's "
                       "GPUs; launch without --cpu (use_cpu: false)")
    switch = next((name for name, kind in SWITCHES.items() if kind == conf["distributed_type"]), "distributed_type")
    mapped = map_config(conf, WHERE, names={**ENVIRONMENT, "distributed_type": switch})
    settle(cfg, mapped, WHERE, running={"train.mixed_precision": precision})
    for name in SWITCHES:
        environ.pop(name, None)


def environment_config(environ: MutableMapping[str, str]) -> dict[str, Any]:
    """The Accelerate config an ``accelerate launch`` environment stands for (its :data:`ENVIRONMENT`
    and :data:`SWITCHES` variables, with Accelerate's defaults). Without a plugin switch the distributed
    type says nothing of the strategy (``NO``): sfm's own launch is plain MULTI_GPU whatever the job's."""
    conf: dict[str, Any] = {}
    for key, name in ENVIRONMENT.items():
        if name in environ:
            section, _, sub = key.rpartition(".")
            (conf.setdefault(section, {}) if section else conf)[sub] = environ[name]
    kinds = [kind for name, kind in SWITCHES.items() if environ.get(name, "").lower() in ("true", "1")]
    conf["distributed_type"] = kinds[0] if kinds else "NO"
    if "FSDP" in kinds:
        conf.setdefault("fsdp_config", {}).setdefault("fsdp_version", "1")  # Accelerate's, without FSDP_VERSION
    else:
        conf.pop("fsdp_config", None)  # FSDP_* without the switch mean nothing to Accelerate
    if "DEEPSPEED" not in kinds:
        conf.pop("deepspeed_config", None)
    elif conf.get("deepspeed_config", {}).get("deepspeed_config_file"):
        conf.pop("mixed_precision", None)  # the DeepSpeed JSON says it; Accelerate sets the variable regardless
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true":
        conf["parallelism_config"] = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true"}
    return conf
