"""The frozen linear probe's solver: L-BFGS to the optimum (sfm.eval.downstream.train_linear_head) against the 300
full-batch AdamW steps it replaced, side by side on the same tokens, and what each does to the pretrain evaluation.

    python benchmarks/linear_probe.py --encoder sfm_data/registry/sfm-mae/v3   # a registered version's folder
    python benchmarks/linear_probe.py                                          # a random tiny encoder (timing only)

The probe is fitted at every label budget and paired seed of the default ``[eval]`` (generated labelled volumes:
sfm.eval.labelled) on the encoder's frozen tokens, and scored on the test volumes (AP, F1). Then the default pretrain
evaluation (:func:`sfm.eval.downstream.evaluate_downstream`: probes, LP-FT from the probe, fine-tuning of both arms)
runs once with each solver. The last line is one JSON object: per solver, the probe's CPU seconds per fit, its final
objective and held-out AP / F1 (mean over budgets and seeds), and the evaluation's wall seconds and fine-tuned AP per
budget and arm; ``probe_speedup`` (AdamW's seconds over L-BFGS's, per fit) and ``evaluation_speedup``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ADAM_STEPS = 300  # the solver the probe had before L-BFGS: full-batch AdamW, 10 % warm-up, cosine to 0


def adam_head(x_train, y_train, seed: int):
    """The probe as it was fitted before (300 AdamW steps at peak 1e-2, weight decay 1e-4), for comparison."""
    import torch
    from torch import nn

    from sfm.finetune.loop import balanced_bce
    from sfm.train.step import lr_at

    mean, std = x_train.mean(dim=(0, 1)), x_train.std(dim=(0, 1)) + 1e-6
    torch.manual_seed(seed)
    head = nn.Linear(x_train.shape[-1], y_train.shape[-1])
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2, weight_decay=1e-4)
    positive = float(y_train.mean())
    xs = (x_train - mean) / std
    for step in range(ADAM_STEPS):
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * lr_at(step, lr=1.0, min_lr=0.0, warmup_steps=ADAM_STEPS // 10, max_steps=ADAM_STEPS)
        loss = balanced_bce(head(xs), y_train, positive)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        head.bias -= head.weight @ (mean / std)
        head.weight /= std
    return head


def objective(head, x_train, y_train) -> float:
    """The class-balanced BCE of ``head`` (raw tokens) on the training tokens, without the ridge."""
    import torch

    from sfm.finetune.loop import balanced_bce

    with torch.no_grad():
        return float(balanced_bce(head(x_train), y_train, float(y_train.mean())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder", help="a registered encoder version's folder; default: a random tiny encoder "
                        "(the timings hold, the scores mean nothing)")
    parser.add_argument("--skip-evaluation", action="store_true", help="the probes alone")
    args = parser.parse_args()

    import numpy as np
    import torch

    from sfm.config import JobConfig
    from sfm.eval import downstream
    from sfm.eval.labelled import budget_volumes, evaluation_pool, evaluation_test
    from sfm.model import mae_config
    from sfm.model.io import load
    from sfm.model.mae import MaskedAutoencoder3D

    ev = JobConfig().eval
    if args.encoder:
        mae = load(args.encoder)
    else:
        torch.manual_seed(0)
        mae = MaskedAutoencoder3D(mae_config("tiny", crop=(32, 32, 32)))
    mae.eval()
    pool, test = evaluation_pool(ev), evaluation_test(ev)
    x_test, _, o_test = downstream.tokens_of(mae, test)
    solvers = {"adamw_300": adam_head, "lbfgs": downstream.train_linear_head}
    probes: dict[str, list[dict]] = {name: [] for name in solvers}
    for budget in ev.budgets:
        for seed in range(ev.seeds):
            train = budget_volumes(pool, budget, seed)
            tokens = downstream.tokens_of(mae, train)
            for name, solve in solvers.items():
                t0 = time.process_time()
                head = solve(tokens[0], tokens[1], seed)
                seconds = time.process_time() - t0
                scored = downstream.linear_probe(mae, head, tokens, (x_test, o_test), train, test)
                probes[name].append({"budget": budget, "seed": seed, "cpu_s": seconds, "ap": scored["ap"],
                                     "f1": scored["f1"], "objective": objective(head, tokens[0], tokens[1])})
                print(f"probe {name} budget {budget} seed {seed}: {seconds:.2f} CPU-s, objective "
                      f"{probes[name][-1]['objective']:.4f}, AP {scored['ap']:.4f}", file=sys.stderr)
    out: dict = {"encoder": args.encoder or "random tiny", "budgets": list(ev.budgets), "seeds": ev.seeds,
                 "tokens_per_volume": int(x_test.shape[0] * x_test.shape[1] // len(test))}
    for name, rows in probes.items():
        out[name] = {"probe_cpu_s_per_fit": float(np.mean([r["cpu_s"] for r in rows])),
                     "probe_objective": float(np.mean([r["objective"] for r in rows])),
                     "probe_ap": float(np.mean([r["ap"] for r in rows])),
                     "probe_f1": float(np.mean([r["f1"] for r in rows])),
                     "probes": rows}
    out["probe_speedup"] = out["adamw_300"]["probe_cpu_s_per_fit"] / out["lbfgs"]["probe_cpu_s_per_fit"]
    if not args.skip_evaluation:
        fitted = downstream.train_linear_head
        for name, solve in solvers.items():
            downstream.train_linear_head = solve  # the evaluation's probes and LP-FT start, this solver's
            try:
                t0 = time.perf_counter()
                result = downstream.evaluate_downstream(mae, ev, log=lambda line: print(line, file=sys.stderr))
                out[name]["evaluation_s"] = time.perf_counter() - t0
            finally:
                downstream.train_linear_head = fitted
            out[name]["evaluation"] = {k: v for k, v in result.items() if k.startswith(("ft_ap", "linear_ap"))}
        out["evaluation_speedup"] = out["adamw_300"]["evaluation_s"] / out["lbfgs"]["evaluation_s"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
