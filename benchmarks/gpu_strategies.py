"""Each data-parallel strategy's step and memory on one GPU at world size 1 (issue 48), before a cluster run.

    python benchmarks/gpu_strategies.py              # one H100/H200-class GPU: about 3 minutes
    python benchmarks/gpu_strategies.py --smoke      # CPU (gloo, world size 1, tiny shapes, float32): checks it runs

The same measurement as ``benchmarks/strategies.py`` (its code): ``ddp``, ``fsdp2-zero2``, ``fsdp2-full``,
``deepspeed-zero2`` and ``deepspeed-zero3``, each in a fresh process with NCCL over one rank, the same model and batch,
full training steps as ``sfm.train.trainer`` runs them under bf16 (autocast; DeepSpeed's own ``bf16`` section, its
parameters in bf16 beside float32 masters), reporting ``samples_per_s``, ``state_bytes_per_rank``, ``peak_rss_mb``
and the peak GPU memory (``peak_mem_GiB``: parameters, gradients, optimiser state, buckets and activations). At world
size 1 nothing is divided between ranks, so the figures are what each strategy's step costs and carries besides the
shares a cluster run divides (e.g. ZeRO's float32 masters and buckets).

Needs only torch and the sfm modules that file imports (the model, the training step, the strategies; no metaflow,
zarr, segyio or boto3); the two DeepSpeed rows need DeepSpeed (``pip install 'sfm[deepspeed]'``) and are reported
as skipped without it. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from strategies import compare  # noqa: E402

from sfm.config import STRATEGIES  # noqa: E402

GPU = {"preset": "base", "crop": 128, "batch": 32, "steps": 10, "warmup": 3}
SMOKE = {"preset": "tiny", "crop": 32, "batch": 2, "steps": 1, "warmup": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, float32, tiny shapes: check the script runs")
    parser.add_argument("--preset", default=None, help=f"default {GPU['preset']}")
    parser.add_argument("--crop", type=int, default=None, help=f"default {GPU['crop']}")
    parser.add_argument("--batch", type=int, default=None, help=f"default {GPU['batch']}")
    parser.add_argument("--steps", type=int, default=None, help=f"timed steps (default {GPU['steps']})")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_strategies.py: no CUDA device; run on a GPU machine, or pass --smoke for a CPU check")
    settings = dict(SMOKE if args.smoke else GPU)
    settings.update({k: v for k in ("preset", "crop", "batch", "steps") if (v := getattr(args, k)) is not None})
    settings.update(device="cpu" if args.smoke else "cuda", bf16=not args.smoke, threads=1 if args.smoke else 4,
                    timeout_s=900)
    result = compare(settings, 1, args.strategies.split(","))
    result.update(benchmark="gpu_strategies", smoke=args.smoke,
                  device_name=torch.cuda.get_device_name(0) if not args.smoke else "cpu")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
