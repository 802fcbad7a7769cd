"""PSD on the trained toy-sdar: accuracy and tokens per forward against static and threshold,
across draft depths 1-8, on both toy tasks; writes a table and a Pareto plot.

    PYTHONPATH=. python benchmarks/psd_toy.py [--model toy-sdar] [--limit 64] [--out benchmarks/results/psd_toy]

PSD is lossless with respect to its policy, so `psd:tau=T,depth=D` must match `threshold:tau=T`
in accuracy (the same tokens; on an accelerator that holds bitwise with DLMJAX_INVARIANT=1 only, where
the fast mode may flip a near-tie) while using fewer forwards; the table shows both.
"""

import argparse

from dlmjax.evaluation.report import write_report
from dlmjax.evaluation.runner import run_eval
from dlmjax.evaluation.tasks import load_eval_set
from dlmjax.presets import load_checkpoint


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="toy-sdar")
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--taus", default="0.9,0.7")
    parser.add_argument("--depths", default="1,2,3,4,6,8")
    parser.add_argument("--out", default="benchmarks/results/psd_toy")
    args = parser.parse_args()

    _, model, tokenizer, _ = load_checkpoint(args.model)
    block = model.config.block_size
    decoders = ["static", "static:k=2", f"static:k={block}"]
    for tau in args.taus.split(","):
        decoders.append(f"threshold:tau={tau}")
        decoders += [f"psd:policy=threshold,tau={tau},depth={d}" for d in args.depths.split(",")]
    eval_sets = [load_eval_set(task, limit=args.limit) for task in ("toy-arith", "toy-constraint")]
    records, _ = run_eval(model, tokenizer, eval_sets, decoders, model_name=args.model)
    print(write_report(records, None, args.out, title=f"PSD vs static/threshold on {args.model}", keep_earlier=False))


if __name__ == "__main__":
    main()
