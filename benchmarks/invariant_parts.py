"""Where the batch-invariant numerics' time goes (issue 16): each part of a decode-step layer at
SDAR-1.7B shape timed alone, and one whole decoder layer, fast vs invariant (the whole step:
benchmarks/exactness.py).

Each part runs `--chain` times in one program (each call fed the last one's output, so none can be
hoisted), median of `--repeats` calls, divided by the chain: the host's dispatch counts once.
A lax.map of `min_tiles` iterations of `x + 1` gives the cost of a tile loop itself.

    PYTHONPATH=. python benchmarks/invariant_parts.py               # on a GPU
    PYTHONPATH=. python benchmarks/invariant_parts.py --shape sdar-mini   # CPU smoke run

On CPU wall time is not the target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, as `python benchmarks/X.py`

import dlmjax
from benchmarks.decode_throughput import SHAPES
from dlmjax import arithmetic
from dlmjax.models import layers
from dlmjax.models.transformer import Block

MODES = {"fast": dict(invariant=False), "invariant": dict(invariant=True)}


def chained_ms(fn, x, chain: int, repeats: int) -> float:
    @jax.jit
    def program(x):
        for _ in range(chain):
            x = fn(x)
        return x

    jax.block_until_ready(program(x))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(x))
        times.append(1e3 * (time.perf_counter() - start) / chain)
    return statistics.median(times)


def parts(shape: dict, rows: int, cache_len: int, key):
    """{name: (function of one array to the same shape, its input)} for a step of `rows` batch rows
    of 4 tokens: the matmuls (gate_up and down of the MLP, qkv), the RMSNorm, RoPE, SwiGLU, the
    attention against `cache_len` cached keys, an empty tile loop and a whole decoder layer."""
    d, f, h, kv = (shape[k] for k in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads"))
    hd, m, bf = 128, rows * 4, jnp.bfloat16
    ks = jax.random.split(key, 8)
    w_up = jax.random.normal(ks[0], (d, 2 * f), bf) * 0.02
    w_down = jax.random.normal(ks[1], (2 * f, d), bf) * 0.02
    w_qkv = jax.random.normal(ks[2], (d, (h + 2 * kv) * hd), bf) * 0.02
    w_back = jax.random.normal(ks[3], ((h + 2 * kv) * hd, d), bf) * 0.02
    x_md = jax.random.normal(ks[4], (m, d), bf)
    k = jax.random.normal(ks[5], (rows, cache_len, kv, hd), bf)
    v = jax.random.normal(ks[6], (rows, cache_len, kv, hd), bf)
    q = jax.random.normal(ks[7], (rows, 4, h, hd), bf)
    visible = jnp.ones((rows, 4, cache_len), bool)
    cos, sin = layers.rope_angles(jnp.broadcast_to(jnp.arange(4) + cache_len, (rows, 4)), hd, 1e6)

    cfg = dlmjax.ModelConfig(family="sdar", vocab_size=1024, head_dim=hd, attention="block_causal", block_size=4,
                             qk_norm=True, mask_token_id=1023, dtype="bfloat16", **{**shape, "num_layers": 1})
    block = Block(cfg, rngs=nnx.Rngs(0))
    self_visible = jnp.ones((rows, 4, 4), bool)

    def layer(x):
        return block(x, cos, sin, self_visible, cached=(k, v, visible))[0]

    def loop(x):
        return jax.lax.map(lambda t: t + 1, arithmetic.row_tiles(x, 128)).reshape(-1, x.shape[1])[: x.shape[0]]

    return {
        "mlp matmuls (gate_up, down)": (lambda x: arithmetic.matmul(arithmetic.matmul(x, w_up), w_down), x_md),
        "qkv matmul and back": (lambda x: arithmetic.matmul(arithmetic.matmul(x, w_qkv), w_back), x_md),
        "rms norm": (lambda x: layers.rms_norm(x, 1.0, 1e-6), x_md),
        "swiglu": (lambda x: arithmetic.rowwise(lambda g, u: jax.nn.silu(g) * u, x, x), x_md),
        "rope": (lambda x: layers.apply_rope(x, cos, sin), q),
        "attention": (lambda x: layers.attention(x, [(k, v, visible)]), q),
        "empty tile loop": (loop, x_md),
        "decoder layer": (layer, x_md.reshape(rows, 4, d)),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="sdar-1.7b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--cache", type=int, default=516)
    p.add_argument("--chain", type=int, default=20)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind})")
    print("| part | batch | fast ms | invariant ms | invariant / fast |\n|---|---:|---:|---:|---:|", flush=True)
    for batch in args.batches:
        # the numerics are read when a part's program is traced, inside chained_ms: one set of
        # inputs serves both modes
        for name, (fn, x) in parts(SHAPES[args.shape], batch, args.cache, jax.random.key(0)).items():
            ms = {}
            for mode, setting in MODES.items():
                with dlmjax.numerics(**setting):
                    ms[mode] = chained_ms(fn, x, args.chain, args.repeats)
            print(f"| {name} | {batch} | {ms['fast']:.4f} | {ms['invariant']:.4f} | "
                  f"{ms['invariant'] / ms['fast']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
