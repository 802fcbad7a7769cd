"""Fused projections (q/k/v as one matmul, gate/up as one) against separate matmuls.

At one layer's shape (default SDAR-1.7B: D=2048, H=16, Hkv=8, hd=128, F=6144), for a decode
chunk (4 tokens) and a prefill (512 tokens), in fp32 and bf16, batch 1:

- qkv: `x @ Wq`, `x @ Wk`, `x @ Wv` (three matmuls) against `split_qkv(x @ Wqkv)` (dlmjax's
  forward: one matmul, then the per-KV-group split), each reshaped to heads;
- gate_up: `silu(x @ Wg) * (x @ Wu)` against `swiglu(*split_gate_up(x @ Wgu))`.

Each variant is one `jax.jit` over `--layers` layers with their own weights (so that weights
are read from memory, not cache, as in a decode step), timed through `block_until_ready`: the
median of `--repeats` calls after `--warmup`, variants alternating. Both variants compute the
same numbers (checked). CPU time is not the target: the fusion is meant to save GPU kernel
launches at batch-1 decode; run this on a GPU for the number that matters.

    PYTHONPATH=. python benchmarks/fused_projections.py --out benchmarks/results/fused_projections
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import median_ms  # noqa: E402
from dlmjax.models.fused import join_gate_up, join_qkv, split_gate_up, split_qkv  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=6144)
    p.add_argument("--tokens", type=int, nargs="+", default=[4, 512])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="write results.json and results.md here")
    return p.parse_args(argv)


def layer_weights(args, dtype, seed: int):
    """(separate {q, k, v, gate, up}, fused {qkv, gate_up}) of one layer: the same numbers."""
    d, h, hkv, hd, f = args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate
    rng = np.random.default_rng(seed)
    w = {name: (rng.standard_normal((d, n), np.float32) * 0.02) for name, n in
         (("q", h * hd), ("k", hkv * hd), ("v", hkv * hd), ("gate", f), ("up", f))}
    fused = {"qkv": join_qkv(w["q"], w["k"], w["v"], hkv, hd), "gate_up": join_gate_up(w["gate"], w["up"])}
    cast = lambda tree: {k: jnp.asarray(v, dtype) for k, v in tree.items()}  # noqa: E731
    return cast(w), cast(fused)


def heads(y, n, hd):
    return y.reshape(*y.shape[:-1], n, hd)


def make_fns(args):
    hkv, hd, h = args.kv_heads, args.head_dim, args.heads

    def qkv_separate(x, layers):
        return [(heads(x @ w["q"], h, hd), heads(x @ w["k"], hkv, hd), heads(x @ w["v"], hkv, hd)) for w in layers]

    def qkv_fused(x, layers):
        out = []
        for w in layers:
            q, k, v = split_qkv(x @ w["qkv"], hkv, hd)
            out.append((heads(q, h, hd), heads(k, hkv, hd), heads(v, hkv, hd)))
        return out

    def mlp_separate(x, layers):
        return [jax.nn.silu(x @ w["gate"]) * (x @ w["up"]) for w in layers]

    def mlp_fused(x, layers):
        out = []
        for w in layers:
            gate, up = split_gate_up(x @ w["gate_up"])
            out.append(jax.nn.silu(gate) * up)
        return out

    return {"qkv": (jax.jit(qkv_separate), jax.jit(qkv_fused)), "gate_up": (jax.jit(mlp_separate), jax.jit(mlp_fused))}


def main(argv=None) -> int:
    args = parse_args(argv)
    fns = make_fns(args)
    rows = []
    for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        pairs = [layer_weights(args, dtype, seed) for seed in range(args.layers)]
        separate, fused = [p[0] for p in pairs], [p[1] for p in pairs]
        for tokens in args.tokens:
            x = jnp.asarray(np.random.default_rng(9).standard_normal((tokens, args.hidden), np.float32), dtype)
            for name, (sep_fn, fused_fn) in fns.items():
                diff = max(float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
                           for a, b in zip(jax.tree.leaves(sep_fn(x, separate)), jax.tree.leaves(fused_fn(x, fused))))
                sep_ms, fused_ms = [], []
                for _ in range(3):  # alternate so background load hits both alike
                    sep_ms.append(median_ms(lambda: sep_fn(x, separate), args.repeats, warmup=args.warmup))
                    fused_ms.append(median_ms(lambda: fused_fn(x, fused), args.repeats, warmup=args.warmup))
                row = dict(projection=name, dtype=dtype_name, tokens=tokens, layers=args.layers,
                           separate_ms=min(sep_ms), fused_ms=min(fused_ms), max_abs_diff=diff)
                row["speedup"] = row["separate_ms"] / row["fused_ms"]
                rows.append(row)
                print(f"{name:8s} {dtype_name:9s} {tokens:4d} tokens x {args.layers} layers: separate "
                      f"{row['separate_ms']:8.3f} ms  fused {row['fused_ms']:8.3f} ms  x{row['speedup']:.2f}  "
                      f"(max |diff| {diff:.1e})", flush=True)
    device = jax.devices()[0]
    meta = dict(command="PYTHONPATH=. python benchmarks/fused_projections.py " + shlex.join(sys.argv[1:]),
                jax=jax.__version__, device=f"{device.platform} {device.device_kind}", machine=platform.machine(),
                processor=platform.processor() or platform.machine(), cpu_count=__import__("os").cpu_count(),
                python=platform.python_version(), shape=dict(D=args.hidden, H=args.heads, Hkv=args.kv_heads,
                                                             hd=args.head_dim, F=args.intermediate))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (args.out / "results.md").write_text(markdown(meta, rows))
    return 0


def markdown(meta, rows) -> str:
    s = meta["shape"]
    lines = [
        f"`{meta['command']}`", "",
        f"jax {meta['jax']}, {meta['device']}, {meta['machine']} ({meta['cpu_count']} cores), Python {meta['python']}; "
        f"layer shape D={s['D']}, H={s['H']}, Hkv={s['Hkv']}, hd={s['hd']}, F={s['F']}; batch 1; median ms per call "
        f"over {rows[0]['layers']} layers (the best of 3 alternating rounds).", "",
        "CPU time is not the target: the fusion saves kernel launches of small GEMVs at batch-1 decode on a GPU, "
        "where the measurement is still owed.", "",
        "| projection | dtype | tokens | separate ms | fused ms | separate / fused | max abs diff |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['projection']} | {r['dtype']} | {r['tokens']} | {r['separate_ms']:.3f} | {r['fused_ms']:.3f} "
                     f"| {r['speedup']:.2f} | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
