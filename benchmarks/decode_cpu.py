"""Decoding speed per decoder at toy size on CPU, and the engine's per-step overhead.

For each decoder: steps/s (forwards per second), tokens/s, and
overhead = (time per step - pure block-forward time) / time per step, where time per step is
(wall - prefill) / (forwards - 1) of a warmed-up run and the pure forward is the same jitted
block forward against the same KV cache, timed alone. The engine's
forward that starts a row's next block also carries the finished block (2K tokens instead of
K), so that cost, which replaces a store forward, counts as overhead here. The overhead goal
(< 10%) is an accelerator's; on CPU at toy size (README: 24-38%) the numbers say where the
step's time goes, not whether it is fast.

    python benchmarks/decode_cpu.py [--batch 8] [--hidden 256] [--layers 4] [--repeats 10]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dlmjax, not an installed one
from common import peaked_random_model
from dlmjax.decoding import engine
from dlmjax.decoding.api import generate
from dlmjax.models.transformer import KVCache


def forward_timers(model, prompts, args):
    """Callables timing the pure forwards, each run `n` times inside one jit (no dispatch cost,
    like the engine's loop): (prefill seconds, block-forward seconds, store-forward seconds)."""
    geometry, canvas, rows = engine.plan_layout(prompts, block=args.block, max_new_tokens=args.max_new,
                                                block_causal=True, pad_id=0, mask_id=args.vocab - 1)
    graphdef, params = nnx.split(model)
    c, k, n = geometry.prefix, geometry.block, args.inner
    prefix = (canvas[:, :c], rows.positions[:, :c], rows.valid[:, :c])
    block = (canvas[:, c : c + k], rows.positions[:, c : c + k])

    def repeat(forward):
        # Each iteration's input depends on the last output, so XLA cannot hoist the forward;
        # the forwards reduce their whole output, so none of it is dead code.
        def body(_, carry):
            tokens, acc = carry
            out = forward(tokens)
            return tokens + (out > 1e30).astype(tokens.dtype), acc + out
        return lambda tokens: jax.lax.fori_loop(0, n, body, (tokens, jnp.zeros((), jnp.float32)))[1]

    @jax.jit
    def prefills(params, tokens, positions, valid):
        m = nnx.merge(graphdef, params)
        cache = KVCache.init(m.config, len(prompts), geometry.total)
        return repeat(lambda t: m(t, positions, valid_bl=valid, cache=cache, write_cache=True,
                                  compute_logits=False).cache.k[-1].sum())(tokens)

    @jax.jit
    def cache_after_prefill(params, tokens, positions, valid):
        m = nnx.merge(graphdef, params)
        cache = KVCache.init(m.config, len(prompts), geometry.total)
        return m(tokens, positions, valid_bl=valid, cache=cache, write_cache=True, compute_logits=False).cache

    @jax.jit
    def steps(params, cache, tokens, positions):
        m = nnx.merge(graphdef, params)
        return repeat(lambda t: m(t, positions, cache=cache).logits.sum())(tokens)

    @jax.jit
    def stores(params, cache, tokens, positions):
        m = nnx.merge(graphdef, params)
        return repeat(lambda t: m(t, positions, cache=cache, write_cache=True,
                                  compute_logits=False).cache.k[-1].sum())(tokens)

    cache = cache_after_prefill(params, *prefix)

    def timed(fn, *a):
        jax.block_until_ready(fn(*a))  # compile
        start = time.perf_counter()
        jax.block_until_ready(fn(*a))
        return (time.perf_counter() - start) / n

    return lambda: (timed(prefills, params, *prefix), timed(steps, params, cache, *block),
                    timed(stores, params, cache, *block))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--inner", type=int, default=20, help="forwards per timed jit call")
    parser.add_argument("--head-scale", type=float, default=30.0)
    parser.add_argument("--decoders", nargs="+", default=["static", "static:k=2", "threshold:tau=0.9", "entropy:gamma=0.5"])
    args = parser.parse_args()

    print("command:", " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {platform.processor() or platform.machine()}")
    model = peaked_random_model("sdar", args, num_kv_heads=max(1, args.hidden // 64))
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, args.vocab - 1, args.prompt_len).tolist() for _ in range(args.batch)]
    time_forwards = forward_timers(model, prompts, args)
    results = {spec: [] for spec in args.decoders}
    forwards = []
    for spec in args.decoders:  # compile
        generate(model, prompts, decoder=spec, max_new_tokens=args.max_new)
    for _ in range(args.repeats):  # interleaved, so that background load hits every decoder alike
        forwards.append(time_forwards())
        for spec in args.decoders:
            results[spec].append(generate(model, prompts, decoder=spec, max_new_tokens=args.max_new))
    prefill_s, step_s, store_s = (statistics.median(f[i] for f in forwards) for i in range(3))
    print(f"model: SDAR-style, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, block {args.block}; "
          f"batch {args.batch} x prompt {args.prompt_len}, {args.max_new} new tokens; median of {args.repeats}")
    print(f"pure forwards (x{args.inner} inside one jit): prefill {prefill_s * 1e3:.2f} ms, "
          f"block step {step_s * 1e3:.2f} ms, store {store_s * 1e3:.2f} ms")
    print(f"{'decoder':<22}{'fwds':>6}{'wall ms':>10}{'ms/step':>10}{'steps/s':>10}{'tokens/s':>10}{'TPF':>7}{'overhead':>10}")
    for spec, runs in results.items():
        wall = statistics.median(r.wall_s for r in runs)
        r = runs[0]
        per_step = (wall - prefill_s) / (r.forwards - 1)
        overhead = (per_step - step_s) / per_step
        tokens = sum(row.num_tokens for row in r.rows)
        print(f"{spec:<22}{r.forwards:>6}{wall * 1e3:>10.1f}{per_step * 1e3:>10.2f}{r.forwards / wall:>10.1f}"
              f"{tokens / wall:>10.1f}{r.tpf:>7.2f}{overhead:>9.1%}")


if __name__ == "__main__":
    main()
