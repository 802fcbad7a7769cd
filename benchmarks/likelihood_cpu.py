"""CPU: the block-causal log-likelihood scorer (lm-eval's loglikelihood on SDAR, LLaDA2, Fast-dLLM
v2) against the one forward of the training layout `[noisy ; clean]` it replaced.

One batch of `--patterns` masking patterns (lm-eval's `mc_batch`, 32 by default) of one request:
a context of `--contexts` tokens and a continuation of `--continuation` tokens, each pattern
masking about half of the continuation. Both scorers read the same continuation window:

- layout: every pattern's row of 2L columns, [noisy ; clean], in one forward with
  `objectives.block_diffusion_visibility` (its [B, 2L, 2L] visibility, attention over 2L keys);
- cached (`likelihood.masked_logprobs`): the clean row forwarded once into a KV cache, then per
  pattern only the blocks that hold the continuation, packed side by side (as many as the
  context is long) against that cache.
  The clean forward serves every batch of a request: "cached" is a request's first batch (clean
  forward and patterns), "next" each further batch (`mc_num` / `mc_batch` batches in all).

For each it reports XLA's compiled FLOPs and temporary bytes (what the program allocates beside
its inputs and outputs: on an accelerator, what has to fit) and the median CPU time of
`--repeats` calls; max |diff| of the log-probs between the two. The model is random, SDAR-like
(qk norm, block-causal) at `--hidden`/`--layers`, fp32. CPU wall time is not the target (the
accelerators are); FLOPs and bytes carry over.

With `--compile-only SHAPE` (sdar-1.7b, sdar-8b) the model is `--layers` layers (1 by default) of
that shape in bf16 with its real vocabulary, never materialised: only the compiled FLOPs and
temporary bytes are reported.

    PYTHONPATH=. python benchmarks/likelihood_cpu.py --contexts 128 512 1024 --out benchmarks/results/likelihood_cpu
    PYTHONPATH=. python benchmarks/likelihood_cpu.py --compile-only sdar-1.7b --contexts 512 2048 \
        --out benchmarks/results/likelihood_cpu
    PYTHONPATH=. python benchmarks/likelihood_cpu.py --compile-only sdar-1.7b --layers 28 --contexts 2048 \
        --out benchmarks/results/likelihood_cpu
    PYTHONPATH=. python benchmarks/likelihood_cpu.py --compile-only sdar-1.7b --layers 28 --contexts 2048 \
        --block 32 --continuation 32 --out benchmarks/results/likelihood_cpu
    PYTHONPATH=. python benchmarks/likelihood_cpu.py --contexts 128 512 1024 --block 32 --continuation 32 \
        --out benchmarks/results/likelihood_cpu
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import median_ms, peaked_random_model, write_results  # noqa: E402
from benchmarks.decode_throughput import SHAPES  # noqa: E402
from dlmjax import ModelConfig  # noqa: E402
from dlmjax.lm_eval import likelihood  # noqa: E402
from dlmjax.models.transformer import abstract_model, take_rows  # noqa: E402
from dlmjax.train.objectives import block_diffusion_visibility, noisy_half_hidden  # noqa: E402


@partial(jax.jit, static_argnames=("graphdef", "span", "block_size", "mask_id"))
def first_batch_scores(graphdef, params, clean_l, masked_bl, valid_l, first, context_l, *, span, block_size, mask_id):
    """A request's first batch of the cached scorer: its clean forward, then the patterns."""
    state = likelihood._clean_state(graphdef, params, clean_l[None], valid_l, block_size=block_size)
    return likelihood._masked_scores(graphdef, params, clean_l, masked_bl, valid_l, first, context_l, state, span=span,
                                     block_size=block_size, mask_id=mask_id)


@partial(jax.jit, static_argnames=("graphdef", "span", "block_size", "mask_id"))
def layout_scores(graphdef, params, clean_bl, masked_bl, valid_bl, first, *, span, block_size, mask_id):
    """log p(clean token) at the `span` positions from `first` [B, span], from one forward of the
    rows `[noisy ; clean]` (the scorer before the cached one)."""
    model = nnx.merge(graphdef, params)
    b, l = clean_bl.shape
    positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    out = model(jnp.concatenate([jnp.where(masked_bl, mask_id, clean_bl), clean_bl], axis=1),
                jnp.concatenate([positions, positions], axis=1),
                visible_bll=block_diffusion_visibility(positions, valid_bl, block_size), compute_logits=False)
    hidden = noisy_half_hidden(out.hidden, block_size, model.config.shift_logits)
    first_b = jnp.full((b,), first, jnp.int32)
    return likelihood.token_logprobs(model, take_rows(hidden, first_b, span), take_rows(clean_bl, first_b, span))[0]


def compiled_costs(jitted, *args, **kwargs) -> dict:
    compiled = jitted.lower(*args, **kwargs).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return dict(gflops=round(float(cost.get("flops", float("nan"))) / 1e9, 3),
                temp_mib=round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1))


def measure(model, context: int, args, rng) -> dict:
    cfg = model.config
    total = context + args.continuation
    clean = rng.integers(3, cfg.vocab_size - 1, total).astype(np.int32)
    masked = np.zeros((args.patterns, total), bool)
    masked[:, context:] = rng.random((args.patterns, args.continuation)) < 0.5
    masked[:, context] = True
    width = likelihood._bucket(total)
    tokens, valid = likelihood._pad_rows([clean.tolist()], width, 0)
    mask = np.pad(masked, ((0, 0), (0, width - total)))
    span = min(likelihood._bucket(args.continuation), width)
    first = np.int32(min(context, width - span))
    graphdef, params = nnx.split(model)
    static = dict(span=span, block_size=cfg.block_size, mask_id=cfg.mask_token_id)
    cached_args = (graphdef, params, tokens[0], mask, valid[0], first, np.zeros(width, bool))
    state_of = partial(likelihood._clean_state, graphdef, block_size=cfg.block_size)
    state = (jax.eval_shape(state_of, params, tokens[:1], valid[0]) if args.compile_only
             else state_of(params, tokens[:1], valid[0]))
    layout_args = (graphdef, params, np.repeat(tokens, args.patterns, 0), mask, np.repeat(valid, args.patterns, 0),
                   first)
    runs = {"cached": (first_batch_scores, cached_args), "next": (likelihood._masked_scores, (*cached_args, state)),
            "layout": (layout_scores, layout_args)}
    row = dict(context=context, continuation=args.continuation, patterns=args.patterns, width=width)
    scores = {}
    for name, (fn, fn_args) in runs.items():
        row[name] = compiled_costs(fn, *fn_args, **static)
        if not args.compile_only:
            scores[name] = np.asarray(fn(*fn_args, **static))
            call = partial(fn, *fn_args, **static)
            row[name]["cpu_ms"] = round(median_ms(call, args.repeats), 2)
    if args.compile_only:
        row["layout_over_cached"] = {key: round(row["layout"][key] / row["cached"][key], 1)
                                     for key in ("gflops", "temp_mib")}
        return row
    read = mask[:, first : first + span]
    row["max_abs_diff"] = float(np.abs(np.where(read, scores["cached"] - scores["layout"], 0.0)).max())
    row["layout_over_cached"] = {key: round(row["layout"][key] / row["cached"][key], 1)
                                 for key in ("gflops", "temp_mib", "cpu_ms")}
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1536])
    parser.add_argument("--continuation", type=int, default=8)
    parser.add_argument("--patterns", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, help="4 (random model) or 1 (--compile-only)")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--block", type=int, default=4, help="SDAR's block (LLaDA2: 32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile-only", choices=sorted(set(SHAPES) - {"sdar-mini"}),
                        help="one layer of this shape, bf16, compiled only (FLOPs and temporary bytes)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    if args.compile_only:
        args.layers = args.layers or 1
        shape = dict(SHAPES[args.compile_only], num_layers=args.layers)
        model = abstract_model(ModelConfig(family="sdar", vocab_size=151936, head_dim=128, attention="block_causal",
                                           block_size=args.block, qk_norm=True, mask_token_id=151669,
                                           pad_token_id=151643, max_position_embeddings=32768, dtype="bfloat16",
                                           **shape))
        args.hidden, args.vocab = shape["hidden_size"], 151936
    else:
        args.layers = args.layers or 4
        model = peaked_random_model("sdar", argparse.Namespace(**vars(args), head_scale=1.0), num_kv_heads=2)
    rng = np.random.default_rng(0)
    rows = []
    for context in args.contexts:
        rows.append(measure(model, context, args, rng))
        print(rows[-1], flush=True)
    command = "PYTHONPATH=. python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    record = dict(command=command, machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                                                jax=jax.__version__, backend=jax.default_backend()),
                  model=dict(shape=args.compile_only or "random", hidden=args.hidden, layers=args.layers,
                             vocab=args.vocab, block=args.block, dtype="bfloat16" if args.compile_only else "float32"),
                  rows=rows)
    model_words = (f"{args.layers} {args.compile_only} layer(s) (hidden {args.hidden}, vocab {args.vocab}), bf16, "
                   "compiled only"
                   if args.compile_only else
                   f"Random SDAR-like model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, fp32")
    lines = [f"# Block-causal likelihood scorer: cached vs the [noisy ; clean] layout ({jax.default_backend()})", "",
             f"`{command}`", "",
             f"{model_words}; block {args.block}; jax {jax.__version__}, {os.cpu_count()} CPUs. One batch of "
             f"{args.patterns} masking patterns of a {args.continuation}-token continuation: cached is a request's "
             "first batch (the clean forward and the patterns), next each further batch. CPU time is not the "
             "target; FLOPs and temporary bytes are what carry over to an accelerator.", ""]
    timed = not args.compile_only
    lines += ["| context | layout GFLOP | cached GFLOP | next GFLOP | layout temp MiB | cached temp MiB | next temp MiB"
              + (" | layout ms | cached ms | next ms | max abs diff |" if timed else " |"),
              "|---|---|---|---|---|---|---" + ("|---|---|---|---|" if timed else "|")]
    for r in rows:
        lay, cac, nxt = r["layout"], r["cached"], r["next"]
        lines.append(f"| {r['context']} | {lay['gflops']} | {cac['gflops']} | {nxt['gflops']} | {lay['temp_mib']} | "
                     f"{cac['temp_mib']} | {nxt['temp_mib']} |"
                     + (f" {lay['cpu_ms']} | {cac['cpu_ms']} | {nxt['cpu_ms']} | {r['max_abs_diff']:.1e} |"
                        if timed else ""))
    print("\n".join(lines))
    if args.out:
        name = f"{args.compile_only}-layers{args.layers}" if args.compile_only else "random"
        write_results(args.out, f"cpu-{name}-block{args.block}", record, lines)
    return record


if __name__ == "__main__":
    main()
