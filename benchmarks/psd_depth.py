"""PSD across draft depths: tokens per forward (TPF), NFE and wall time against the policy run
one step per forward (depth 1), with a check that every depth gives the same tokens.

Default model: a random SDAR-shaped model (head scaled so distributions are peaked, block 8).
Run on a trained block-causal checkpoint with --model DIR (accuracy there: `dlmjax eval`).

    python benchmarks/psd_depth.py [--model DIR] [--policies threshold,tau=0.9 topk,k=1 margin,margin=0.5] [--depths 1 2 4 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dlmjax, not an installed one
import dlmjax
from common import peaked_random_model, random_prompt
from dlmjax.decoding.api import generate


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--policies", nargs="+", default=["threshold,tau=0.9", "topk,k=1", "margin,margin=0.5"])
    parser.add_argument("--depths", nargs="+", type=int, default=None,
                        help="draft depths (default 1 2 4 8, those that fit the model's block)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--head-scale", type=float, default=30.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("command:", " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    model = dlmjax.load_model(args.model) if args.model else peaked_random_model("sdar", args, num_kv_heads=max(1, args.hidden // 64))
    rng = np.random.RandomState(0)
    prompts = [random_prompt(rng, model.config, args.prompt_len + i) for i in range(args.batch)]
    depths = args.depths or [d for d in (1, 2, 4, 8) if d <= (model.config.block_size or args.block)]
    print(f"{'policy':<22}{'depth':>6}{'fwds':>6}{'TPF':>7}{'wall ms':>10}{'same tokens':>13}")
    for policy in args.policies:
        reference = None
        for depth in depths:
            spec = f"psd:policy={policy},depth={depth}"
            generate(model, prompts, decoder=spec, max_new_tokens=args.max_new)  # compile
            runs = [generate(model, prompts, decoder=spec, max_new_tokens=args.max_new) for _ in range(args.repeats)]
            out = [row.tokens for row in runs[0].rows]
            reference = reference or out
            wall = statistics.median(r.wall_s for r in runs)
            print(f"{policy:<22}{depth:>6}{runs[0].forwards:>6}{runs[0].tpf:>7.2f}{wall * 1e3:>10.1f}"
                  f"{str(out == reference):>13}")


if __name__ == "__main__":
    main()
