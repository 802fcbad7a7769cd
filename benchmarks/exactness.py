"""Exactness: what the batch-invariant numerics cost per forward, and how far the fast mode's tokens
drift from the reference decoders' (issue 16).

Part 1, cost: one decode-step forward (a block of `--block` tokens against a cache of `--prompt-len`
tokens, as BlockForwards.verify runs it) at batch 1, 16 and 64, fast vs invariant, median ms.
Part 2, agreement: on the same prompts, the fraction of rows whose tokens equal the reference's, and
of token positions that do, for
- PSD against its policy run one step per forward (lossless by construction),
- mrp-spec against static (lossless by construction),
- threshold at batch N against the same prompts one at a time,
in the fast mode and in the invariant mode.

    PYTHONPATH=. python benchmarks/exactness.py                            # toy-sdar (CPU)
    PYTHONPATH=. python benchmarks/exactness.py --shape sdar-1.7b          # random weights, bf16 (GPU)
    PYTHONPATH=. python benchmarks/exactness.py --shape sdar-1.7b --skip-cost --modes fast --prompts 16 \
        --max-new 32 --batches 16                                          # one part, one mode (a short GPU call)

Each row is printed as soon as it is measured, and a run stopped at its time limit (SIGINT) still writes
the rows it measured, with `finished: false` (a run that fails writes nothing).

On CPU wall time is not the target; the agreement is (the CPU's fast mode already rounds
differently by batch shape in fp32, so it can flip near-ties too).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, as `python benchmarks/X.py`

import dlmjax
from benchmarks.common import write_results, written_when_done_or_stopped
from benchmarks.decode_throughput import SHAPES, random_sdar
from dlmjax import arithmetic
from dlmjax.decoding import engine
from dlmjax.decoding.api import generate
from dlmjax.evaluation.runner import token_agreement
from dlmjax.evaluation.tasks import load_eval_set
from dlmjax.models.transformer import KVCache
from dlmjax.presets import load_checkpoint

MODES = {"fast": dict(invariant=False), "invariant": dict(invariant=True)}


@partial(arithmetic.jit, static_argnames="graphdef")
def _prefill(graphdef, state, prompts_bp, capacity):
    model = nnx.merge(graphdef, state)
    cache = KVCache.init(model.config, prompts_bp.shape[0], capacity.shape[0])
    positions = jnp.broadcast_to(jnp.arange(prompts_bp.shape[1]), prompts_bp.shape)
    return model(prompts_bp, positions, cache=cache, write_cache=True, compute_logits=False).cache


@partial(arithmetic.jit, static_argnames=("graphdef", "steps"))
def _steps(graphdef, state, block_bk, cache, steps: int):
    """`steps` decode-step forwards in one program, as the engine's loop runs them: each step's
    block is the previous step's greedy tokens, so no step can be hoisted out of the loop."""
    model = nnx.merge(graphdef, state)
    b, k = block_bk.shape
    positions = jnp.broadcast_to(cache.length + jnp.arange(k), (b, k))

    def step(_, blk):
        logits = model(blk, positions, cache=cache, chunk_parts=engine.copy_parts(1, k)).logits
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return jax.lax.fori_loop(0, steps, step, block_bk)


def step_inputs(model, batch: int, prompt_len: int, block: int):
    """(block of random tokens, KV cache of a random prompt) at `batch` rows. The prefill runs in the
    fast mode: it only sets up the cache that both modes' steps read."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = jnp.asarray(rng.integers(0, vocab - 2, (batch, prompt_len)), jnp.int32)
    block_bk = jnp.asarray(rng.integers(0, vocab - 2, (batch, block)), jnp.int32)
    with dlmjax.numerics(**MODES["fast"]):
        return block_bk, _prefill(graphdef, state, prompts, jnp.zeros(prompt_len + block))


def step_ms(model, block_bk, cache, repeats: int, steps: int = 8, trace_dir: str | None = None) -> float:
    """Median device ms of one decode-step forward over `block_bk`'s rows: `repeats` timings of
    `steps` chained steps in one program, each divided by `steps`, so the host's dispatch of a
    program (flattening the weights' pytree, launching) counts once per `steps`, as in the engine's
    loop where it counts once per generation. With `trace_dir`, one more call runs under jax's
    profiler, which writes its trace there (every kernel of the `steps` steps, with its time)."""
    graphdef, state = nnx.split(model)
    jax.block_until_ready(_steps(graphdef, state, block_bk, cache, steps))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(_steps(graphdef, state, block_bk, cache, steps))
        times.append(1e3 * (time.perf_counter() - start) / steps)
    if trace_dir is not None:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(_steps(graphdef, state, block_bk, cache, steps))
    return statistics.median(times)


def agreement(rows, reference_rows) -> tuple[float, float]:
    pairs = list(zip([r.tokens for r in rows], [r.tokens for r in reference_rows]))
    return sum(a == b for a, b in pairs) / len(pairs), token_agreement(pairs)


COMPARISONS = ("psd", "batch", "mrp-spec")


def agreement_runs(model, head, tokenizer, prompts, max_new: int, batch: int, comparisons=COMPARISONS):
    """(comparison, identical rows, token agreement) of `comparisons` in the current mode, each as soon as
    it is measured (mrp-spec only with a head)."""
    def run(decoder, batch_prompts):
        return generate(model, batch_prompts, tokenizer=tokenizer, decoder=decoder, max_new_tokens=max_new,
                        head=head).rows

    def batched(decoder):
        return [row for s in range(0, len(prompts), batch) for row in run(decoder, prompts[s:s + batch])]

    threshold = "threshold:tau=0.9"
    if "psd" in comparisons or "batch" in comparisons:
        threshold_rows = batched(threshold)
    if "psd" in comparisons:
        yield (f"psd:policy=threshold,tau=0.9,depth=3 vs {threshold}",
               *agreement(batched("psd:policy=threshold,tau=0.9,depth=3"), threshold_rows))
    if "batch" in comparisons:
        alone = [run(threshold, [p])[0] for p in prompts]
        yield f"{threshold} batch {batch} vs batch 1", *agreement(threshold_rows, alone)
    if "mrp-spec" in comparisons and head is not None:
        yield "mrp-spec:drafts=3 vs static", *agreement(batched("mrp-spec:drafts=3"), batched("static"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random SDAR-shaped weights (bf16) instead of toy-sdar")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512, help="cache length of the step forward (the agreement part's --shape prompts are 256 tokens)")
    p.add_argument("--max-new", type=int, default=None, help="default: 32 (toy-sdar), 128 (--shape)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-agreement", action="store_true")
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES),
                   help="the numerics modes whose agreement is measured (the cost compares both)")
    p.add_argument("--comparisons", nargs="+", choices=COMPARISONS, default=list(COMPARISONS),
                   help="the agreement part's comparisons: PSD vs its policy, batch N vs batch 1, mrp-spec vs static")
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results/exactness)")
    args = p.parse_args()
    device = jax.devices()[0]
    command = " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv])
    print("command:", command)
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind}), {platform.processor() or platform.machine()}")
    if args.shape:
        model, head = random_sdar(args.shape)
        rng = np.random.RandomState(0)
        prompts = [rng.randint(0, 150000, 256).tolist() for _ in range(args.prompts)]
        tokenizer, max_new, name = None, args.max_new or 128, f"random {args.shape} (bf16)"
    else:
        _, model, tokenizer, head = load_checkpoint("toy-sdar")
        half = args.prompts // 2
        items = load_eval_set("toy-arith", limit=args.prompts - half).items + load_eval_set("toy-constraint", limit=half).items
        prompts, max_new, name = [item.prompt for item in items], args.max_new or 32, "toy-sdar"
    block = model.config.block_size
    lines = [f"`{command}`", "", f"jax {jax.__version__}, {device.platform} {device.device_kind}, model {name}"]
    if not args.skip_cost:
        lines += ["", f"Decode-step forward ({block} tokens against {args.prompt_len} cached), median of {args.repeats}:",
                  "", "| batch | fast ms | invariant ms | invariant / fast |", "|---:|---:|---:|---:|"]
    costs, agreements = [], []

    def write(finished: bool):
        write_results(Path(args.out or Path(__file__).parent / "results" / "exactness"),
                      f"{device.platform}-{args.shape or 'toy-sdar'}",
                      dict(command=command, jax=jax.__version__, model=name,
                           device=f"{device.platform} {device.device_kind}", step_cost=costs, agreement=agreements,
                           finished=finished), lines)

    with written_when_done_or_stopped(write, lines, ["", "Stopped before the end: the rows above are the ones measured."]):
        for batch in [] if args.skip_cost else args.batches:
            block_bk, cache = step_inputs(model, batch, args.prompt_len, block)
            ms = {}
            for mode, setting in MODES.items():
                with dlmjax.numerics(**setting):
                    ms[mode] = step_ms(model, block_bk, cache, args.repeats)
            costs.append(dict(batch=batch, **{f"{m}_ms": v for m, v in ms.items()}))
            lines.append(f"| {batch} | {ms['fast']:.2f} | {ms['invariant']:.2f} | {ms['invariant'] / ms['fast']:.2f}x |")
            print(lines[-1], flush=True)
        if not args.skip_agreement:
            batch = max(args.batches)
            lines += ["", f"Token agreement over {len(prompts)} prompts, {max_new} new tokens, batch {batch}:", "",
                      "| mode | comparison | identical rows | token agreement |", "|---|---|---:|---:|"]
            for mode in args.modes:
                with dlmjax.numerics(**MODES[mode]):
                    for comparison, rows_same, tokens_same in agreement_runs(model, head, tokenizer, prompts, max_new,
                                                                             batch, args.comparisons):
                        agreements.append(dict(mode=mode, comparison=comparison, identical_rows=rows_same,
                                               token_agreement=tokens_same))
                        lines.append(f"| {mode} | {comparison} | {100 * rows_same:.1f}% | {100 * tokens_same:.2f}% |")
                        print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
