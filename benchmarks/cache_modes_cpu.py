"""Bidirectional cache modes (none / prefix / dual) on a LLaDA-shaped model on CPU: wall time,
tokens/s and drift, i.e. the share of generated tokens that differ from the exact mode.

The model is random (head scaled up so that its distributions are peaked, like a trained
model's); drift on a trained model can differ: rerun this on a real checkpoint with --model.

    python benchmarks/cache_modes_cpu.py [--model DIR] [--batch 8] [--max-new 64] [--block 16]
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
from dlmjax.evaluation.runner import token_agreement


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a bidirectional checkpoint dir (default: random LLaDA-shaped)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--head-scale", type=float, default=30.0)
    parser.add_argument("--decoder", default="static", help="base decoder spec, e.g. threshold:tau=0.9")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("command:", " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")

    model = dlmjax.load_model(args.model) if args.model else peaked_random_model("llada", args, num_kv_heads=args.hidden // 32)
    rng = np.random.RandomState(0)
    prompts = [random_prompt(rng, model.config, args.prompt_len - i) for i in range(args.batch)]
    sep = "," if ":" in args.decoder else ":"
    specs = {mode: f"{args.decoder}{sep}block={args.block},cache={mode}" for mode in ("none", "prefix", "dual")}
    runs = {mode: [] for mode in specs}
    for spec in specs.values():
        generate(model, prompts, decoder=spec, max_new_tokens=args.max_new)  # compile
    for _ in range(args.repeats):
        for mode, spec in specs.items():
            runs[mode].append(generate(model, prompts, decoder=spec, max_new_tokens=args.max_new))
    exact = [row.tokens for row in runs["none"][0].rows]
    print(f"{'cache':<8}{'NFE':>6}{'wall ms':>10}{'tokens/s':>10}{'speedup':>9}{'token drift':>13}")
    base = statistics.median(r.wall_s for r in runs["none"])
    for mode, rs in runs.items():
        wall = statistics.median(r.wall_s for r in rs)
        got = [row.tokens for row in rs[0].rows]
        drift = 1 - token_agreement(zip(got, exact))  # over each row's longer generation
        tokens = sum(len(t) for t in got)
        print(f"{mode:<8}{rs[0].forwards:>6}{wall * 1e3:>10.1f}{tokens / wall:>10.1f}{base / wall:>8.2f}x{drift:>12.1%}")


if __name__ == "__main__":
    main()
