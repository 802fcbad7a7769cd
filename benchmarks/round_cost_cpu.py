"""The cost of one decoding round at long context on CPU: the wall time of generating
`--long` new tokens minus that of `--short`, over the extra forwards (prefill and compile cancel
out; best of `--repeats` warmed-up runs each). A random SDAR-shaped model (benchmarks/common.py),
static decoding, one token per forward, so every extra round is one forward over the block
against a cache of about `--prompt-len` slots per row; with `--family qwen3 --decoder ar`, a
causal model decoded token by token; with `--family qwen3 --decoder drafter`, speculative rounds
of a random one-layer DFlash drafter (block `--block`) and the target's verification forward.

    python benchmarks/round_cost_cpu.py [--prompt-len 1024] [--batch 32] [--family qwen3 --decoder ar|drafter]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dlmjax, not an installed one
from common import peaked_random_model  # noqa: E402
from dlmjax.decoding.api import generate  # noqa: E402
from dlmjax.heads.drafter import DrafterConfig, init_drafter  # noqa: E402


def best_wall(model, prompts, decoder: str, max_new: int, repeats: int, drafter=None):
    generate(model, prompts, decoder=decoder, max_new_tokens=max_new, drafter=drafter)  # compile
    walls, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = generate(model, prompts, decoder=decoder, max_new_tokens=max_new, drafter=drafter)
        walls.append(time.perf_counter() - start)
    return min(walls), result.forwards


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=40)
    parser.add_argument("--decoder", default="static")
    parser.add_argument("--family", default="sdar", choices=["sdar", "qwen3"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    shape = types.SimpleNamespace(vocab=512, hidden=args.hidden, layers=args.layers, block=args.block, head_scale=30.0)
    model = peaked_random_model(args.family, shape, num_kv_heads=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, args.prompt_len).tolist() for _ in range(args.batch)]
    drafter = None
    if args.decoder.startswith("drafter"):
        drafter = init_drafter(DrafterConfig.for_target(model.config, num_layers=1, block_size=args.block))
    short_wall, short_forwards = best_wall(model, prompts, args.decoder, args.short, args.repeats, drafter)
    long_wall, long_forwards = best_wall(model, prompts, args.decoder, args.long, args.repeats, drafter)
    row = dict(prompt_len=args.prompt_len, batch=args.batch, family=args.family, decoder=args.decoder,
               ms_per_round=round(1e3 * (long_wall - short_wall) / (long_forwards - short_forwards), 2),
               forwards=[short_forwards, long_forwards], wall_ms=[round(1e3 * short_wall), round(1e3 * long_wall)],
               jax=jax.__version__, backend=jax.default_backend())
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
