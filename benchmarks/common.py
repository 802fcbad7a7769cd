"""Shared by the benchmarks: random models whose head is scaled up so that their distributions
are peaked, as a trained model's are (confidence-based decoders then commit several tokens per
step instead of one); random prompts; how to hand transformers' models their KV cache; results
files (JSON + markdown) that a run stopped at its time limit still writes."""

from __future__ import annotations

import contextlib
import inspect
import json
import statistics
import time
from pathlib import Path

import numpy as np

import dlmjax


def random_prompt(rng: np.random.RandomState, cfg, length: int) -> list[int]:
    """`length` random token ids of `cfg`'s vocabulary without its special ids (mask, pad, bos,
    eos): `generate` refuses a prompt holding the mask id. Below the first special id the draws
    are `rng.randint(0, ...)`'s own."""
    special = {cfg.mask_token_id, cfg.pad_token_id, cfg.bos_token_id, *cfg.eos_token_ids} - {None}
    allowed = np.setdiff1d(np.arange(cfg.vocab_size), np.fromiter(special, int, len(special)))
    return allowed[rng.randint(0, len(allowed), length)].tolist()


def torch_cache_name(torch_model) -> str:
    """The keyword that passes a KV cache to a transformers model's forward, and its output's
    attribute holding it: `cache` where the forward takes it (transformers 5.24 deprecates
    `past_key_values`, to be removed in 5.40), else `past_key_values` (earlier 5.x, such as the
    lent H200's 5.17)."""
    return "cache" if "cache" in inspect.signature(torch_model.forward).parameters else "past_key_values"


def peaked_random_model(family: str, args, *, num_kv_heads: int) -> dlmjax.Transformer:
    """A random `family` model sized by args.vocab/hidden/layers (head_dim 32), head x args.head_scale.
    sdar is block-causal with block args.block; qwen3 causal (an autoregressive target); llada
    bidirectional."""
    block_causal = family == "sdar"
    cfg = dlmjax.ModelConfig(
        family=family, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_layers=args.layers, num_heads=args.hidden // 32, num_kv_heads=num_kv_heads, head_dim=32,
        attention={"sdar": "block_causal", "qwen3": "causal"}.get(family, "bidirectional"),
        block_size=args.block if block_causal else None, qk_norm=family in ("sdar", "qwen3"),
        mask_token_id=args.vocab - 1,
        eos_token_ids=(), pad_token_id=0, max_position_embeddings=2048,
    )
    model = dlmjax.init_model(cfg, seed=0)
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * args.head_scale
    return model


def median_ms(fn, repeats: int, *, warmup: int = 1) -> float:
    """Median wall ms of fn() (its result waited for), after `warmup` untimed calls (compile)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def write_results(out: Path, tag: str, record: dict, lines: list[str]) -> None:
    """`out`/`tag`.json (the record) and `out`/`tag`.md (the lines), and say so."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(record, indent=2))
    (out / f"{tag}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / tag}.json and .md")


@contextlib.contextmanager
def written_when_done_or_stopped(write, lines: list[str], stopped: list[str]):
    """Around a benchmark's measurements: `write(finished=True)` after them; where a lent machine's
    stage stops the run at its time limit (SIGINT), `stopped` is added to the lines and
    `write(finished=False)` keeps what was measured before the interrupt goes on. A run that fails
    writes nothing (the committed results stay)."""
    try:
        yield
    except KeyboardInterrupt:
        lines.extend(stopped)
        write(finished=False)
        raise
    write(finished=True)
