"""A user's Accelerate config file mapped onto the job, or refused in one line.

sfm applies its strategies and precision itself (the trainer never calls ``Accelerator.prepare``), so an
Accelerate setting either maps onto a job setting or is refused; none is dropped, as Accelerate itself
would drop some on CPU (its FSDP and DeepSpeed plugins become DDP there). sfm never hands the user's file
to ``accelerate launch``: the job carries the mapped settings, and each node is launched with a config of
sfm's own (:mod:`sfm.distributed.accelerate_launch`), whose processes check their ``ACCELERATE_*``
environment against the job through this same table.

:func:`apply` (at the flow's ``start``, in ``sfm train`` and ``sfm slurm-script``, before anything runs): a
file's setting fills a job setting still at its default; a job setting set to another value (TOML,
``section.key=value``, ``--nodes`` ...) is a conflict, refused naming both.

=========================================================  ===================================================
Accelerate config (YAML or JSON, as ``accelerate config``  sfm
writes it)
=========================================================  ===================================================
``compute_environment: LOCAL_MACHINE``                     required (``AMAZON_SAGEMAKER`` refused)
``distributed_type: NO``                                   one process; the strategy stays the job's
``distributed_type: MULTI_GPU`` / ``MULTI_CPU``            ``dist.strategy = ddp`` (sfm starts the processes:
                                                           MULTI_CPU needs no mpirun)
``distributed_type: FSDP``, ``fsdp_config``:
  ``fsdp_version: 2``                                      required (1 refused)
  ``fsdp_reshard_after_forward: true`` / ``false``         ``dist.strategy = fsdp2-full`` / ``fsdp2-zero2``
  ``fsdp_activation_checkpointing``                        ``train.grad_checkpointing``
  ``fsdp_auto_wrap_policy``, ``..._layer_cls_to_wrap``     ``TRANSFORMER_BASED_WRAP`` of ``Block`` only
  ``fsdp_state_dict_type``                                 ``SHARDED_STATE_DICT`` only (sfm's checkpoints)
  ``fsdp_offload_params: true``, ``fsdp_forward_prefetch:  refused
  true``, v1 keys (``fsdp_backward_prefetch``,
  ``fsdp_sharding_strategy``), any other key
  ``fsdp_cpu_ram_efficient_loading``,                      accepted: every rank builds the same weights from
  ``fsdp_sync_module_states``, ``fsdp_use_orig_params``,   ``data.seed``; the size policy is refused
  ``fsdp_min_num_params``
``distributed_type: DEEPSPEED``, ``deepspeed_config``:
  ``zero_stage: 2`` / ``3`` (absent: 2)                    ``dist.strategy = deepspeed-zero2`` / ``-zero3``
                                                           (0, 1 refused)
  ``gradient_accumulation_steps``                          ``train.grad_accum``
  ``gradient_clipping``                                    ``train.grad_clip``
  ``offload_*_device`` other than ``none``,                refused
  ``zero3_init_flag: true``, ``zero3_save_16bit_model:
  true``, ``deepspeed_multinode_launcher`` other than
  ``standard``, hostfile, filters, MoE classes
  ``deepspeed_config_file`` (relative: to the YAML's        the JSON below; as in Accelerate, no
  folder)                                                  ``mixed_precision`` and none of the keys above
                                                           beside it
DeepSpeed JSON ``train_micro_batch_size_per_gpu``          ``data.batch_size``
  ``gradient_accumulation_steps``, ``gradient_clipping``   ``train.grad_accum``, ``train.grad_clip``
  ``train_batch_size``                                     must be data.batch_size x grad_accum x dp (or,
                                                           without the micro batch, gives data.batch_size)
  ``zero_optimization.stage`` (absent: 0, refused)         as ``zero_stage``
  ``zero_optimization.offload_*.device``                   ``none`` only
  ``bf16.enabled`` (no ``bf16``/``fp16``: fp32)            ``train.mixed_precision = bf16`` / ``no``
  ``fp16.enabled: true``, ``optimizer``, ``scheduler``     refused (the job's ``train`` builds the optimiser
  (a client optimiser overrides them), other keys          and schedule; sfm sizes DeepSpeed's buckets)
  ``"auto"``                                               the job's value
``mixed_precision: no`` / ``bf16`` (absent: ``no``)        ``train.mixed_precision = no`` / ``bf16``
                                                           (``fp16``, ``fp8`` refused)
``num_machines`` (absent: 1)                               ``dist.nodes``
``num_processes`` (over all machines)                      ``dist.procs_per_node`` = num_processes /
                                                           num_machines (must divide)
``machine_rank``, ``main_process_ip``,                     not read: each node's rank and rendezvous come
``main_process_port``, ``rdzv_backend``, ``same_network``,  from where it runs (the flow's ``@parallel``, the
``main_training_function``                                 Slurm allocation, ``sfm train`` flags)
``use_cpu: true``                                          refused with ``[cluster] gpu > 0``
``gpu_ids``                                                ``all`` only
``dynamo_config.dynamo_backend``                           ``NO`` only (sfm compiles: ``train.compile``)
``debug``, ``enable_cpu_affinity``, ``downcast_bf16``,     ``false`` / empty only
TPU keys, ``fp8_config``, ``parallelism_config`` (sfm's
is ``dist.cp``), ``megatron_lm_config``,
``mpirun_config``
=========================================================  ===================================================
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, NoReturn

from sfm import storage
from sfm.config import JobConfig
from sfm.errors import SFMError

PRECISIONS = ("no", "bf16")  # Accelerate's mixed_precision values sfm trains with (train.mixed_precision)
RESHARD = {True: "fsdp2-full", False: "fsdp2-zero2"}  # fsdp_reshard_after_forward -> dist.strategy
ZERO = {2: "deepspeed-zero2", 3: "deepspeed-zero3"}  # zero_stage -> dist.strategy
NOT_READ = ("machine_rank", "main_process_ip", "main_process_port", "rdzv_backend", "same_network",
            "main_training_function", "use_cpu")
OFF = ("debug", "enable_cpu_affinity", "downcast_bf16", "tpu_use_cluster", "tpu_use_sudo")
EMPTY = ("fp8_config", "parallelism_config", "megatron_lm_config", "mpirun_config", "tpu_name", "tpu_zone",
         "command_file", "commands", "tpu_vm", "tpu_env")
READ = ("compute_environment", "distributed_type", "mixed_precision", "num_machines", "num_processes", "gpu_ids",
        "dynamo_config", "fsdp_config", "deepspeed_config")
FSDP_KEYS = ("fsdp_version", "fsdp_reshard_after_forward", "fsdp_activation_checkpointing", "fsdp_auto_wrap_policy",
             "fsdp_transformer_layer_cls_to_wrap", "fsdp_state_dict_type", "fsdp_offload_params",
             "fsdp_forward_prefetch", "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states",
             "fsdp_use_orig_params", "fsdp_min_num_params")
# what Accelerate refuses beside deepspeed_config_file (DeepSpeedPlugin._deepspeed_config_checks)
DS_INLINE = ("zero_stage", "gradient_accumulation_steps", "gradient_clipping", "offload_optimizer_device",
             "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path", "zero3_save_16bit_model")
DS_KEYS = (*DS_INLINE, "deepspeed_config_file", "zero3_init_flag", "deepspeed_multinode_launcher",
           "deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter",
           "deepspeed_moe_layer_cls_names")
# DeepSpeed JSON keys that change nothing sfm runs (printing, a permission for client optimisers)
DS_JSON_INERT = ("steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer")

@dataclass(frozen=True)
class Setting:
    """One job setting an Accelerate config gives: ``key`` (e.g. ``dist.strategy``) = ``value``, from
    ``source`` (the Accelerate key or variable and its value, as written)."""

    key: str
    value: Any
    source: str


@dataclass
class Mapped:
    """What an Accelerate config says about the job: its settings, and a DeepSpeed ``train_batch_size``
    (checked, or turned into ``data.batch_size``, once the job's world is known)."""

    settings: list[Setting] = field(default_factory=list)
    global_batch: Setting | None = None


# ---- a user's config file ---------------------------------------------------------------------------


def apply(cfg: JobConfig) -> list[Setting]:
    """Map the Accelerate config file ``cfg.dist.accelerate_config`` (if any) onto ``cfg``: each of its
    settings fills a job setting still at its default, agrees with it, or is refused (SFMError, one line
    naming the file, the key and the job setting). Returns the settings, after printing them."""
    url = cfg.dist.accelerate_config
    if not url:
        return []
    url = storage.normalize(url)
    conf = read_config(url)
    if conf.get("use_cpu") is True and cfg.cluster.gpu > 0:
        raise SFMError(f"{url}: use_cpu: true, but the job asks for {cfg.cluster.gpu} GPUs per node "
                       "([cluster] gpu); set use_cpu: false or [cluster] gpu = 0")
    mapped = map_config(_with_accelerate_defaults(conf), url, folder=url.rsplit("/", 1)[0])
    settings = settle(cfg, mapped, url)
    print(f"sfm: Accelerate config {url}: " + ("; ".join(f"{s.key} = {s.value!r} ({s.source})" for s in settings)
                                                or "nothing to map"), file=sys.stderr)
    return settings


def map_config(conf: dict[str, Any], where: str, *, folder: str = "", names: dict[str, str] | None = None) -> Mapped:
    """What the Accelerate config ``conf`` says about the job (the table above), or SFMError naming the key
    and ``where`` it is. ``folder``: where a relative ``deepspeed_config_file`` lies (default: the working
    directory); ``names``: what to call each key in messages (e.g. the variable it came from)."""
    return _Mapper(where, folder, names).map(conf)


def settle(cfg: JobConfig, mapped: Mapped, where: str, running: dict[str, Any] | None = None) -> list[Setting]:
    """Bring ``mapped`` onto ``cfg``: a setting agrees with the job's, or fills it where the job leaves its
    default; any other value is refused. With ``running`` (a launched process: the job's values as it runs,
    by key, over ``cfg``'s), every setting must agree. Returns the settings, with what
    ``train_batch_size`` gave."""
    defaults = JobConfig()
    for s in mapped.settings:
        current = (running or {}).get(s.key, _get(cfg, s.key))
        if current != s.value:
            if running is not None or current != _get(defaults, s.key):
                raise SFMError(f"{where}: {s.source} means {s.key} = {s.value!r}, but the job has {s.key} = "
                               f"{current!r}; make them agree (or leave the job's setting at its default)")
            cfg.set(s.key, s.value)
    micro = any(s.key == "data.batch_size" for s in mapped.settings)
    return mapped.settings + _global_batch(cfg, mapped.global_batch, where, fill=running is None and not micro)


def read_config(url: str) -> dict[str, Any]:
    """An Accelerate config file (YAML, or JSON when it ends in .json), local or s3://, as a dict."""
    import yaml

    if not storage.exists(url):
        raise SFMError(f"Accelerate config {url} does not exist; pass the file `accelerate config` wrote "
                       "(e.g. ~/.cache/huggingface/accelerate/default_config.yaml)")
    text = storage.read_bytes(url).decode()
    try:
        conf = json.loads(text) if url.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        raise SFMError(f"Accelerate config {url} is not valid {'JSON' if url.endswith('.json') else 'YAML'} "
                       f"({str(err).splitlines()[0]}); fix its syntax") from err
    if not isinstance(conf, dict):
        raise SFMError(f"Accelerate config {url} holds no settings (a YAML mapping); write it with `accelerate config`")
    return conf


def _with_accelerate_defaults(conf: dict[str, Any]) -> dict[str, Any]:
    """What Accelerate reads a file as (ClusterConfig.process_config, accelerate launch): the old ``fp16``
    and ``dynamo_backend`` keys in their new places, mixed precision ``no`` unless a DeepSpeed JSON sets
    it, one machine unless it says more."""
    conf = dict(conf)
    if "fp16" in conf:
        conf.setdefault("mixed_precision", "fp16" if conf.pop("fp16") else None)
    if "dynamo_backend" in conf:
        conf["dynamo_config"] = {"dynamo_backend": conf.pop("dynamo_backend")}
    ds_file = (conf.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if conf.get("mixed_precision") is None and not ds_file:
        conf["mixed_precision"] = "no"
    conf.setdefault("num_machines", 1)
    return conf


def _get(cfg: JobConfig, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


def _global_batch(cfg: JobConfig, tbs: Setting | None, where: str, *, fill: bool) -> list[Setting]:
    """DeepSpeed's ``train_batch_size`` against the job: data.batch_size x train.grad_accum x dp. With
    ``fill`` (a file without a micro batch) it gives a data.batch_size still at its default instead;
    returns what it set."""
    if tbs is None:
        return []
    d = cfg.dist
    dp = max(1, d.nodes * d.procs_per_node // max(1, d.cp))
    per_rank, rest = divmod(tbs.value, cfg.train.grad_accum * dp)
    if fill and cfg.data.batch_size == JobConfig().data.batch_size and not rest and per_rank >= 1:
        cfg.set("data.batch_size", per_rank)
        return [Setting("data.batch_size", per_rank, tbs.source)]
    if cfg.data.batch_size * cfg.train.grad_accum * dp != tbs.value:
        raise SFMError(f"{where}: {tbs.source} must equal data.batch_size x train.grad_accum x data-parallel ranks, "
                       f"but the job has {cfg.data.batch_size} x {cfg.train.grad_accum} x {dp} = "
                       f"{cfg.data.batch_size * cfg.train.grad_accum * dp}; make them agree (or write \"auto\")")
    return []


# ---- the mapping -----------------------------------------------------------------------------------


class _Mapper:
    """One config (a file's, or the one an environment stands for) through the table of the module
    docstring. ``names``: what to call a key in messages (the environment's variables)."""

    def __init__(self, where: str, folder: str = "", names: dict[str, str] | None = None):
        self.where, self.folder, self.names = where, folder, names or {}
        self.out = Mapped()

    # ---- naming, refusing, setting
    def source(self, key: str, value: Any) -> str:
        name = self.names.get(key)
        return f"{name}={value}" if name else f"{key}: {json.dumps(value, default=str)}"

    def refuse(self, key: str, value: Any, why: str) -> NoReturn:
        raise SFMError(f"{self.where}: {self.source(key, value)} {why}")

    def set(self, job_key: str, value: Any, key: str, raw: Any) -> None:
        self.out.settings.append(Setting(job_key, value, self.source(key, raw)))

    def unknown(self, section: dict[str, Any], prefix: str, known: tuple[str, ...], why: str) -> None:
        for key, value in section.items():
            if key not in known:
                self.refuse(prefix + key, value, why)

    def number(self, key: str, value: Any, kind: type, low: float) -> int | float:
        """``value`` as an int or float of at least ``low``, or refused."""
        try:
            number = kind(value)
            if isinstance(value, bool) or isinstance(value, float) and kind is int or number < low:
                raise ValueError
        except (TypeError, ValueError):
            self.refuse(key, value, f"is not {'an integer' if kind is int else 'a number'} of at least {low}")
        return number

    def flag(self, key: str, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "false", "1", "0"):
            return str(value).lower() in ("true", "1")
        self.refuse(key, value, "is not true or false")

    def off(self, key: str, value: Any, why: str) -> None:
        """Refused unless absent or false."""
        if value is not None and self.flag(key, value):
            self.refuse(key, value, why)

    def only(self, key: str, value: Any, allowed: tuple[Any, ...], why: str) -> None:
        """Refused unless absent or one of ``allowed``."""
        if value is not None and value not in allowed:
            self.refuse(key, value, why)

    # ---- the table
    def map(self, conf: dict[str, Any]) -> Mapped:
        self.unknown(conf, "", READ + NOT_READ + OFF + EMPTY, "is not an Accelerate config key sfm knows; remove it")
        self.only("compute_environment", conf.get("compute_environment"), ("LOCAL_MACHINE",),
                  "launches on SageMaker's own jobs; sfm launches the nodes itself: use LOCAL_MACHINE")
        for key in OFF:
            self.off(key, conf.get(key), "is not honoured by sfm's launch; set it to false")
        for key in EMPTY:
            if conf.get(key):
                self.refuse(key, conf[key], "is not honoured by sfm (context parallelism is [dist] cp); remove it")
        self.only("gpu_ids", conf.get("gpu_ids"), ("all",), "is not honoured: sfm runs one process per visible "
                  "GPU; use all (and CUDA_VISIBLE_DEVICES on the node)")
        self.only("dynamo_config.dynamo_backend", (conf.get("dynamo_config") or {}).get("dynamo_backend"),
                  ("NO", "no"), "is not honoured: sfm compiles the blocks itself; use NO and train.compile = true")
        if (conf.get("deepspeed_config") or {}).get("deepspeed_config_file") and conf.get("mixed_precision"):
            self.refuse("mixed_precision", conf["mixed_precision"], "is ignored by Accelerate beside "
                        "deepspeed_config_file; put it in the DeepSpeed JSON (bf16.enabled)")
        self.precision(conf)
        self.counts(conf)
        self.distributed(conf)
        return self.out

    def precision(self, conf: dict[str, Any]) -> None:
        value = conf.get("mixed_precision")
        if value is None:
            return
        if str(value) not in PRECISIONS:
            self.refuse("mixed_precision", value, "is not a precision sfm trains in; use bf16 or no")
        self.set("train.mixed_precision", str(value), "mixed_precision", value)

    def counts(self, conf: dict[str, Any]) -> None:
        if "num_machines" not in conf:
            return
        machines = self.number("num_machines", conf["num_machines"], int, 1)
        self.set("dist.nodes", machines, "num_machines", conf["num_machines"])
        total = conf.get("num_processes", -1)
        if total in (-1, None):  # accelerate launch needs it on its command line then; the job decides here
            return
        total = self.number("num_processes", total, int, 1)
        if total % machines:
            self.refuse("num_processes", total, f"(over all machines) does not divide by num_machines: {machines}")
        self.set("dist.procs_per_node", total // machines, "num_processes", conf["num_processes"])

    def distributed(self, conf: dict[str, Any]) -> None:
        kind = conf.get("distributed_type")
        fsdp, ds = conf.get("fsdp_config") or {}, conf.get("deepspeed_config") or {}
        if kind in ("MULTI_GPU", "MULTI_CPU"):
            self.set("dist.strategy", "ddp", "distributed_type", kind)
        elif kind == "FSDP":
            self.fsdp(fsdp)
        elif kind == "DEEPSPEED":
            self.deepspeed(ds)
        elif kind is None:
            self.refuse("distributed_type", kind, "is missing; write the config with `accelerate config`")
        elif kind != "NO":
            self.refuse("distributed_type", kind, "is not launched by sfm; use NO, MULTI_GPU, MULTI_CPU, FSDP "
                        "(version 2) or DEEPSPEED (ZeRO stage 2 or 3)")
        for key, section, used in (("fsdp_config", fsdp, "FSDP"), ("deepspeed_config", ds, "DEEPSPEED")):
            if section and kind != used:
                self.refuse(key, section, f"is read only with distributed_type: {used}; remove it")

    def fsdp(self, fsdp: dict[str, Any]) -> None:
        p = "fsdp_config."
        self.unknown(fsdp, p, FSDP_KEYS, "is not honoured by sfm's FSDP2 (it shards each transformer Block "
                     "itself); remove it")
        version = fsdp.get("fsdp_version", 1)
        if self.number(p + "fsdp_version", version, int, 1) != 2:
            self.refuse(p + "fsdp_version", version, "is FSDP1, which sfm does not run; use fsdp_version: 2")
        reshard = fsdp.get("fsdp_reshard_after_forward", True)
        self.set("dist.strategy", RESHARD[self.flag(p + "fsdp_reshard_after_forward", reshard)],
                 p + "fsdp_reshard_after_forward", reshard)
        if fsdp.get("fsdp_activation_checkpointing") is not None:
            value = fsdp["fsdp_activation_checkpointing"]
            self.set("train.grad_checkpointing", self.flag(p + "fsdp_activation_checkpointing", value),
                     p + "fsdp_activation_checkpointing", value)
        self.off(p + "fsdp_offload_params", fsdp.get("fsdp_offload_params"),
                 "is not honoured: sfm keeps parameters on the device; set it to false")
        self.off(p + "fsdp_forward_prefetch", fsdp.get("fsdp_forward_prefetch"),
                 "is an FSDP1 setting sfm does not run; set it to false")
        self.only(p + "fsdp_auto_wrap_policy", fsdp.get("fsdp_auto_wrap_policy"), ("TRANSFORMER_BASED_WRAP",),
                  "is not honoured: sfm shards each transformer Block; use TRANSFORMER_BASED_WRAP")
        self.only(p + "fsdp_state_dict_type", fsdp.get("fsdp_state_dict_type"), ("SHARDED_STATE_DICT",),
                  "is not honoured: sfm's FSDP2 checkpoints are sharded and its exported model full; use "
                  "SHARDED_STATE_DICT")
        from sfm.model.blocks import Block

        classes = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
        if classes is not None and {c.strip() for c in str(classes).split(",")} != {Block.__name__}:
            self.refuse(p + "fsdp_transformer_layer_cls_to_wrap", classes,
                        f"names classes sfm's model lacks; its transformer layer is {Block.__name__}")

    def deepspeed(self, ds: dict[str, Any]) -> None:
        p = "deepspeed_config."
        self.unknown(ds, p, DS_KEYS, "is not honoured by sfm's DeepSpeed strategies; remove it")
        self.off(p + "zero3_init_flag", ds.get("zero3_init_flag"), "is not honoured: sfm builds the model whole on "
                 "each rank, then DeepSpeed partitions it; set it to false")
        self.off(p + "zero3_save_16bit_model", ds.get("zero3_save_16bit_model"),
                 "is not honoured: sfm exports float32 safetensors; set it to false")
        self.only(p + "deepspeed_multinode_launcher", ds.get("deepspeed_multinode_launcher"), ("standard",),
                  "is not how sfm starts nodes (each node runs its own launcher); use standard")
        for key in ("deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter",
                    "deepspeed_moe_layer_cls_names"):
            if ds.get(key):
                self.refuse(p + key, ds[key], "is not honoured by sfm; remove it")
        for key in ("offload_optimizer_device", "offload_param_device"):
            if str(ds.get(key) or "none").lower() != "none":
                self.refuse(p + key, ds[key], "is not honoured: sfm keeps DeepSpeed's state on the device; use none")
        ds_file = ds.get("deepspeed_config_file")
        if ds_file:
            self.deepspeed_file(ds, ds_file)
            return
        stage = ds.get("zero_stage", 2)
        self.zero_stage(p + "zero_stage", stage)
        for key, job_key, kind, low in (("gradient_accumulation_steps", "train.grad_accum", int, 1),
                                        ("gradient_clipping", "train.grad_clip", float, 0)):
            if ds.get(key) not in (None, "auto"):
                self.set(job_key, self.number(p + key, ds[key], kind, low), p + key, ds[key])

    def zero_stage(self, key: str, stage: Any) -> None:
        number = self.number(key, stage, int, 0)
        if number not in ZERO:
            self.refuse(key, stage, "is not a ZeRO stage sfm runs; use 2 (deepspeed-zero2) or 3 (deepspeed-zero3)")
        self.set("dist.strategy", ZERO[number], key, stage)

    def deepspeed_file(self, ds: dict[str, Any], ds_file: str) -> None:
        """``deepspeed_config_file``: as Accelerate, nothing it would ignore beside it; then the JSON."""
        for key in DS_INLINE:
            if key in ds:
                self.refuse("deepspeed_config." + key, ds[key], "is ignored by Accelerate beside "
                            "deepspeed_config_file; put it in the DeepSpeed JSON")
        url = ds_file if storage.is_s3(ds_file) or ds_file.startswith("/") or not self.folder else \
            storage.join(self.folder, ds_file)
        if not storage.exists(url):
            self.refuse("deepspeed_config.deepspeed_config_file", ds_file, f"does not exist ({url}); name the "
                        "DeepSpeed JSON (relative paths: from the Accelerate config's folder)")
        try:
            conf = json.loads(storage.read_bytes(url))
        except ValueError as err:
            self.refuse("deepspeed_config.deepspeed_config_file", ds_file, f"is not valid JSON ({err}); fix it")
        _JsonMapper(self, url).map(conf)


class _JsonMapper:
    """A DeepSpeed JSON config (``deepspeed_config_file``) through the table; settings go to ``parent``."""

    def __init__(self, parent: _Mapper, url: str):
        self.parent, self.url = parent, url
        self.where = f"{url} (the deepspeed_config_file of {parent.where})"

    def refuse(self, key: str, value: Any, why: str) -> NoReturn:
        raise SFMError(f"{self.where}: {key}: {json.dumps(value, default=str)} {why}")

    def set(self, job_key: str, value: Any, key: str, raw: Any) -> None:
        self.parent.out.settings.append(Setting(job_key, value, f"{self.url}: {key}: {json.dumps(raw)}"))

    def number(self, key: str, value: Any, kind: type, low: float) -> int | float:
        try:
            return self.parent.number(key, value, kind, low)
        except SFMError:
            self.refuse(key, value, f"is not {'an integer' if kind is int else 'a number'} of at least {low}")

    def map(self, conf: Any) -> None:
        if not isinstance(conf, dict):
            self.refuse("(top)", conf, "is not a DeepSpeed config (a JSON object)")
        for key in ("optimizer", "scheduler"):
            if key in conf:
                self.refuse(key, conf[key], "is not honoured: sfm's client optimiser and schedule (train.*) override "
                            "it; remove it")
        known = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
                 "gradient_clipping", "zero_optimization", "bf16", "fp16", *DS_JSON_INERT)
        for key, value in conf.items():
            if key not in known:
                self.refuse(key, value, "is not honoured: sfm builds DeepSpeed's engine settings from the job; "
                            "remove it")
        for key, job_key, kind, low in (("train_micro_batch_size_per_gpu", "data.batch_size", int, 1),
                                        ("gradient_accumulation_steps", "train.grad_accum", int, 1),
                                        ("gradient_clipping", "train.grad_clip", float, 0)):
            if conf.get(key) not in (None, "auto"):
                self.set(job_key, self.number(key, conf[key], kind, low), key, conf[key])
        if conf.get("train_batch_size") not in (None, "auto"):
            tbs = self.number("train_batch_size", conf["train_batch_size"], int, 1)
            self.parent.out.global_batch = Setting("data.batch_size", tbs,
                                                   f"{self.url}: train_batch_size: {conf['train_batch_size']}")
        self.zero(conf.get("zero_optimization") or {})
        self.precision(conf)

    def zero(self, zero: Any) -> None:
        for key, value in zero.items():
            if key in ("offload_optimizer", "offload_param"):
                if str((value or {}).get("device", "none")).lower() != "none":
                    self.refuse(f"zero_optimization.{key}", value, "is not honoured: sfm keeps DeepSpeed's state on "
                                "the device; use device none")
            elif key != "stage":
                self.refuse(f"zero_optimization.{key}", value, "is not honoured: sfm sizes DeepSpeed's buckets and "
                            "thresholds from the model; remove it")
        stage = zero.get("stage", 0)
        number = self.number("zero_optimization.stage", stage, int, 0)
        if number not in ZERO:
            self.refuse("zero_optimization.stage", stage, "is not a ZeRO stage sfm runs; use 2 (deepspeed-zero2) "
                        "or 3 (deepspeed-zero3)")
        self.set("dist.strategy", ZERO[number], "zero_optimization.stage", stage)

    def precision(self, conf: dict[str, Any]) -> None:
        """bf16 or fp32, as DeepSpeed reads the JSON (no bf16 or fp16 section: fp32); "auto": the job's."""
        fp16 = (conf.get("fp16") or {}).get("enabled", False)
        if fp16 not in (False, "auto"):
            self.refuse("fp16.enabled", fp16, "is not a precision sfm trains in; use bf16 or fp32")
        bf16 = (conf.get("bf16") or {}).get("enabled", False)
        if bf16 == "auto":
            return
        if not isinstance(bf16, bool):
            self.refuse("bf16.enabled", bf16, "is not true, false or \"auto\"")
        self.set("train.mixed_precision", "bf16" if bf16 else "no", "bf16.enabled", bf16)
