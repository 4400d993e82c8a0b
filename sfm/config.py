"""The one typed job configuration: dataclasses filled from TOML plus ``section.key=value`` overrides.

Every run writes its resolved config (``JobConfig.to_dict()``) next to its outputs. Defaults: the demo's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

from sfm.config_downstream import (LABELLED_VOLUME, PREDICT_OUTPUTS, EvalConfig, FinetuneConfig,  # noqa: F401
                                   PredictConfig, RegistryConfig, RetrainConfig, quick_recipe)  # (sfm.config has all)
from sfm.config_values import (AUGMENTATIONS, LAYOUTS, at_least, coerce, field_types, fraction_in, one_of,
                               parse_literal, split_assignments, toml_text)
from sfm.errors import SFMError

DEFAULT_TOML = Path(str(resources.files("sfm") / "default.toml"))  # inside the package, also when installed
CONFIGS_DIR = Path(str(resources.files("sfm") / "configs"))  # example job configs, named by config_file()
DATA_ROOT = "sfm_data"  # the data root of every command and flow that is given none (--data-root)
# data.augment: what sfm.data.crops may apply per crop (the last two: time axis reversed, polarity inverted)
ALIGNMENTS = ("voxel", "brick")  # data.align: crop origins anywhere, or on the store's brick grid
CLIENTS = ("auto", "http", "obstore", "fsspec")  # data.client: how the loader reads S3
BATCH_DTYPES = ("float32", "float16", "int8")  # data.batch_dtype: the crops' value type (int8: stored values)
STRATEGIES = ("ddp", "fsdp2-zero2", "fsdp2-full", "deepspeed-zero2", "deepspeed-zero3")  # dist.strategy (sfm.distributed)
OPTIMIZERS = ("adamw", "muon")  # train.optimizer (see sfm.train.muon)
LAUNCHERS = ("torchrun", "accelerate")  # dist.launcher: what starts a node's processes (sfm.distributed.launch)
# train.trackers: Accelerate's experiment trackers (accelerate.tracking.LOGGER_TYPE_TO_CLASS, sfm.train.trackers),
# each with the modules any one of which it needs installed
TRACKERS = {"tensorboard": ("tensorboard", "tensorboardX"), "mlflow": ("mlflow",), "wandb": ("wandb",),
            "aim": ("aim",), "comet_ml": ("comet_ml",), "clearml": ("clearml",), "dvclive": ("dvclive",),
            "swanlab": ("swanlab",), "trackio": ("trackio",)}
LABEL_IGNORE = 255  # label stores' value of voxels nobody interpreted (uint8: classes 0..254; sfm.ingest.labels)


@dataclass
class IngestConfig:
    """What shapes a survey store (sfm.ingest); the same file with the same settings gives the same bytes."""

    iline_byte: int = 0  # trace-header byte of the inline number; 0 (with xline_byte 0): detect among the common pairs
    xline_byte: int = 0  # of the crossline number
    endian: str = "auto"  # auto | big | little
    chunk: int = 128  # brick edge in voxels (clipped to the survey's shape)
    dtype: str = "float32"  # float32 (lossless) | float16 (standardised) | int8 (quantised); transform recorded
    max_sparsity: float = 10.0  # largest allowed ratio of grid cells to traces
    nonfinite: str = "replace"  # "replace" NaN/inf by 0 and report, or "refuse" the file
    workers: int = 0  # threads; 0: the cores (at most 16), two more when the store is remote (PUTs wait)
    codec: str = "zstd:1"  # Blosc "cname[:clevel]" of the amplitude bricks; lz4 decodes faster (BENCHMARKS.md "Ingest")
    # how the flow splits one survey between tasks (the store's bytes never depend on it): parts > 0 tasks,
    # or 0: one task per part_gb GB of SEG-Y (at least one); each part scans whole 4 GiB pieces of the
    # file and writes whole shard rows, so a survey has at most that many parts of each kind
    parts: int = 0
    part_gb: float = 64.0
    # MDIO sources (read in place, never copied): GB of amplitude chunks the statistics read; a larger
    # store is measured over evenly spaced chunk columns up to this much (the fraction is recorded)
    mdio_stats_gb: float = 4.0
    # "sfm", or "mdio": the same store plus what MDIO 1.1.3's tools read and export (sfm.formats.mdio_layout)
    layout: str = "sfm"
    domain: str = "time"  # the sample axis: time (ms) or depth (m); names it in the mdio layout

    def check(self) -> None:
        """Every setting valid, or SFMError naming it and the fix."""
        codec_settings(self.codec)
        if self.dtype not in INGEST_DTYPES:
            raise SFMError(f"--dtype {self.dtype!r} is not supported; use one of {', '.join(INGEST_DTYPES)} "
                           "(float32 is lossless)")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise SFMError(f"nonfinite={self.nonfinite!r}: use 'replace' or 'refuse'")
        if self.endian not in ("auto", "big", "little"):
            raise SFMError(f"ingest.endian = {self.endian!r}: use auto, big or little")
        if not 1 <= int(self.chunk) <= 4096:
            raise SFMError(f"--chunk {self.chunk} is not a brick edge; give 1..4096 voxels (default 128)")
        if not self.max_sparsity >= 1:
            raise SFMError(f"--max-sparsity {self.max_sparsity} must be at least 1 (cells per trace)")
        if int(self.parts) < 0:
            raise SFMError(f"ingest.parts = {self.parts} is not a number of tasks; give 0 (by size) or more")
        if not self.part_gb > 0:
            raise SFMError(f"ingest.part_gb = {self.part_gb} must be positive (GB of SEG-Y per task)")
        if not self.mdio_stats_gb > 0:
            raise SFMError(f"ingest.mdio_stats_gb = {self.mdio_stats_gb} must be positive (GB of an MDIO store's "
                           "amplitude read for its statistics)")
        self.check_layout()
        for byte in (self.iline_byte, self.xline_byte):
            if byte and not 1 <= int(byte) <= 237:
                raise SFMError(f"byte location {byte} is outside the 240-byte trace header; use 1..237")

    def check_layout(self) -> None:
        """``layout`` and ``domain`` valid, or SFMError. Every dtype goes with either layout: MDIO decodes a float16
        or int8 store's CF scale_factor / add_offset and exports the decoded amplitudes."""
        if self.layout not in LAYOUTS:
            raise SFMError(f"ingest.layout = {self.layout!r} is not a store layout; use sfm, or mdio (read by MDIO too)")
        if self.domain not in DOMAINS:
            raise SFMError(f"ingest.domain = {self.domain!r} is not a sample domain; use time or depth")


CODEC_NAMES = ("zstd", "lz4", "lz4hc", "blosclz", "zlib")
INGEST_DTYPES = ("float32", "float16", "int8")
NONFINITE_POLICIES = ("replace", "refuse")
DOMAINS = ("time", "depth")  # ingest.domain


def config_file(name: str | Path) -> Path:
    """The job config file ``name`` means: a file that exists, else a packaged config by its name (``quality_cpu``
    or ``quality_cpu.toml``: sfm/configs/; ``default``: sfm/default.toml), else ``name`` as it is (reading it says
    it is missing). ``sfm flow NAME --config config NAME`` and every ``--config`` of ``sfm`` resolve through this."""
    path = Path(name)
    if path.is_file() or path.parent != Path("."):
        return path
    stem = path.name.removesuffix(".toml")
    packaged = DEFAULT_TOML if stem == "default" else CONFIGS_DIR / f"{stem}.toml"
    return packaged if packaged.is_file() else path


def codec_settings(codec: str) -> tuple[str, int]:
    """(cname, clevel) of a Blosc ``codec`` = "cname[:clevel]" (clevel 1 if not given), or SFMError."""
    cname, _, level = str(codec).strip().partition(":")
    try:
        clevel = int(level) if level else 1
    except ValueError:
        clevel = -1
    if cname not in CODEC_NAMES or not 1 <= clevel <= 9:
        raise SFMError(f"codec {codec!r} is not a Blosc codec; use one of {', '.join(CODEC_NAMES)}, optionally "
                       "with a level 1-9 (e.g. zstd:1, the default, or lz4)")
    return cname, clevel


@dataclass
class DataConfig:
    crop: tuple[int, int, int] = (32, 32, 32)  # (inline, crossline, sample) voxels
    batch_size: int = 8  # per rank
    min_live_fraction: float = 0.5
    seed: int = 0
    align: str = "voxel"  # crop origins anywhere, or "brick": on the store's brick grid (no read amplification)
    augment: str = "flip_inline,flip_crossline,swap"  # any of AUGMENTATIONS, comma-separated; swap only when crop IL == XL
    workers: int = 0  # DataLoader worker processes per rank; 0 reads on threads of the training process
    read_threads: int = 8  # crop tiles read at once per process (each fetches its bricks concurrently)
    prefetch: int = 2  # batches each worker reads ahead
    client: str = "auto"  # S3 reads: auto (bricks by ranged GETs, the rest obstore or s3fs), http, obstore, fsspec
    retry_seconds: float = 120.0  # how long transient S3 failures are retried before a read fails
    crops_per_region: int = 1  # k crops cut from each fetched, decoded region (sfm.data.regions); 1: a fetch per crop
    region_bricks: tuple[int, int, int] = (2, 2, 2)  # a region's size in stored bricks (inline, crossline, sample)
    regions_in_flight: int = 0  # regions a rank cuts from at once; 0: the batch size (each batch: distinct regions)
    batch_dtype: str = "float32"  # float32 | float16 | int8 (int8 stores only: normalised on the device)
    pool_dir: str = ""  # decoded regions shared by a node's processes; "": /dev/shm, else the temp dir
    pool_mb: int = 0  # bound on the node pool's size; 0: two regions per lane for each of the node's ranks
    cache_mb: int = 0  # normalised bricks each process keeps in memory (sfm.data.brick_cache); 0: none

    def check(self) -> None:
        """Every setting valid, or SFMError naming it and the fix; sfm.data builds from a checked section
        and checks none of it again."""
        if len(self.crop) != 3 or min(int(c) for c in self.crop) < 1:
            raise SFMError(f"data.crop = {list(self.crop)} is not a crop shape; give 3 positive sizes, "
                           "e.g. [64, 64, 64]")
        at_least("data", self, {"batch_size": 1, "read_threads": 1, "workers": 0, "prefetch": 1, "cache_mb": 0,
                                 "crops_per_region": 1, "regions_in_flight": 0, "pool_mb": 0},
                  {"cache_mb": " (0: no brick cache)", "crops_per_region": " (1: a fetch per crop)",
                   "regions_in_flight": " (0: automatic)", "pool_mb": " (0: automatic)"})
        fraction_in("data.min_live_fraction", self.min_live_fraction, "[]", "the live share a crop needs")
        if len(self.region_bricks) != 3 or min(int(b) for b in self.region_bricks) < 1:
            raise SFMError(f"data.region_bricks = {list(self.region_bricks)} must be 3 positive brick counts, "
                           "e.g. [2, 2, 2]")
        for key, valid in (("align", ALIGNMENTS), ("client", CLIENTS), ("batch_dtype", BATCH_DTYPES)):
            one_of(f"data.{key}", getattr(self, key), valid)
        unknown = [a for a in self.augmentations() if a not in AUGMENTATIONS]
        if unknown:
            raise SFMError(f"data.augment names {', '.join(unknown)}; use any of {', '.join(AUGMENTATIONS)}")

    def augmentations(self) -> tuple[str, ...]:
        """The names in ``augment``, in order."""
        return tuple(a for a in (x.strip() for x in self.augment.split(",")) if a)


@dataclass
class ModelConfig:
    preset: str = "tiny"
    mask_ratio: float = 0.75
    mask_tube: str = ""  # "": patches masked independently; inline | crossline | sample: whole columns along it
    decoder_mask_ratio: float = 0.0  # dual masking: this fraction of the masked patches is not decoded in training
    patch: tuple[int, int, int] | None = None  # None: the preset's
    decoder_depth: int = 0  # 0: the preset's
    decoder_embed_dim: int = 0  # 0: the preset's

    def check(self) -> None:
        """The masking in range, or SFMError. Whether the preset and sizes make a model is for the model layer to
        say (:func:`sfm.model.model_config_for`), called where a job starts."""
        fraction_in("model.mask_ratio", self.mask_ratio, "()", "the fraction of patches masked")
        fraction_in("model.decoder_mask_ratio", self.decoder_mask_ratio, "[)",
                  "the fraction of masked patches the decoder skips; 0: decode every patch")


@dataclass
class TrainConfig:
    max_steps: int = 200
    lr: float = 1.5e-3
    min_lr: float = 1e-5
    warmup_steps: int = 20
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.95)
    optimizer: str = "adamw"  # adamw | muon: Muon for the blocks' weight matrices, AdamW for the rest
    muon_lr: float = 0.0  # peak rate of the Muon matrices (0: lr); the schedule scales it as it scales lr
    grad_clip: float = 1.0
    grad_accum: int = 1
    mixed_precision: str = "auto"  # auto: bf16 on CUDA, no on CPU
    grad_checkpointing: bool = False
    compile: bool = False
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    log_every: int = 10
    log_every_s: float = 30.0  # without a terminal (a flow task, a Slurm log): a plain progress line this often
    threads_per_process: int = 0  # 0: torch's default
    init_from: str = ""  # continue pretraining from: a model reference (sfm-mae:v3) or an exported model's folder URL
    snapshots: tuple[float, ...] = ()  # fractions of max_steps at which the model is also exported (snapshots/step-N)
    # where the run's figures and config go (pretraining and fine-tuning, from the main process): any of Accelerate's
    # trackers (TRACKERS: tensorboard, mlflow, wandb, aim, ...); mlflow logs to registry.mlflow_uri, else
    # MLFLOW_TRACKING_URI. Files the trackers write (TensorBoard's event files) reach <run_root>/tensorboard/ every
    # tracker_sync_s seconds while the run runs, and when it ends or fails (0: only then); see sfm.train.trackers
    trackers: tuple[str, ...] = ("tensorboard",)
    tracker_sync_s: float = 60.0

    def check(self) -> None:
        """Every setting valid, or SFMError naming it and the fix."""
        at_least("train", self, {"max_steps": 1, "warmup_steps": 0, "grad_accum": 1, "checkpoint_every": 1,
                                  "keep_checkpoints": 0, "log_every": 1},
                  {"max_steps": "; give a positive one: --max-steps N (the pretrain flow), --set train.max_steps=N "
                                 "(sfm train, sfm slurm-script, sfm watch, the flows) or [train] max_steps"})
        if not self.log_every_s > 0:
            raise SFMError(f"train.log_every_s = {self.log_every_s} must be positive (seconds between progress lines)")
        if not (self.lr > 0 and self.min_lr >= 0):
            raise SFMError(f"train.lr = {self.lr} must be > 0 and train.min_lr = {self.min_lr} >= 0")
        if any(not 0 < f < 1 for f in self.snapshots):
            raise SFMError(f"train.snapshots = {list(self.snapshots)}: each must be a fraction of the steps in (0, 1)")
        one_of("train.optimizer", self.optimizer, OPTIMIZERS)
        for name in self.trackers:
            if name not in TRACKERS:
                raise SFMError(f"train.trackers: {name!r} is not one of Accelerate's trackers; use a list of "
                               f"{', '.join(TRACKERS)}, e.g. trackers = [\"tensorboard\", \"mlflow\"]")
            if not any(importlib.util.find_spec(module) for module in TRACKERS[name]):
                raise SFMError(f"train.trackers: {name} is not installed here; pip install {TRACKERS[name][0]}, "
                               f"or leave {name} out of train.trackers")
        if not self.tracker_sync_s >= 0:
            raise SFMError(f"train.tracker_sync_s = {self.tracker_sync_s} must be >= 0 (seconds between copies of the "
                           "trackers' files to the run root; 0: only at the end)")


@dataclass
class DistConfig:
    nodes: int = 1
    procs_per_node: int = 1
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_s: int = 300  # collectives (and rendezvous) fail after this: a dead rank never hangs the job
    strategy: str = "ddp"  # one of STRATEGIES (see sfm.distributed.strategies)
    cp: int = 1  # context-parallel ranks per volume (dp = world size / cp); see sfm.distributed.context_parallel
    launcher: str = "torchrun"  # torchrun | accelerate (accelerate launch with a config of sfm's own)
    # an Accelerate config file (`accelerate config` writes it, YAML or JSON, local or s3://) mapped onto
    # this job where the job starts, or refused (sfm.distributed.accelerate_config); "": none
    accelerate_config: str = ""

    def check(self) -> None:
        """The job's size, strategy and cp valid, or SFMError; how they fit the job is
        :meth:`JobConfig.check_parallelism`'s. The one check of the node counts: the flow's ``start``, ``sfm train``,
        ``sfm slurm-script`` and every node's launch reach it through :meth:`JobConfig.validate`."""
        at_least("dist", self, {"nodes": 1, "procs_per_node": 1},
                 {"nodes": "; pass --nodes 1 or more", "procs_per_node": "; pass --procs-per-node 1 or more"})
        if self.strategy not in STRATEGIES:
            raise SFMError(f"dist.strategy = {self.strategy!r} is not a strategy; use one of {', '.join(STRATEGIES)}")
        if self.cp < 1:
            raise SFMError(f"dist.cp = {self.cp} must be at least 1")
        one_of("dist.launcher", self.launcher, LAUNCHERS)

    def backend_for(self, cuda: bool) -> str:
        """The process group's backend: ``backend``, or for ``auto`` nccl on CUDA and gloo on CPU."""
        return self.backend if self.backend != "auto" else ("nccl" if cuda else "gloo")


@dataclass
class HealthConfig:
    max_nonfinite_in_a_row: int = 3  # non-finite loss/grad-norm steps skipped in a row before a rollback
    max_rollbacks: int = 2  # rollbacks to the last checkpoint before the run is declared diverged
    step_timeout_s: float = 900.0  # no step finishing for this long: dump stacks, fail the step (retry/resume)
    first_step_timeout_s: float = 1800.0  # the first step (opening stores, compile) may take longer
    heartbeat_every_s: float = 30.0  # <run_root>/heartbeat.json, read by `sfm status`


@dataclass
class ClusterConfig:
    """Where the pretrain step's nodes run on a cluster (HyperPod EKS via Metaflow, HyperPod Slurm via
    ``sfm slurm-script``); see sfm/ops/cluster.py. Ignored by local runs. Lists are comma-separated."""

    image: str = ""  # container image with sfm installed; "": METAFLOW_KUBERNETES_CONTAINER_IMAGE
    instance_type: str = ""  # node selector node.kubernetes.io/instance-type, e.g. ml.p5en.48xlarge
    node_selector: str = ""  # more label=value pairs the training nodes must carry
    tolerations: str = ""  # key[=value]:Effect, e.g. nvidia.com/gpu:NoSchedule
    cpu: int = 1  # per node (pod)
    memory_mb: int = 4096
    disk_mb: int = 10240
    gpu: int = 0  # per node; on GPU nodes equal to dist.procs_per_node
    shared_memory_mb: int = 0  # /dev/shm for NCCL and DataLoader workers; 0: the cluster's default
    efa: int = 0  # EFA devices per node (vpc.amazonaws.com/efa); > 0 also sets the EFA/NCCL environment
    env: str = ""  # KEY=VALUE pairs set on every training node (e.g. NCCL_DEBUG=INFO)


@dataclass
class SynthConfig:
    """The surveys generated into <data-root>/landing when a run names none (sfm.synth.survey)."""

    train_surveys: int = 2
    held_out_surveys: int = 1
    shape: tuple[int, int, int] = (64, 64, 128)  # IL, XL, NS of each


@dataclass
class JobConfig:
    ingest: IngestConfig = field(default_factory=IngestConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    retrain: RetrainConfig = field(default_factory=RetrainConfig)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None = None) -> "JobConfig":
        """The config a dict ({section: {key: value}}) describes; a process parses its job once, at its entry."""
        cfg = cls()
        for section, values in (data or {}).items():
            if not hasattr(cfg, section):
                raise SFMError(f"unknown config section [{section}]; valid: {', '.join(_section_names())}")
            for key, value in dict(values).items():
                cfg.set(f"{section}.{key}", value)
        return cfg

    @classmethod
    def from_toml(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> "JobConfig":
        path = config_file(path) if path else DEFAULT_TOML
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError as err:
            raise SFMError(f"config file {path} does not exist; pass an existing TOML file or a packaged config's "
                           f"name ({', '.join(sorted(p.stem for p in CONFIGS_DIR.glob('*.toml')))})") from err
        except tomllib.TOMLDecodeError as err:
            raise SFMError(f"config file {path} is not valid TOML ({err}); fix the syntax") from err
        return cls.from_dict(data).override(overrides or ())

    def override(self, assignments: str | Iterable[str] = (), **named: Any) -> "JobConfig":
        """This config (changed in place, and returned) with the ``named`` parameters set, each on the key
        :data:`PARAMETERS` gives it (``max_steps=500``: train.max_steps; None leaves the config's value), then the
        ``section.key=value`` ``assignments`` (``--set``: :func:`assignments`), which therefore win. The one path by
        which the flows' parameters and the CLI's arguments reach a job; nothing is checked here (:meth:`validate`).

        A flow's named parameters default to the config's values, so they change nothing unless given, and its
        ``--set`` applies on top; the CLI's flags default to None."""
        for name, value in named.items():
            if name not in PARAMETERS:
                raise TypeError(f"{name} is not a job parameter; known: {', '.join(PARAMETERS)}")
            if value is not None:
                self.set(PARAMETERS[name], value)
        for item in split_assignments(assignments):
            key, _, value = item.partition("=")
            self.set(key.strip(), parse_literal(value.strip()))
        return self

    def validate(self) -> None:
        """Every section valid (its ``check``) and the sections agree, or SFMError naming the key and the fix:
        the flow's ``start`` and ``sfm train`` call this before any survey is read. Whether the [model] settings
        make a model is the model layer's to check (:func:`sfm.model.model_config_for`), where a job starts."""
        for section in (self.ingest, self.data, self.model, self.train, self.eval, self.finetune, self.predict,
                        self.registry):
            section.check()
        if self.data.batch_dtype == "int8" and self.ingest.dtype != "int8":
            raise SFMError(f"data.batch_dtype = \"int8\" delivers the stored int8 values, but ingest.dtype = "
                           f"{self.ingest.dtype!r}; set ingest.dtype = \"int8\" or data.batch_dtype = \"float16\"")
        metric = self.registry.champion_metric
        budget = metric.rpartition("_b")[2]
        if metric.startswith(("ft_", "linear_", "knn_")) and not (self.eval.downstream and budget.isdigit() and
                                                                  int(budget) in self.eval.budgets):
            raise SFMError(f"registry.champion_metric = {metric!r} is a downstream figure this job does not measure; "
                           "set eval.downstream = true with that budget in eval.budgets, or choose masked_nmse")
        self.check_parallelism()

    def check_parallelism(self, world: int | None = None) -> None:
        """Refuse a [dist] section no run could train with, before anything starts. ``world``: the
        number of training processes (default: nodes x procs_per_node)."""
        d = self.dist
        d.check()
        if d.cp > 1 and self.model.decoder_mask_ratio > 0:
            raise SFMError(f"model.decoder_mask_ratio = {self.model.decoder_mask_ratio} is not implemented with "
                           f"dist.cp = {d.cp}: the context-parallel decoder decodes every patch; set it to 0")
        if d.cp > 1 and d.strategy != "ddp":
            raise SFMError(f"dist.cp = {d.cp} runs with dist.strategy = ddp (data parallel over the dp x cp mesh); "
                           f"{d.strategy} with context parallelism is not supported yet")
        world = d.nodes * d.procs_per_node if world is None else world
        if self.train.optimizer == "muon" and d.strategy != "ddp" and world != 1:
            raise SFMError(f"train.optimizer = muon orthogonalises each weight matrix whole, which {d.strategy}'s "
                           "shards do not hold; use dist.strategy = ddp or train.optimizer = adamw")
        if d.strategy.startswith("deepspeed") and world != 1 and importlib.util.find_spec("deepspeed") is None:
            raise SFMError(f"dist.strategy = {d.strategy} needs DeepSpeed: pip install 'sfm[deepspeed]' (its extra)")
        if world % d.cp:
            raise SFMError(f"dist.cp = {d.cp} does not divide the {world} training processes (nodes x processes per "
                           "node); choose a cp that divides it")

    def set(self, dotted: str, value: Any) -> None:
        """Set ``section.key`` (or ``section.table.key`` in a nested table, e.g. ``eval.finetune.steps``; a whole
        table from a dict) to ``value``, coerced to the field's type. A key renamed since (:data:`RENAMED`) is
        read as its new name."""
        if dotted in RENAMED:
            dotted, value = RENAMED[dotted](value)
            if dotted is None:
                return
        section_name, _, key = dotted.partition(".")
        section = getattr(self, section_name, None)
        if section is None or not dataclasses.is_dataclass(section):
            raise SFMError(f"unknown config key '{dotted}'; sections are {', '.join(_section_names())}")
        _set_key(section, section_name, key, value)

    # ---- output -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def to_toml(self) -> str:
        """This config as TOML that :meth:`from_toml` reads back to the same config."""
        return toml_text(self.to_dict())

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _set_key(section: Any, prefix: str, key: str, value: Any) -> None:
    """``section``'s field ``key`` (``table.key`` for a nested section) = ``value``; ``prefix`` names it in errors."""
    name, _, rest = key.partition(".")
    hints = field_types(type(section))
    if name not in hints:
        raise SFMError(f"unknown config key '{prefix}.{key}'; valid keys in [{prefix}]: {', '.join(hints)}")
    if dataclasses.is_dataclass(hints[name]):  # a nested table, e.g. [eval.finetune]
        table = getattr(section, name)
        if rest:
            _set_key(table, f"{prefix}.{name}", rest, value)
        elif isinstance(value, dict):
            for inner, v in value.items():
                _set_key(table, f"{prefix}.{name}", inner, v)
        else:
            raise SFMError(f"config key '{prefix}.{name}' is a table ([{prefix}.{name}]); set its keys, e.g. "
                           f"{prefix}.{name}.steps=100")
        return
    if rest:
        raise SFMError(f"unknown config key '{prefix}.{key}'; '{prefix}.{name}' is not a table")
    setattr(section, name, coerce(f"{prefix}.{name}", hints[name], value))


def _renamed(new: str, drop_zero: bool = False):
    return lambda value: (None, None) if drop_zero and not value else (new, value)


# keys of configs written before issue 54 (a registered version's record, a user's file), read as what replaced
# them: the evaluation's recipe is now a FinetuneConfig ([eval.finetune]); a peak rate, a grid of rates (a rate of
# 0, "the pretrained arm's", is left to the default grid); test-time augmentation, mirroring
RENAMED = {
    "eval.finetune_steps": _renamed("eval.finetune.steps"), "eval.finetune_batch": _renamed("eval.finetune.batch_size"),
    "eval.finetune_lr": _renamed("eval.finetune.lrs"),
    "eval.finetune_lr_random": _renamed("eval.finetune.lrs_random", drop_zero=True),
    "eval.layer_decay": _renamed("eval.finetune.layer_decay"), "eval.validation": _renamed("eval.finetune.validation"),
    "eval.validate_every": _renamed("eval.finetune.validate_every"),
    "eval.test_augment": _renamed("eval.finetune.mirror"), "finetune.lr": _renamed("finetune.lrs"),
    "finetune.lr_random": _renamed("finetune.lrs_random", drop_zero=True),
    "finetune.test_augment": _renamed("finetune.mirror"),
}

# the flows' and the CLI's named parameters (``--max-steps``: max_steps), each the config key it sets
PARAMETERS = {"preset": "model.preset", "max_steps": "train.max_steps", "nodes": "dist.nodes",
              "procs_per_node": "dist.procs_per_node", "cp": "dist.cp", "strategy": "dist.strategy",
              "launcher": "dist.launcher", "accelerate_config": "dist.accelerate_config",
              "ingest_parts": "ingest.parts", "init_from": "train.init_from", "seed": "finetune.seed",
               "seeds": "finetune.seeds",
               **{key: f"predict.{key}" for key in ("output", "mirror", "layout", "parts", "overlap", "batch_size",
                                                    "device", "threshold")}}



def _section_names() -> list[str]:
    return [f.name for f in dataclasses.fields(JobConfig)]
