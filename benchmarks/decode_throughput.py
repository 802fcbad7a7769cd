"""Decode throughput at batch 1, 16 and 64: tokens/s, forwards, row TPF and batch TPF for static,
threshold, PSD and mrp-spec, run as fixed batches (`generate` per batch of prompts) and as one
continuous-batching stream (`Stream`: a finished row's slot takes the next prompt).

Row TPF = committed tokens / the forwards each row used; batch TPF = committed tokens / the row
slots of every forward run (so idle slots count). The engine's rows advance on their own, so a
fixed batch still pays for its slowest row at the end; the stream does not.

    PYTHONPATH=. python benchmarks/decode_throughput.py                     # toy-sdar, toy prompts (CPU)
    PYTHONPATH=. python benchmarks/decode_throughput.py --shape sdar-1.7b   # random weights, bf16 (GPU)

On CPU wall time is not the target (a forward is compute-bound there); forwards and TPF are.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

import dlmjax
from dlmjax.decoding.api import Stream, generate
from dlmjax.evaluation.tasks import load_eval_set
from dlmjax.heads.mrp import init_head
from dlmjax.presets import load_checkpoint

SHAPES = {  # Qwen3 / SDAR shapes (sdar-mini: a CPU-sized stand-in with the real vocabulary and head dim)
    "sdar-mini": dict(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2),
    "sdar-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8),
    "sdar-8b": dict(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8),
}


def random_sdar(shape: str):
    cfg = dlmjax.ModelConfig(family="sdar", vocab_size=151936, head_dim=128, attention="block_causal", block_size=4,
                             qk_norm=True, mask_token_id=151669, eos_token_ids=(151645,), pad_token_id=151643,
                             max_position_embeddings=32768, dtype="bfloat16", **SHAPES[shape])
    model = dlmjax.init_model(cfg, seed=0)
    return model, init_head(cfg, num_layers=3, init_std=0.02, seed=0)


def run_batches(model, prompts, batch, **kw):
    """Fixed batches, one `generate` each, timed on a second pass: batches of prompts of other
    lengths lay out to other shapes, and the untimed first pass compiles each of them (the
    stream compiles one shape)."""
    chunks = [prompts[s : s + batch] for s in range(0, len(prompts), batch)]
    for c in chunks:
        generate(model, c, **kw)
    results = [generate(model, c, **kw) for c in chunks]
    rows = [row for r in results for row in r.rows]
    committed = sum(round(row.tpf * row.nfe) for row in rows)
    forwards = sum(r.forwards for r in results)
    slots = sum(r.forwards * len(c) for r, c in zip(results, chunks))
    wall = sum(r.wall_s for r in results)
    return rows, forwards, committed / max(slots, 1), wall


def run_stream(model, prompts, batch, **kw):
    for _ in Stream(model, prompts, batch_size=batch, limit=min(len(prompts), batch + max(1, batch // 8)), **kw):
        pass  # compile
    stream = Stream(model, prompts, batch_size=batch, **kw)
    rows = dict(stream)
    return [rows[i] for i in range(len(prompts))], stream.forwards, stream.batch_tpf, stream.wall_s


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random SDAR-shaped weights (bf16) instead of toy-sdar")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256, help="--shape only: random prompt length")
    p.add_argument("--max-new", type=int, default=None, help="default: 32 (toy-sdar), 256 (--shape)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--decoders", nargs="+",
                   default=["static", "threshold:tau=0.9", "psd:policy=threshold,tau=0.9,depth=3", "mrp-spec:drafts=3"])
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results/decode_throughput)")
    args = p.parse_args()
    device = jax.devices()[0]
    print("command:", " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind}), {platform.processor() or platform.machine()}")
    if args.shape:
        model, head = random_sdar(args.shape)
        rng = np.random.RandomState(0)
        prompts = [rng.randint(0, 150000, args.prompt_len).tolist() for _ in range(args.prompts)]
        tokenizer, max_new, name = None, args.max_new or 256, f"random {args.shape}"
    else:
        _, model, tokenizer, head = load_checkpoint("toy-sdar")
        half = args.prompts // 2
        items = load_eval_set("toy-arith", limit=args.prompts - half).items + load_eval_set("toy-constraint", limit=half).items
        prompts, max_new, name = [item.prompt for item in items], args.max_new or 32, "toy-sdar"
    print(f"model {name}; {len(prompts)} prompts, {max_new} new tokens")
    header = "| decoder | batch | mode | forwards | row TPF | batch TPF | tokens/s | wall s |"
    lines, records = [header, "|---|---:|---|---:|---:|---:|---:|---:|"], []
    print(header)
    for spec in args.decoders:
        kw = dict(tokenizer=tokenizer, decoder=spec, max_new_tokens=max_new, head=head)
        for batch in args.batches:
            reference = None
            for mode, run in (("batches", run_batches), ("stream", run_stream)):
                start = time.perf_counter()
                rows, forwards, batch_tpf, wall = run(model, prompts, batch, **kw)
                tokens = [row.tokens for row in rows]
                reference = reference or tokens
                assert tokens == reference, f"{spec} at batch {batch}: the stream's tokens differ from the batches'"
                committed = sum(round(row.tpf * row.nfe) for row in rows)
                row_tpf = committed / max(sum(row.nfe for row in rows), 1)
                generated = sum(row.num_tokens for row in rows)
                record = dict(decoder=spec, batch=batch, mode=mode, forwards=forwards, row_tpf=row_tpf,
                              batch_tpf=batch_tpf, tokens_per_s=generated / wall, wall_s=wall,
                              total_s=time.perf_counter() - start)
                records.append(record)
                line = (f"| `{spec}` | {batch} | {mode} | {forwards} | {row_tpf:.2f} | {batch_tpf:.2f} | "
                        f"{record['tokens_per_s']:.0f} | {wall:.2f} |")
                lines.append(line)
                print(line, flush=True)
    out = Path(args.out or Path(__file__).parent / "results" / "decode_throughput")
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{device.platform}-{args.shape or 'toy-sdar'}"
    meta = dict(command=" ".join(sys.argv), jax=jax.__version__, device=f"{device.platform} {device.device_kind}",
                model=name, prompts=len(prompts), max_new_tokens=max_new)
    (out / f"{tag}.json").write_text(json.dumps(dict(meta, runs=records), indent=2))
    (out / f"{tag}.md").write_text(f"`{meta['command']}` (jax {meta['jax']}, {meta['device']}, {name}, "
                                   f"{len(prompts)} prompts, {max_new} new tokens)\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {out / tag}.json and .md")


if __name__ == "__main__":
    main()
