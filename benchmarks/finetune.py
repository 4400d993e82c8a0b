"""Does the registered encoder pay on your own labels? The fine-tune flow, pretrained against random (issue 49).

    python benchmarks/finetune.py --encoder sfm_data/registry/sfm-mae/v3   # a registered version's folder
    python benchmarks/finetune.py                                          # pretrain sfm/configs/quality_cpu.toml first

Without ``--encoder`` the quality configuration's pretrain flow runs first in the work folder (about
25 minutes on 2 cores: benchmarks/quality.py's ``run_quality_flow``) and its version is used.

Then ``flows/finetune_flow.py`` runs end to end for every budget (1 and 4 labelled generated surveys), paired
seed and arm (``--encoder <the version>`` and ``--encoder random``, the same architecture), with the
evaluation's recipe of the version's config ([finetune] from its [eval]: steps, batch, peak rates of each
arm, layer decay, validation interval, test-time augmentation). The surveys are generated
(:func:`sfm.synth.survey.synth_survey`, the downstream evaluation's FaultSeg3D-like volumes, written as
SEG-Y with their fault labels) from the evaluation's seeds: the training surveys of a budget and seed are
drawn from a pool (``sfm.eval.labelled.budget_volumes``), early stopping scores separate validation
surveys, and every run is scored on the same held-out test surveys; no seed meets a pretraining survey's.
Arms of one seed see the same crops in the same order.

The last line is one JSON object: per budget the held-out AP of both arms per seed, the paired gains,
whether every seed gained, F1 and IoU; with ``--heads linear,unetr`` the same per head (the flow's choice
of head is made on the validation scores, never the test ones); ``meets``: pretrained beats random on
every paired seed at every budget.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


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


def recipe_toml(version_config: dict, head: str, threads: int) -> str:
    """The version's job config with [finetune] = its evaluation's recipe."""
    from sfm.config import JobConfig, toml_text

    cfg = JobConfig.from_dict(version_config)
    e = cfg.eval
    for key, value in (("steps", e.finetune_steps), ("batch_size", e.finetune_batch), ("lr", e.finetune_lr),
                       ("lr_random", e.finetune_lr_random), ("layer_decay", e.layer_decay),
                       ("validate_every", e.validate_every), ("test_augment", e.test_augment), ("head", head)):
        cfg.set(f"finetune.{key}", value)
    cfg.set("train.threads_per_process", threads)
    return toml_text(cfg.to_dict())


def run_flow(workdir: Path, config: Path, encoder: str, pairs: dict[str, list[tuple[str, str]]], seed: int,
             task_name: str) -> dict:
    """One fine-tune flow run; returns its registered record (metrics, lineage) and the seconds it took."""
    from sfm.model import registry

    data_root = str(workdir / "data")
    join = lambda items, i: ",".join(p[i] for p in items)  # noqa: E731
    args = ["--encoder", encoder, "--surveys", join(pairs["train"], 0), "--labels", join(pairs["train"], 1),
            "--validation", join(pairs["validation"], 0), "--validation-labels", join(pairs["validation"], 1),
            "--held-out", join(pairs["test"], 0), "--held-out-labels", join(pairs["test"], 1), "--seed", str(seed),
            "--task-name", task_name, "--data-root", data_root]
    env = {**os.environ, "METAFLOW_USER": os.environ.get("METAFLOW_USER", "bench"),
           "METAFLOW_HOME": str(workdir / "mfhome"), "METAFLOW_DEFAULT_DATASTORE": "local",
           "METAFLOW_DEFAULT_METADATA": "local", "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(workdir / "mf")}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "flows" / "finetune_flow.py"), "--config", "config", str(config),
                           "run", *args], env=env, cwd=str(workdir), capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"fine-tune flow failed (exit {proc.returncode}); see its output above")
    model = f"sfm-{task_name}"
    record = registry.get(data_root, model, registry.versions(data_root, model)[-1])
    return {"metrics": record["metrics"], "encoder": record["lineage"]["encoder"], "seconds": seconds}


def paired(runs: dict[str, list[dict]]) -> dict:
    """The figures of one budget: AP of both arms per seed, paired gains, F1 and IoU."""
    import numpy as np

    pre = [r["metrics"]["ap"] for r in runs["pretrained"]]
    rnd = [r["metrics"]["ap"] for r in runs["random"]]
    gains = [p - r for p, r in zip(pre, rnd)]
    out = {"pretrained_ap": pre, "random_ap": rnd, "gain": gains, "mean_gain": float(np.mean(gains)),
           "every_seed_gained": all(g > 0 for g in gains)}
    for arm in ("pretrained", "random"):
        for key in ("f1", "iou", "validation_score", "chosen_step"):
            out[f"{arm}_{key}"] = [r["metrics"][key] for r in runs[arm]]
        out[f"{arm}_seconds"] = [round(r["seconds"], 1) for r in runs[arm]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder", help="a registered encoder version's folder (holds version.json); default: "
                        "pretrain sfm/configs/quality_cpu.toml first")
    parser.add_argument("--config", default=str(ROOT / "sfm" / "configs" / "quality_cpu.toml"),
                        help="the pretrain flow's config when --encoder is not given")
    parser.add_argument("--workdir", help="where the runs keep their data (default: a temporary folder)")
    parser.add_argument("--budgets", default="1,4", help="labelled training surveys per run")
    parser.add_argument("--seeds", type=int, default=3, help="paired seeds per budget")
    parser.add_argument("--heads", default="linear", help="segmentation heads to run (comma-separated)")
    parser.add_argument("--pool", type=int, default=8, help="labelled surveys the budgets draw from")
    parser.add_argument("--validation", type=int, default=4, help="separate validation surveys (early stopping)")
    parser.add_argument("--test", type=int, default=4, help="held-out test surveys")
    parser.add_argument("--shape", type=int, nargs=3, default=[64, 64, 64], help="each generated survey's IL XL NS")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    args = parser.parse_args()

    from sfm import storage
    from sfm.eval.labelled import LABELLED_SEED, TEST_SEED, VALIDATION_SEED, budget_volumes

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sfm-finetune-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    pretrain_seconds = None
    encoder = args.encoder
    if not encoder:
        from quality import run_quality_flow

        encoder, pretrain_seconds = run_quality_flow(Path(args.config), workdir / "pretrain")
    encoder = storage.normalize(encoder)
    record = json.loads(storage.read_bytes(storage.join(encoder, "version.json")))
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
                 "validation_surveys": args.validation, "test_surveys": args.test, "heads": {}}
    for head in args.heads.split(","):
        config = workdir / f"finetune-{head}.toml"
        config.write_text(recipe_toml(record["config"], head, args.threads))
        per_budget = {}
        for budget in budgets:
            runs: dict[str, list[dict]] = {"pretrained": [], "random": []}
            for seed in range(args.seeds):
                pairs = {"train": budget_volumes(pool, budget, seed), **fixed}
                for arm, ref in (("pretrained", encoder), ("random", "random")):
                    result = run_flow(workdir, config, ref, pairs, seed, f"bench-{head}")
                    runs[arm].append(result)
                    m = result["metrics"]
                    print(f"finetune bench: head {head} budget {budget} seed {seed} {arm}: AP {m['ap']:.4f} F1 "
                          f"{m['f1']:.4f} IoU {m['iou']:.4f} validation {m['validation_score']:.4f} step "
                          f"{m['chosen_step']} ({result['seconds']:.0f}s)", file=sys.stderr, flush=True)
            per_budget[str(budget)] = paired(runs)
        out["heads"][head] = per_budget
    out["recipe"] = json.loads(json.dumps(__import__("tomllib").loads(config.read_text())["finetune"]))
    out["seconds"] = time.perf_counter() - t0
    out["meets"] = {head: all(b["every_seed_gained"] for b in per.values()) for head, per in out["heads"].items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
