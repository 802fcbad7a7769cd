"""TSPD and CE on the trained toy-sdar with its shipped controller, both toy tasks: accuracy, NFE
and TPF of static, threshold (tau 0.5 / 0.7 / 0.9), a Learn2PD-style filter (block confidences
only), ce, tspd (calibrated and fixed thresholds), tspd+ce, and PSD over threshold 0.9 for
reference, with an accuracy-vs-TPF (Pareto) plot per task.

    PYTHONPATH=. python benchmarks/tspd_toy.py [--model toy-sdar] [--controller toy-sdar] [--limit 64]
        [--learn2pd benchmarks/results/tspd_toy/learn2pd_filter.safetensors] [--out benchmarks/results/tspd_toy]

The Learn2PD-style filter was trained on the same traces as the shipped controller:
    dlmjax train configs/tspd/toy-sdar.yaml --out runs/learn2pd-toy-sdar "tspd.features=[block_confidence]"

Writes results.md, results.json and pareto.png. Times include compilation (no warm-up run):
compare NFE/TPF, not wall-clock.
"""

import argparse
import json
import re
import shlex
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dlmjax.evaluation.runner import run_eval  # noqa: E402
from dlmjax.evaluation.tasks import load_eval_set  # noqa: E402
from dlmjax.heads.controller import load_controller  # noqa: E402
from dlmjax.presets import load_checkpoint  # noqa: E402

TASKS = ("toy-arith", "toy-constraint")


def decoders(controller: str, learn2pd: str | None) -> list[str]:
    c = f"controller={controller}"
    l2pd = [] if not learn2pd else [f"learn2pd:controller={learn2pd}", f"learn2pd:controller={learn2pd},threshold=0.96"]
    return ["static", "threshold:tau=0.5", "threshold:tau=0.7", "threshold:tau=0.9", *l2pd,
            "psd:policy=threshold,tau=0.9,depth=4",
            "ce:tau=0.9", "ce:tau=0.7", "ce:tau=0.9,lookahead=false", "ce:tau=0.9,stabilize=false",
            f"tspd:{c}", f"tspd:{c},threshold=0.9", f"tspd:{c},threshold=0.95",
            f"tspd+ce:{c}", f"tspd+ce:{c},threshold=0.95"]


def family(spec: str) -> str:
    return spec.split(":")[0]


def short(spec: str) -> str:
    """The spec without its controller path (the legend's label)."""
    return re.sub(r",?controller=[^,]*", "", spec).replace(":,", ":").rstrip(":")


def table(records) -> str:
    lines = ["| task | decoder | accuracy | NFE | TPF |", "|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r.task} | `{r.decoder}` | {r.accuracy:.3f} | {r.nfe:.2f} | {r.tpf:.2f} |")
    return "\n".join(lines)


def plot(records, out: Path) -> None:
    fig, axes = plt.subplots(1, len(TASKS), figsize=(6 * len(TASKS), 4.5))
    markers = {"static": "s", "threshold": "o", "ce": "^", "tspd": "D", "tspd+ce": "*", "learn2pd": "v", "psd": "P"}
    for ax, task in zip(axes, TASKS):
        for r in (r for r in records if r.task == task):
            ax.scatter(r.tpf, r.accuracy, marker=markers.get(family(r.decoder), "x"), s=50,
                       label=short(r.decoder))
        ax.set_title(task)
        ax.set_xlabel("TPF (tokens per forward)")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="toy-sdar")
    parser.add_argument("--controller", default="toy-sdar", help="controller file/dir or a preset that ships one")
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--learn2pd", default="benchmarks/results/tspd_toy/learn2pd_filter.safetensors",
                        help="a Learn2PD-style block filter ('' to leave it out)")
    parser.add_argument("--out", default="benchmarks/results/tspd_toy")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _, model, tokenizer, _ = load_checkpoint(args.model)
    threshold = load_controller(args.controller).threshold
    eval_sets = [load_eval_set(t, limit=args.limit) for t in TASKS]
    records, _ = run_eval(model, tokenizer, eval_sets, decoders(args.controller, args.learn2pd), model_name=args.model,
                          warmup=False, progress=False)
    (out / "results.json").write_text(json.dumps([r.to_json() for r in records], indent=2))
    command = shlex.join(["PYTHONPATH=.", "python", "benchmarks/tspd_toy.py", "--model", args.model, "--controller",
                          args.controller, "--limit", str(args.limit), "--learn2pd", args.learn2pd, "--out", args.out])
    (out / "results.md").write_text(
        f"# TSPD / CE on {args.model} ({args.limit} prompts per task)\n\n`{command}`\n\n"
        f"Controller: {args.controller} (calibrated threshold {threshold}).\n\n{table(records)}\n")
    plot(records, out / "pareto.png")
    print(table(records))


if __name__ == "__main__":
    main()
