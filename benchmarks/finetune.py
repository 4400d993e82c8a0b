"""Did pretraining pay? The fine-tuned encoder against the baselines a user would otherwise train (issue 54).

    python benchmarks/finetune.py --encoder sfm_data/registry/sfm-mae/v3   # a registered version's folder
    python benchmarks/finetune.py                                          # pretrain sfm/configs/quality_cpu.toml first
    python benchmarks/finetune.py --smoke                                  # a tiny random encoder: the script runs

Without ``--encoder`` the quality configuration's pretrain flow runs first in the work folder (about 25 minutes on
2 cores: benchmarks/quality.py's ``run_quality_flow``) and its version is used.

For every budget (1 and 4 labelled surveys) and paired seed (3), the fine-tune flow's ``--compare`` runs through
its steps (:mod:`sfm.finetune.run`: ingest, the arms, the runs, the held-out scores) in this process: the
pretrained encoder with the ``[finetune] head``, the same architecture randomly initialised, and a FaultSeg3D-style
U-Net from scratch at the encoder's crop, every arm on the same crops for a seed, each at the peak rate of its grid
its validation labels prefer, for steps that grow with the labels (``[finetune]`` of the version's config, with
``--set`` changes). The surveys are generated (:func:`sfm.synth.survey.synth_survey`, FaultSeg3D-like, written as
SEG-Y with their fault labels): a budget's training surveys are a seeded draw from a pool
(``sfm.eval.labelled.budget_volumes``), early stopping and the rates are chosen on separate validation surveys, and
every run is scored on the same held-out test surveys; no seed meets a pretraining survey's.

The last line is one JSON object: per budget and seed, each arm's held-out AP, F1, F1 at a 2-voxel tolerance and
IoU, the rate and step chosen, the seconds; the margins ``pretrained_minus_unet`` and ``pretrained_minus_random``
(held-out AP) per budget and seed; and ``meets``: the margins hold (at least 0.03 over the U-Net and 0.05 over
random init, at every budget and seed) and more labels help every arm (mean AP at the largest budget above the
smallest). ``--png`` gets one predicted line per arm (the first seed of the largest budget), beside its amplitude
and labels.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GOALS = {"pretrained_minus_unet": 0.03, "pretrained_minus_random": 0.05}  # held-out AP, every budget and seed
SMOKE = ["finetune.steps=4", "finetune.validate_every=2", "finetune.probe_steps=2", "finetune.batch_size=2",
         "finetune.lrs=[0.001]", "finetune.lrs_random=[0.001]", "finetune.lrs_unet=[0.001]"]


def generate(folder: Path, count: int, first_seed: int, shape: tuple[int, int, int], tag: str) -> list[tuple[str, str]]:
    """``count`` labelled surveys (SEG-Y, fault labels .npy) of seeds ``first_seed`` on, written once."""
    from sfm.synth.survey import fault_labels_path, synth_survey

    out = []
    for k in range(count):
        path = folder / f"{tag}-{k}.sgy"
        if not path.exists():
            synth_survey(path, shape=shape, seed=first_seed + k)
        out.append((str(path), str(fault_labels_path(path))))
    return out


def smoke_encoder(workdir: Path, crop: tuple[int, int, int]) -> str:
    """A tiny randomly initialised encoder registered in ``workdir``/data (the smoke run's 'pretrained' arm)."""
    import torch

    from sfm.config import JobConfig
    from sfm.model import mae_config, registry, save
    from sfm.model.mae import MaskedAutoencoder3D

    torch.manual_seed(0)
    save(MaskedAutoencoder3D(mae_config("tiny", crop=crop)), str(workdir / "encoder"))
    record = registry.register(str(workdir / "data"), "sfm-mae", str(workdir / "encoder"), config=JobConfig().to_dict(),
                               metrics={"masked_nmse": 1.0}, lineage={"run_pathspec": "smoke", "manifest_version": "",
                                                                      "code_version": "", "surveys": []})
    return registry.version_url(str(workdir / "data"), "sfm-mae", record["version"])


def compare(cfg, encoder: str, pairs: dict[str, list[tuple[str, str]]], data_root: str, run_root: str):
    """One ``--compare`` through the fine-tune flow's steps: (metrics, figures, summary)."""
    from sfm.finetune import job as ftjob
    from sfm.finetune import run
    from sfm.ingest.labels import ingest_pairs

    join = lambda items, i: ",".join(p[i] for p in items)  # noqa: E731
    plan = run.plan_pairs(join(pairs["train"], 0), join(pairs["train"], 1), join(pairs["test"], 0),
                          join(pairs["test"], 1), join(pairs["validation"], 0), join(pairs["validation"], 1))
    ingested = ingest_pairs(plan, data_root, cfg.ingest)
    job = run.node_job(cfg, ingested, run.resolve_arms(encoder, data_root, cfg, compare=True), "binary", run_root)
    summary = ftjob.finetune_runs(job)
    metrics, figures = run.evaluate(job, summary)
    return metrics, figures, summary


def save_png(figures: dict, path: Path) -> None:
    """The card's panels of one held-out line (amplitude, labels, each arm's prediction) side by side, each
    named above it."""
    from PIL import Image, ImageDraw

    from sfm.finetune.card import line_panels

    panels = line_panels(figures)
    gap, top = 8, 16
    width = sum(p.width for p in panels.values()) + gap * (len(panels) - 1)
    out = Image.new("RGB", (width, top + max(p.height for p in panels.values())), "white")
    draw, x = ImageDraw.Draw(out), 0
    for name, panel in panels.items():
        draw.text((x + 2, 2), name, fill="black")
        out.paste(panel, (x, top))
        x += panel.width + gap
    out.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder", help="a registered encoder version's folder (holds version.json); default: "
                        "pretrain sfm/configs/quality_cpu.toml first")
    parser.add_argument("--config", default=str(ROOT / "sfm" / "configs" / "quality_cpu.toml"),
                        help="the pretrain flow's config when --encoder is not given")
    parser.add_argument("--workdir", help="where the runs keep their data (default: a temporary folder)")
    parser.add_argument("--budgets", default="1,4", help="labelled training surveys per run")
    parser.add_argument("--seeds", type=int, default=3, help="paired seeds per budget")
    parser.add_argument("--first-seed", type=int, default=0, help="the first paired seed (a later process can run "
                        "seeds the first did not)")
    parser.add_argument("--pool", type=int, default=8, help="labelled surveys the budgets draw from")
    parser.add_argument("--validation", type=int, default=4, help="separate validation surveys (rates, early stopping)")
    parser.add_argument("--test", type=int, default=4, help="held-out test surveys")
    parser.add_argument("--shape", type=int, nargs=3, default=[64, 64, 64], help="each generated survey's IL XL NS")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); recorded as "
                        "torch_threads, as figures repeat to the digit only at the same count")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, e.g. finetune.head=unetr (repeatable)")
    parser.add_argument("--png", help="where the picture of one predicted line per arm goes (default: the workdir)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random encoder, small surveys, a few steps: "
                        "checks the script runs (its figures mean nothing)")
    args = parser.parse_args()
    if args.smoke:  # the largest default budget's worth of pool, one validation and one test survey, small
        args.pool, args.validation, args.test, args.shape = 4, 1, 1, [32, 32, 64]

    import numpy as np
    import torch

    from sfm import storage
    from sfm.config import JobConfig
    from sfm.eval.labelled import LABELLED_SEED, TEST_SEED, VALIDATION_SEED, budget_volumes

    if args.threads:
        torch.set_num_threads(args.threads)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sfm-finetune-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    pretrain_seconds = None
    encoder = args.encoder
    if args.smoke and not encoder:
        encoder = smoke_encoder(workdir, (32, 32, 32))
    elif not encoder:
        from quality import run_quality_flow

        encoder, pretrain_seconds = run_quality_flow(Path(args.config), workdir / "pretrain")
    encoder = storage.normalize(encoder)
    record = json.loads(storage.read_bytes(storage.join(encoder, "version.json")))
    cfg = JobConfig.from_dict(record["config"]).override((SMOKE if args.smoke else []) + args.set)
    cfg.set("finetune.seeds", 1)  # one draw of training surveys per seed: each seed is its own --compare
    cfg.validate()
    shape = tuple(args.shape)
    surveys = workdir / "surveys"
    surveys.mkdir(exist_ok=True)
    pool = generate(surveys, args.pool, LABELLED_SEED, shape, "pool")
    fixed = {"validation": generate(surveys, args.validation, VALIDATION_SEED, shape, "validation"),
             "test": generate(surveys, args.test, TEST_SEED, shape, "test")}
    budgets = [int(b) for b in args.budgets.split(",")]
    t0 = time.perf_counter()
    out: dict = {"encoder": encoder, "encoder_metrics": {k: record["metrics"].get(k) for k in
                                                         ("masked_nmse", "ft_ap_gain_b1", "ft_ap_gain_b4")},
                 "pretrain_seconds": pretrain_seconds, "shape": list(shape), "pool": args.pool,
                 "validation_surveys": args.validation, "test_surveys": args.test, "smoke": args.smoke,
                 "recipe": json.loads(json.dumps(cfg.to_dict()["finetune"])), "budgets": {}}
    picture = None
    for budget in budgets:
        per_seed: dict = {}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            cfg.set("finetune.seed", seed)
            pairs = {"train": budget_volumes(pool, budget, seed), **fixed}
            metrics, figures, summary = compare(cfg, encoder, pairs, str(workdir / "data"),
                                                str(workdir / "runs" / f"b{budget}-s{seed}"))
            arms = {r["arm"]: {k: r.get(k) for k in ("ap", "f1", "f1_tol2", "iou", "lr", "chosen_step", "steps",
                                                     "steps_run", "validation_score", "seconds")}
                    for r in metrics["runs"]}
            margins = {name: arms["pretrained"]["ap"] - arms[name.rpartition("_")[2]]["ap"] for name in GOALS}
            per_seed[str(seed)] = {"arms": arms, "margins": margins, "registered": summary["arm"]}
            print(f"finetune bench: budget {budget} seed {seed}: " + "; ".join(
                f"{arm} AP {a['ap']:.4f} F1 {a['f1']:.4f} F1tol2 {a['f1_tol2']:.4f} (lr {a['lr']:g}, step "
                f"{a['chosen_step']}/{a['steps_run']}, {a['seconds']:.0f}s)" for arm, a in arms.items())
                + "; " + ", ".join(f"{k} {v:+.4f}" for k, v in margins.items()), file=sys.stderr, flush=True)
            if budget == max(budgets) and seed == args.first_seed:
                picture = figures
        mean = {arm: {k: float(np.mean([s["arms"][arm][k] for s in per_seed.values()])) for k in ("ap", "f1",
                                                                                                  "f1_tol2", "iou")}
                for arm in next(iter(per_seed.values()))["arms"]}
        out["budgets"][str(budget)] = {"seeds": per_seed, "mean": mean}
    png = Path(args.png) if args.png else workdir / "finetune-lines.png"
    save_png(picture, png)
    low, high = str(min(budgets)), str(max(budgets))
    margins_hold = {name: all(s["margins"][name] >= goal for b in out["budgets"].values() for s in b["seeds"].values())
                    for name, goal in GOALS.items()}
    more_labels = {arm: out["budgets"][high]["mean"][arm]["ap"] > out["budgets"][low]["mean"][arm]["ap"]
                   for arm in out["budgets"][high]["mean"]} if low != high else {}
    out["meets"] = {**{f"{name}_ge_{goal:g}": ok for (name, goal), ok in zip(GOALS.items(), margins_hold.values())},
                    "more_labels_help": more_labels, "all": all(margins_hold.values()) and all(more_labels.values())}
    out["png"] = str(png)
    out["seconds"] = time.perf_counter() - t0
    out["torch_threads"] = torch.get_num_threads()  # as the runs left it: convolutions sum in a thread-dependent order
    print(json.dumps(out))


if __name__ == "__main__":
    main()
