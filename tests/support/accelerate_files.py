"""Accelerate config files written by Accelerate itself (``ClusterConfig.to_yaml_file``, what ``accelerate
config`` ends with), DeepSpeed JSON files, and the environment ``accelerate launch`` gives its processes
(its own argument parsing and environment preparation, without starting anything)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

with warnings.catch_warnings():  # accelerate.commands imports PyYAML's old _yaml location, which warns
    warnings.simplefilter("ignore", DeprecationWarning)
    from accelerate.commands import launch as accelerate_launch
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

# what `accelerate config` writes for a local machine besides the distributed type and its section
COMMON = dict(compute_environment="LOCAL_MACHINE", num_processes=2, machine_rank=0, num_machines=1,
              mixed_precision="no", main_training_function="main", rdzv_backend="static", same_network=True,
              debug=False, downcast_bf16=False, enable_cpu_affinity=False, gpu_ids="all", use_cpu=False)
FSDP2 = {"fsdp_version": 2, "fsdp_reshard_after_forward": True, "fsdp_offload_params": False,
         "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "Block",
         "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True,
         "fsdp_activation_checkpointing": False}
ZERO2 = {"zero_stage": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
         "offload_optimizer_device": "none", "offload_param_device": "none", "zero3_init_flag": False}


def write_config(path: Path, distributed_type: str = "MULTI_GPU", **settings: Any) -> str:
    """An Accelerate config file at ``path`` (YAML; JSON when it ends in .json) as Accelerate writes it:
    ``COMMON`` with ``settings`` on top (a None value leaves the key out, as ``accelerate config`` does for
    mixed precision beside a DeepSpeed JSON)."""
    merged = {**COMMON, "distributed_type": distributed_type, **settings}
    config = ClusterConfig(**{k: v for k, v in merged.items() if v is not None or k == "mixed_precision"})
    if path.suffix == ".json":
        config.to_json_file(str(path))
    else:
        config.to_yaml_file(str(path))
    return str(path)


def write_json(path: Path, content: dict[str, Any]) -> str:
    path.write_text(json.dumps(content, indent=1))
    return str(path)


def launch_environment(*launch_args: str) -> dict[str, str]:
    """The ``ACCELERATE_*`` / ``FSDP_*`` variables ``accelerate launch LAUNCH_ARGS -m sfm.train.trainer
    job.json`` sets for its processes, by Accelerate's own code (accelerate.commands.launch), whatever
    default config this machine has."""
    from unittest import mock

    launch = accelerate_launch
    args = launch.launch_command_parser().parse_args([*launch_args, "-m", "sfm.train.trainer", "job.json"])
    with mock.patch.object(launch, "default_config_file", "/nonexistent/default_config.yaml"):  # this machine's
        args, defaults, precision_from_config = launch._validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate.commands.launch.launch_command does before its DeepSpeed launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if precision_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        env = prepare_deepspeed_cmd_env(args)[1]
    else:
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


def launch_arguments(command: list[str]) -> Any:
    """Accelerate's reading of the ``accelerate launch`` arguments of a node's command (what it passes to torchrun)."""
    start = command.index("accelerate") + 1  # after sfm.distributed.rank_launcher
    args, _, _ = accelerate_launch._validate_launch_command(accelerate_launch.launch_command_parser().parse_args(
        command[start:]))
    if args.multi_gpu:
        args.environment = prepare_multi_gpu_env(args)
    return args
