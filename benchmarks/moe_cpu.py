"""CPU: one MoE layer at LLaDA-MoE-7B-A1B shape, grouped experts (ragged_dot) vs all experts (dense).

LLaDA-MoE-7B-A1B's MoE layer: hidden 2048, 64 experts of width 1024, top-8, softmax router with no
renormalisation. For each batch of `--batches` tokens (one token per row, the decode regime) it
times `dlmjax.models.moe.moe_forward` with `implementation="grouped"` (assignments sorted by expert,
`jax.lax.ragged_dot`) and `"dense"` (every expert on every token, then the chosen outputs), jitted,
median of `--repeats` calls after `--warmup`, on random fp32 weights. It checks that both give the
same output (max |diff|) and writes a JSON results file with the command that made it.

Note: on CPU (jax 0.10) `ragged_dot` is lowered as a masked dense dot over all groups, so the
grouped path does the dense path's arithmetic plus the sort; on GPU/TPU it lowers to a grouped
matmul kernel. The numbers below say what CPU users get today.

    python benchmarks/moe_cpu.py --json benchmarks/results/moe_cpu/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dlmjax  # noqa: E402
from dlmjax.models import moe  # noqa: E402


def layer_config(args) -> dlmjax.ModelConfig:
    return dlmjax.ModelConfig(family="llada_moe", vocab_size=16, hidden_size=args.hidden, intermediate_size=8,
                              num_layers=1, num_heads=16, num_kv_heads=16, head_dim=args.hidden // 16,
                              attention="bidirectional", num_experts=args.experts, num_experts_per_tok=args.top_k,
                              moe_intermediate_size=args.width, moe_layers=(0,), router="softmax",
                              norm_topk_prob=False)


def time_call(fn, *xs, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*xs))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*xs))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    cfg = layer_config(args)
    rng = np.random.default_rng(0)
    d, e, f = args.hidden, args.experts, args.width
    router = jnp.asarray(rng.normal(size=(d, e)) * 0.02, jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(e, d, 2 * f)) * 0.02, jnp.float32)
    down = jnp.asarray(rng.normal(size=(e, f, d)) * 0.02, jnp.float32)
    paths = {name: jax.jit(lambda x, r, g, w, name=name: moe.moe_forward(x, r, None, g, w, cfg, name))
             for name in ("grouped", "dense")}
    rows = []
    for batch in args.batches:
        x = jnp.asarray(rng.normal(size=(batch, d)), jnp.float32)
        out = {name: fn(x, router, gate_up, down) for name, fn in paths.items()}
        ms = {name: time_call(fn, x, router, gate_up, down, warmup=args.warmup, repeats=args.repeats)
              for name, fn in paths.items()}
        row = dict(batch=batch, grouped_ms=round(ms["grouped"], 2), dense_ms=round(ms["dense"], 2),
                   dense_over_grouped=round(ms["dense"] / ms["grouped"], 2),
                   max_abs_diff=float(jnp.abs(out["grouped"] - out["dense"]).max()))
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = dict(command="python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
                  shape=dict(hidden=d, experts=e, expert_width=f, top_k=args.top_k, dtype="float32"),
                  machine=dict(platform=platform.platform(), cpus=os.cpu_count(), jax=jax.__version__,
                               backend=jax.default_backend()),
                  rows=rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
