"""CPU: one MoE layer at LLaDA-MoE-7B-A1B shape: the grouped experts as they run on CPU (tiled),
through ragged_dot (what runs on TPU), and every expert on every token (dense: what runs on GPU).

LLaDA-MoE-7B-A1B's MoE layer: hidden 2048, 64 experts of width 1024, top-8, softmax router with no
renormalisation. For each count of `--tokens` tokens it times the routed layer (router, experts,
weighted sum) with the experts computed by `dlmjax.models.moe.tiled_rows` (the CPU path of
"grouped": each expert's rows in tiles, only the chosen experts read), `moe.ragged_rows`
(`jax.lax.ragged_dot`, which jax 0.10 lowers on CPU to a masked dense dot over every expert) and
`moe.dense_expert_outputs`, jitted, median of `--repeats` calls after `--warmup`, on random fp32
weights. It checks that all give the same output (max |diff| against dense) and writes a JSON
results file with the command that made it. A decode forward of a diffusion LM carries a block of
tokens per row (32 for LLaDA-MoE), so 256 tokens is 8 rows.

    python benchmarks/moe_cpu.py --json benchmarks/results/moe_cpu/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dlmjax  # noqa: E402
from benchmarks.common import median_ms  # noqa: E402
from dlmjax.models import moe  # noqa: E402


def layer_config(args) -> dlmjax.ModelConfig:
    return dlmjax.ModelConfig(family="llada_moe", vocab_size=16, hidden_size=args.hidden, intermediate_size=8,
                              num_layers=1, num_heads=16, num_kv_heads=16, head_dim=args.hidden // 16,
                              attention="bidirectional", num_experts=args.experts, num_experts_per_tok=args.top_k,
                              moe_intermediate_size=args.width, moe_layers=(0,), router="softmax",
                              norm_topk_prob=False)


def rows_through(rows_fn):
    """An experts function (x [T, D], experts [T, k], ...) -> [T, k, D] from a rows function."""
    def experts_fn(x_td, experts_tk, gate_up, down):
        t, k = experts_tk.shape
        return rows_fn(jnp.repeat(x_td, k, axis=0), experts_tk.reshape(-1), gate_up, down).reshape(t, k, -1)
    return experts_fn


EXPERTS = {"tiled": rows_through(moe.tiled_rows), "ragged": rows_through(moe.ragged_rows),
           "dense": moe.dense_expert_outputs}


def routed_layer(x_td, router_de, gate_up, down, cfg, experts_fn):
    weights_tk, experts_tk = moe.route(cfg, x_td @ router_de)
    return moe.combine(experts_fn(x_td, experts_tk, gate_up, down), weights_tk)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
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
    paths = {name: jax.jit(lambda x, r, g, w, fn=fn: routed_layer(x, r, g, w, cfg, fn)) for name, fn in EXPERTS.items()}
    rows = []
    for tokens in args.tokens:
        x = jnp.asarray(rng.normal(size=(tokens, d)), jnp.float32)
        out = {name: fn(x, router, gate_up, down) for name, fn in paths.items()}
        ms = {name: median_ms(lambda: fn(x, router, gate_up, down), args.repeats, warmup=args.warmup)
              for name, fn in paths.items()}
        row = dict(tokens=tokens, **{f"{name}_ms": round(t, 2) for name, t in ms.items()},
                   dense_over_tiled=round(ms["dense"] / ms["tiled"], 2),
                   ragged_over_tiled=round(ms["ragged"] / ms["tiled"], 2),
                   max_abs_diff={name: float(jnp.abs(out[name] - out["dense"]).max()) for name in ("tiled", "ragged")})
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
