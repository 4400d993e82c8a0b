"""Does more pretraining help? The quality configuration's recipe and variants of it pretrained side by
side on one GPU, each fine-tuned against random initialisation (issue 15).

    python benchmarks/gpu_quality.py            # one H100/H200-class GPU and 16 cores: about 9 minutes
    python benchmarks/gpu_quality.py --smoke    # CPU, a few steps: checks the script runs at all
    python benchmarks/gpu_quality.py --variants "base:;long:steps=16000;wide:batch=32,seed=1"

Needs torch, numpy and safetensors plus this checkout: no metaflow, zarr, segyio or boto3, so it runs on
a bare GPU machine. On 2 CPU cores one pretraining of the configuration takes ten minutes; here a dozen
run at once, so questions about the recipe (how many samples, which batch, which seed) get answers with
several pretraining seeds, which is what the gains need (they move by +/-0.03 AP between seeds).

Each variant is a name and overrides of the configuration's pretraining (``sfm/configs/quality_cpu.toml``):
``steps``, ``batch``, ``lr``, ``warmup``, ``mask``, ``surveys``, ``seed`` (the pretraining seed: init,
crops and masks), ``optimizer`` (adamw | muon) and ``muon_lr``. Its MAE is pretrained as ``sfm.train.trainer`` does it (``build_optimizer``, ``lr_at``
warmup and cosine decay, gradient clipping at 1.0, float32) on random crops of the configuration's
generated training surveys, held in GPU memory: origins uniform, flips and inline/crossline swap at
random, each survey clipped to its 0.1/99.9 percentiles and standardised (``sfm.eval.labelled.normalise``,
as ``sfm.data.crops`` does from the stored statistics). Then ``sfm.eval.downstream`` fine-tunes its
encoder on the GPU at budgets 1, 4 and 16 volumes, seeds 0-2, with the configuration's evaluation recipe
(probes off), beside one random-init arm per architecture.

Variants run in worker processes sharing the GPU (``--workers``); each prints its JSON line when done. The
last line is one JSON object: per variant the AP per budget and seed, the headline figures of
``sfm.eval.downstream.gains`` against the random arm (``ft_ap_gain_b<N>``, ``ft_min_gain_b<N>``,
``ft_all_seeds_gain_b<N>``, ...), the samples seen (steps x batch) and the seconds taken.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIG = os.path.join(ROOT, "sfm", "configs", "quality_cpu.toml")
KNOBS = {"steps": int, "batch": int, "lr": float, "warmup": int, "mask": float, "surveys": int, "seed": int,
         "optimizer": str, "muon_lr": float}
# The question of BENCHMARKS.md "Quality" (2026-12-04, GPU): the configuration over three pretraining seeds
# against 2x and 4x the samples seen, as a larger batch and as more steps.
DEFAULT_VARIANTS = ("base-s0:seed=0;base-s1:seed=1;base-s2:seed=2;batch16:batch=16;steps8k:steps=8000;"
                    "batch32-s0:batch=32,seed=0;batch32-s1:batch=32,seed=1;batch32-s2:batch=32,seed=2;"
                    "steps16k:steps=16000")
SMOKE_VARIANTS = "base:steps=6;half-batch:steps=6,batch=4,optimizer=adamw"  # the configuration pretrains with Muon


def parse_variants(spec: str) -> list[tuple[str, dict]]:
    """"name:key=val,key=val;name2:..." -> [(name, overrides)]; unknown keys fail with the valid ones."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        name, _, pairs = item.partition(":")
        if name == "random":
            raise SystemExit("variant name 'random' is the random-init arm's; name the variant otherwise")
        over = {}
        for pair in filter(None, pairs.split(",")):
            key, _, value = pair.partition("=")
            if key not in KNOBS:
                raise SystemExit(f"variant {name!r}: unknown setting {key!r}; use any of {', '.join(KNOBS)}")
            over[key] = KNOBS[key](value)
        out.append((name, over))
    return out


def recipe_for(job, smoke: bool) -> dict:
    """The configuration's pretraining settings, the knobs a variant overrides."""
    t, d = job.train, job.data
    base = {"steps": t.max_steps, "batch": d.batch_size, "lr": t.lr, "warmup": t.warmup_steps,
            "mask": job.model.mask_ratio, "surveys": job.synth.train_surveys, "seed": 0,
            "optimizer": t.optimizer, "muon_lr": t.muon_lr}
    if smoke:
        base.update(surveys=2)
    return base


def survey_file(folder: str, seed: int) -> str:
    return os.path.join(folder, f"survey-{seed}.npy")


def make_survey(args: tuple[str, int, tuple[int, int, int]]) -> None:
    """Generate training survey ``seed`` (as the flow's synth step does) and store it normalised."""
    import numpy as np

    from sfm.eval.labelled import normalise
    from sfm.synth.geology import synthesize_volume

    folder, seed, shape = args
    path = survey_file(folder, seed)
    if not os.path.exists(path):
        np.save(path + ".part.npy", normalise(synthesize_volume(shape, seed)[0]))
        os.replace(path + ".part.npy", path)


def pretrain(job, v: dict, device: str, folder: str):
    """The MAE of the configuration pretrained with settings ``v``: (model on ``device``, mean loss of
    the last tenth of the steps, seconds)."""
    import numpy as np
    import torch

    from sfm.model import MaskedAutoencoder3D, model_config_for
    from sfm.train.step import build_optimizer, lr_at

    cfg = dataclasses.replace(model_config_for(job), mask_ratio=v["mask"])
    torch.manual_seed(v["seed"])
    model = MaskedAutoencoder3D(cfg).to(device)
    t = job.train
    optimizer = build_optimizer(model, lr=v["lr"], weight_decay=t.weight_decay, betas=t.betas,
                                algorithm=v["optimizer"], muon_lr=v["muon_lr"])
    peaks = [group["lr"] for group in optimizer.param_groups]  # Muon's matrices have their own peak rate
    surveys = torch.stack([torch.from_numpy(np.load(survey_file(folder, k))) for k in range(v["surveys"])]).to(device)
    n_surveys, shape = surveys.shape[0], surveys.shape[1:]
    crop = cfg.crop
    rng = torch.Generator().manual_seed(1_000 + v["seed"])
    swap_ok = crop[0] == crop[1]
    losses, t0 = [], time.perf_counter()
    for step in range(v["steps"]):
        which = torch.randint(n_surveys, (v["batch"],), generator=rng).tolist()
        origin = [torch.randint(s - c + 1, (v["batch"],), generator=rng).tolist() for s, c in zip(shape, crop)]
        flips = torch.randint(2, (v["batch"], 3), generator=rng).tolist()
        crops = []
        for b, s in enumerate(which):
            i, j, k = origin[0][b], origin[1][b], origin[2][b]
            x = surveys[s, i:i + crop[0], j:j + crop[1], k:k + crop[2]]
            x = x.flip(0) if flips[b][0] else x
            x = x.flip(1) if flips[b][1] else x
            crops.append(x.transpose(0, 1) if swap_ok and flips[b][2] else x)
        imgs = torch.stack(crops)[:, None].contiguous()
        factor = lr_at(step, lr=v["lr"], min_lr=t.min_lr, warmup_steps=v["warmup"], max_steps=v["steps"]) / v["lr"]
        for group, peak in zip(optimizer.param_groups, peaks):
            group["lr"] = peak * factor
        loss = model(imgs)[0]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf"))
        optimizer.step()
        if step >= v["steps"] - max(1, v["steps"] // 10):
            losses.append(loss.detach())
    return model, float(torch.stack(losses).mean()), time.perf_counter() - t0


def run_variant(args: tuple) -> dict:
    """One worker job: pretrain (unless the variant is the random arm) and fine-tune at every budget and seed."""
    name, over, device, folder, smoke = args
    import torch

    torch.set_num_threads(1)
    from sfm.config import JobConfig
    from sfm.eval import downstream
    from sfm.eval.labelled import budget_volumes, evaluation_pool, evaluation_test, evaluation_validation
    from sfm.model import model_config_for

    job = JobConfig.from_toml(CONFIG)
    v = {**recipe_for(job, smoke), **over}
    recipe = dataclasses.replace(job.eval, probes=False, budgets=(1, 4) if smoke else (1, 4, 16))
    seeds = 1 if smoke else recipe.seeds
    if smoke:
        recipe = dataclasses.replace(recipe, test_volumes=1, validation_volumes=1, pool_volumes=4, volume=(32, 32, 64),
                                     finetune=dataclasses.replace(recipe.finetune, steps=4, validate_every=2,
                                                                  mirror=False))
    pool, test, validation = evaluation_pool(recipe), evaluation_test(recipe), evaluation_validation(recipe)
    t0 = time.perf_counter()
    record = {"name": name, "overrides": over}
    if name == "random":
        cfg, state = model_config_for(job), None  # the random arm
    else:
        model, loss, seconds = pretrain(job, v, device, folder)
        cfg, state = model.cfg, {k: x.detach().cpu() for k, x in model.state_dict().items()}
        record.update(samples_seen=v["steps"] * v["batch"], final_loss=round(loss, 4), pretrain_s=round(seconds, 1))
    scores: dict[str, list[dict[str, float]]] = {}  # per budget, the fine-tuned scores of each seed
    for budget in recipe.budgets:
        for seed in range(seeds):
            volumes = downstream.RunVolumes(budget_volumes(pool, budget, seed), test, validation)
            run = downstream.one_run(cfg, state, volumes, recipe, seed, device=device)
            scores.setdefault(str(budget), []).append(run["ft"])
    record.update(ap={b: [round(s["ap"], 4) for s in runs] for b, runs in scores.items()}, scores=scores,
                  seconds=round(time.perf_counter() - t0, 1))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=None, help=f"name:key=val,...;... (default: {DEFAULT_VARIANTS})")
    parser.add_argument("--workers", type=int, default=12, help="variants pretrained at once on the GPU")
    parser.add_argument("--smoke", action="store_true", help="CPU, a few steps: checks the script runs")
    parser.add_argument("--data", default="/tmp/sfm-gpu-quality", help="folder for the generated surveys")
    args = parser.parse_args()
    import torch

    from sfm.config import JobConfig

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    variants = parse_variants(args.variants or (SMOKE_VARIANTS if args.smoke else DEFAULT_VARIANTS))
    job = JobConfig.from_toml(CONFIG)
    base = recipe_for(job, args.smoke)
    t0 = time.perf_counter()
    os.makedirs(args.data, exist_ok=True)
    count = max({**base, **over}["surveys"] for _, over in variants)
    shape = tuple(job.synth.shape)
    context = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 1), mp_context=context) as pool:
        list(pool.map(make_survey, [(args.data, k, shape) for k in range(count)]))
    surveys_s = time.perf_counter() - t0
    jobs = [("random", {})] + variants
    records = []
    with cf.ProcessPoolExecutor(max_workers=max(1, min(args.workers, len(jobs))), mp_context=context) as pool:
        futures = [pool.submit(run_variant, (name, over, device, args.data, args.smoke)) for name, over in jobs]
        for future in cf.as_completed(futures):
            records.append(future.result())
            print(json.dumps(records[-1]), flush=True)
    from sfm.eval.downstream import gains

    by_name = {r["name"]: r for r in records}
    random_arm = by_name["random"]
    rows = []
    for r in (by_name[name] for name, _ in variants):
        headline = {}
        for budget, runs in r.pop("scores").items():
            headline.update(gains({"ft_pretrained": runs, "ft_random": random_arm["scores"][budget]}, int(budget)))
        rows.append({**r, **headline})
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "smoke": args.smoke,
                      "config": os.path.relpath(CONFIG, ROOT), "base": base, "random": random_arm["ap"], "variants": rows,
                      "surveys_s": round(surveys_s, 1), "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
