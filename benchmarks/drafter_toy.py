"""DFlash drafters on the trained toy-ar: mean accepted length (tokens per target forward) and
wall-clock against `ar` decoding, on both toy tasks, for each drafter given; optionally the
PyTorch reference's accepted length on the same prompts (tests/drafter_reference.py).

    PYTHONPATH=. python benchmarks/drafter_toy.py --drafter NAME=DIR [--drafter NAME=DIR ...]
        [--limit 64] [--batch 16] [--reference 16] [--out benchmarks/results/drafter_toy]

Greedy speculative decoding is lossless, so every drafter's tokens must equal ar's: the script
checks it and records `identical_to_ar`. Wall-clock is the best of 3 warm runs over the prompts
in batches of --batch rows (CPU here; no accelerator was lent to this task).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from dlmjax.decoding.ar import generate_ar
from dlmjax.decoding.speculative import generate_with_drafter
from dlmjax.evaluation.tasks import load_eval_set
from dlmjax.io.dflash import load_drafter
from dlmjax.presets import load_checkpoint

TASKS = ("toy-arith", "toy-constraint")


def batches(prompts, size):
    return [prompts[i : i + size] for i in range(0, len(prompts), size)]


def timed(fn, repeats=3):
    out = jax.block_until_ready(fn())  # compile + warm
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return out, best


def run_task(model, tokenizer, drafters, task, limit, batch, reference, ref_target):
    eval_set = load_eval_set(task, limit=limit)
    prompts = [tokenizer.encode(item.prompt) for item in eval_set.items]
    kw = dict(max_new_tokens=eval_set.max_new_tokens, eos_ids=(tokenizer.eos_id,), pad_id=model.config.pad_token_id or 0)
    groups = batches(prompts, batch)
    ar_out, ar_time = timed(lambda: [generate_ar(model, g, **kw) for g in groups])
    ar_tokens = np.concatenate([np.asarray(o.tokens) for o in ar_out])
    useful = int(sum(np.asarray(o.num_generated).sum() for o in ar_out))
    row = {"task": task, "prompts": len(prompts), "max_new_tokens": eval_set.max_new_tokens,
           "ar": {"seconds": ar_time, "tokens_per_s": useful / ar_time}}
    for name, drafter in drafters.items():
        out, t = timed(lambda: [generate_with_drafter(model, drafter, g, **kw) for g in groups])
        tokens = np.concatenate([np.asarray(o.tokens) for o in out])
        acc = np.concatenate([np.asarray(o.accepted) for o in out])
        mal = float(acc.sum() / max((acc > 0).sum(), 1))
        entry = {"mean_accepted_length": mal, "seconds": t, "tokens_per_s": useful / t, "speedup_vs_ar": ar_time / t,
                 "identical_to_ar": bool((tokens == ar_tokens).all())}
        if reference:
            from drafter_reference import RefDrafter, speculative_greedy

            ref = RefDrafter.load(drafter_dirs[name])
            steps = []
            for p in prompts[:reference]:
                _, s = speculative_greedy(ref, ref_target, p, eval_set.max_new_tokens, drafter.config.block_size,
                                          eos_ids=(tokenizer.eos_id,))
                steps += s
            ours = [a for row_acc in acc[:reference] for a in row_acc if a > 0]
            entry["reference"] = {"prompts": reference, "mean_accepted_length_pytorch": float(np.mean(steps)),
                                  "mean_accepted_length_dlmjax": float(np.mean(ours)),
                                  "per_step_identical": [int(a) for a in ours] == steps}
        row[name] = entry
    return row


drafter_dirs: dict[str, Path] = {}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="toy-ar")
    parser.add_argument("--drafter", action="append", required=True, help="NAME=DIR of a DFlash drafter")
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reference", type=int, default=0, help="prompts per task decoded by the PyTorch reference")
    parser.add_argument("--out", default="benchmarks/results/drafter_toy")
    args = parser.parse_args()

    model_dir, model, tokenizer, _ = load_checkpoint(args.model)
    drafters = {}
    for spec in args.drafter:
        name, path = spec.split("=", 1)
        drafter_dirs[name] = Path(path)
        drafters[name] = load_drafter(path, model.config)
    ref_target = None
    if args.reference:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from transformers import AutoModelForCausalLM

        ref_target = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    rows = [run_task(model, tokenizer, drafters, t, args.limit, args.batch, args.reference, ref_target) for t in TASKS]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "device": str(jax.devices()[0].platform), "batch": args.batch,
              "drafters": {k: str(v) for k, v in drafter_dirs.items()}, "tasks": rows}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    lines = [f"# DFlash drafters on {args.model} (greedy, batch {args.batch}, {jax.devices()[0].platform})", "",
             "| task | drafter | mean accepted length | tokens/s | speedup vs ar | identical to ar | PyTorch ref MAL |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['task']} | ar | 1 | {row['ar']['tokens_per_s']:.0f} | 1.00 | yes | |")
        for name in drafters:
            e = row[name]
            ref = e.get("reference", {})
            ref_s = (f"{ref['mean_accepted_length_pytorch']:.3f} (same steps: {ref['per_step_identical']})"
                     if ref else "")
            lines.append(f"| {row['task']} | {name} | {e['mean_accepted_length']:.3f} | {e['tokens_per_s']:.0f} | "
                         f"{e['speedup_vs_ar']:.2f} | {'yes' if e['identical_to_ar'] else 'NO'} | {ref_s} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
