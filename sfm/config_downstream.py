"""The job config's sections downstream of pretraining: the encoder's evaluation (``[eval]``), fine-tuning
(``[finetune]``, also ``[eval.finetune]``), prediction (``[predict]``), the registry and retraining. They are
fields of :class:`sfm.config.JobConfig`, which every caller imports them through."""

from __future__ import annotations

from dataclasses import dataclass, field

from sfm.config_values import AUGMENTATIONS, LAYOUTS, at_least, check_device, fraction_in, one_of
from sfm.errors import SFMError


@dataclass
class FinetuneConfig:
    """The one fine-tuning recipe (sfm.finetune.loop): the fine-tune flow's ``[finetune]`` (sfm flow finetune,
    sfm.finetune) and, as ``[eval.finetune]``, the pretrain evaluation's (sfm.eval.downstream). LP-FT, layer decay,
    early stopping, augmentation; every arm's peak rate chosen on the validation labels from its grid; steps that
    grow with the labels, within a time budget; predictions scored through sfm predict's windows."""

    steps: int = 0  # fine-tuning steps per run; 0: base_steps x sqrt(labelled volumes), early stopping keeps the best
    base_steps: int = 200  # with steps = 0: the steps of one labelled volume (LABELLED_VOLUME voxels of labels)
    max_minutes: float = 60.0  # training time of a whole fine-tuning, shared equally by its runs (arms x seeds x
    # rates); a run whose steps would not fit is cut to what fits, measured at its validation points; 0: no limit
    batch_size: int = 4  # per rank
    lrs: tuple[float, ...] = (1e-3, 3e-3)  # peak rates tried for a pretrained encoder's arm (the head's; encoder
    # layer k of d: lr * layer_decay^(d + 1 - k)): each run trains at every one, the best on the validation labels kept
    lrs_random: tuple[float, ...] = (1e-3, 3e-3)  # the same for the random-init arm (--encoder random)
    lrs_unet: tuple[float, ...] = (1e-3, 3e-3)  # the same for the U-Net from scratch (--encoder unet)
    layer_decay: float = 0.75
    weight_decay: float = 0.05
    warmup_fraction: float = 0.1
    linear_first: bool = True  # LP-FT: probe_steps of the head alone on the frozen encoder first, at probe_lr
    probe_steps: int = 50
    probe_lr: float = 1e-2
    validate_every: int = 25  # steps between validation scores (early stopping, the time budget's checks)
    validation: float = 0.25  # early stopping on this fraction of the training labelled lines (0: none); without it
    # a run keeps its last step and the first rate of its grid
    held_out: float = 0.2  # without --held-out surveys: this fraction of the labelled lines is held out to score
    head: str = "unetr"  # a head of sfm.model.segmenter.HEADS: unetr (a light decoder over several blocks with a
    # full-resolution path: per-voxel probabilities), linear (per token: patch-sized blocks; BENCHMARKS.md
    # "Fine-tuning"); --encoder unet always takes the U-Net
    head_width: int = 16  # the unetr decoder's channels
    overlap: float = 0.5  # predictions (early stopping, held-out scores, and sfm predict's default for the model):
    # neighbouring windows overlap by this fraction of a crop, Gaussian-weighted
    mirror: bool = False  # ... and each window also seen flipped (and swapped), averaged (4-8x the work)
    seed: int = 0  # crops, their augmentation, the head's (and a random encoder's) initialisation; the first seed
    seeds: int = 1  # paired seeds seed, seed + 1, ...: each arm once per seed, on that seed's crops
    augment: str = ",".join(AUGMENTATIONS)  # data.augment of the fine-tuning crops

    def check(self, section: str = "finetune") -> None:
        """Every setting valid, or SFMError naming it (``section``.key) and the fix. Whether ``head`` names a head
        is the model layer's to say, where a job starts (sfm.finetune.run)."""
        at_least(section, self, {"steps": 0, "base_steps": 1, "batch_size": 1, "validate_every": 1, "probe_steps": 0,
                                 "head_width": 1, "seeds": 1, "max_minutes": 0},
                 {"steps": " (0: base_steps x sqrt(labelled volumes))", "max_minutes": " (0: no time limit)"})
        for key in ("lrs", "lrs_random", "lrs_unet"):
            rates = getattr(self, key)
            if not rates or any(not r > 0 for r in rates):
                raise SFMError(f"{section}.{key} = {list(rates)} must be one or more positive peak rates, e.g. "
                               "[1e-3, 3e-3]")
        if not self.probe_lr > 0:
            raise SFMError(f"{section}.probe_lr = {self.probe_lr} must be > 0")
        fraction_in(f"{section}.validation", self.validation, "[)", "the labelled lines early stopping scores")
        fraction_in(f"{section}.held_out", self.held_out, "()", "the labelled lines held out to score the model")
        fraction_in(f"{section}.overlap", self.overlap, "[)", "of a crop, between neighbouring windows")


LABELLED_VOLUME = 64 ** 3  # voxels of labels that count as one labelled volume where steps scale with the labels


def quick_recipe() -> FinetuneConfig:
    """The pretrain evaluation's default recipe (``[eval.finetune]``): it runs in every pretraining run, so it is a
    quick check, 60 steps at one rate per arm; sfm/configs/quality_cpu.toml sets a full one. Its head is the linear
    one: what the encoder's tokens hold is what an encoder's evaluation measures (a full-resolution path would
    learn from the amplitude whatever the encoder)."""
    return FinetuneConfig(steps=60, lrs=(1e-3,), lrs_random=(1e-3,), lrs_unet=(1e-3,), max_minutes=0.0,
                          head="linear")


@dataclass
class EvalConfig:
    """Held-out reconstruction (``crops``) and the downstream evaluation (sfm.eval.downstream): the encoder
    fine-tuned for fault segmentation against random initialisation at each label budget, on generated labelled
    volumes, with the recipe ``finetune`` (``[eval.finetune]``: a FinetuneConfig)."""

    crops: int = 16
    batch_size: int = 8
    seed: int = 1234
    downstream: bool = True  # false: reconstruction metrics only (fast test runs)
    budgets: tuple[int, ...] = (1, 4)  # labelled volumes per fine-tuning run (benchmarks/quality.py: 1, 4, 16)
    seeds: int = 3  # paired seeds per budget (pretrained and random see the same crops)
    pool_volumes: int = 0  # labelled volumes the budgets draw from; 0: the largest budget (whatever budgets
    # a run evaluates, the same pool_volumes give every budget the same draws: flow and benchmark agree)
    test_volumes: int = 4  # held-out labelled volumes, seeds disjoint from the labelled pool's
    volume: tuple[int, int, int] = (64, 64, 64)  # labelled volume shape (IL, XL, NS)
    probes: bool = True  # frozen linear-head and kNN probes too
    knn: int = 16  # neighbours of the kNN probe
    validation_volumes: int = 0  # early stopping on this many separate labelled volumes, the whole budget
    # fine-tuned (seeds disjoint from pool and test); 0: on [eval.finetune] validation of each budget volume
    finetune: FinetuneConfig = field(default_factory=quick_recipe)  # the fine-tuning recipe ([eval.finetune])

    def check(self) -> None:
        """Every setting valid, or SFMError naming it and the fix."""
        at_least("eval", self, {"crops": 1, "seeds": 1, "test_volumes": 1, "pool_volumes": 0,
                                 "validation_volumes": 0})
        if any(b < 1 for b in self.budgets):
            raise SFMError(f"eval.budgets = {list(self.budgets)} must be positive numbers of labelled volumes")
        self.finetune.check("eval.finetune")


@dataclass
class PredictConfig:
    """How a task model predicts a whole survey (``sfm predict``, the predict flow: :class:`sfm.predict.PredictOptions`
    takes its defaults from here)."""

    output: str = "probability"  # probability (float32; binary tasks: of class 1) | classes (uint8)
    mirror: bool | None = None  # test-time mirroring: inline/crossline flips (and swap) averaged, 4-8x the work;
    # not set: as the task model's held-out scores were measured ([finetune] mirror, recorded in the version)
    layout: str = "sfm"  # sfm | mdio: also what MDIO's tools read and export
    parts: int = 1  # tasks (or GPUs) the survey is split into, runs of whole shard rows
    overlap: float | None = None  # of a crop, between neighbouring windows; not set: the task model's (its
    # [finetune] overlap, recorded in the version; 0.5 for a model that records none)
    batch_size: int = 8  # windows per network call
    device: str = "auto"  # auto (a GPU if there is one) | cpu | cuda | cuda:N
    threshold: float | None = None  # output = classes, a binary task: class 1 where its probability reaches this;
    # not set: the threshold the task model's F1 was scored at (recorded in it; 0.5 for a model that records none)

    def check(self) -> None:
        """Every setting valid, or SFMError naming it and the fix."""
        one_of("predict.output", self.output, PREDICT_OUTPUTS)
        one_of("predict.layout", self.layout, LAYOUTS)
        if self.overlap is not None:
            fraction_in("predict.overlap", self.overlap, "[)", "the overlap of neighbouring windows, of a crop")
        if self.threshold is not None:
            fraction_in("predict.threshold", self.threshold, "()", "the probability at which a binary task's classes "
                        "output marks class 1")
        at_least("predict", self, {"parts": 1, "batch_size": 1})
        check_device(self.device)


PREDICT_OUTPUTS = ("probability", "classes")  # predict.output


@dataclass
class RegistryConfig:
    model_name: str = "sfm-mae"
    margin: float = 0.0
    # what makes a champion: a held-out metric every version records, e.g. masked_nmse or ft_ap_gain_b4;
    # lower is better for names ending in nmse, loss or error, higher for the others (sfm.model.registry.Champion)
    champion_metric: str = "masked_nmse"
    # an MLflow tracking server every registered version is also logged to, and whose "champion" alias follows
    # the champion (http(s)://host:port, a SageMaker MLflow tracking server's ARN with sagemaker-mlflow, ...);
    # "": MLFLOW_TRACKING_URI if set, else none. The registry stays the source of truth (sfm.model.mlflow_sync)
    mlflow_uri: str = ""

    def check(self) -> None:
        """A tracking URI without credentials (the job config travels: flow artifacts, the exported model's
        config.json, the registry's records), or SFMError."""
        from urllib.parse import urlsplit

        parts = urlsplit(self.mlflow_uri)
        if parts.username or parts.password or parts.query:
            raise SFMError("registry.mlflow_uri carries credentials (user:password@ or a query), which the job config "
                           "would spread; give them as MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or "
                           "MLFLOW_TRACKING_TOKEN and keep the URI bare")


@dataclass
class RetrainConfig:
    schedule: str = "weekly"  # hourly | daily | weekly | a cron expression | "" (no schedule) on Argo Workflows
    event: str = "sfm-new-survey"  # Argo Events event that triggers a run (`sfm watch --publish-event` sends it)
    max_attempts: int = 3  # failed runs over the same new survey before `sfm watch` quarantines it
