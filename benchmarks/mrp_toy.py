"""MRP on the trained toy-sdar and its shipped head, both toy tasks, one run side by side:

1. mrp-spec (lossless) against static (1 token per step): TPF ratio, wall-clock speedup, and how
   many outputs are identical to static's (all of them, or the decoder is broken).
2. mrp-direct quality/speed curve: mrp_steps 0..4 against static:k=2..4 (no head).
3. mrp-remask tau x delta sweep against threshold decoding at the same tau (rule `both`, the two
   single rules at delta=1, and `head_input=pre` at delta=1), on toy-constraint (where low
   thresholds lose the most).

    PYTHONPATH=. python benchmarks/mrp_toy.py [--model toy-sdar] [--limit 128] [--out benchmarks/results/mrp_toy]

Writes results.md (tables), results.json (every record), direct.png and remask.png.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dlmjax.evaluation.runner import run_eval  # noqa: E402
from dlmjax.evaluation.tasks import load_eval_set  # noqa: E402
from dlmjax.presets import load_checkpoint  # noqa: E402

TASKS = ("toy-arith", "toy-constraint")


def spec_table(records, outputs) -> str:
    tokens = {(o["task"], o["decoder"], o["index"]): o["tokens"] for o in outputs}
    base = {r.task: r for r in records if r.decoder == "static"}
    lines = ["| task | decoder | accuracy | TPF | TPF / static | identical to static | wall s | speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r.decoder != "static" and not r.decoder.startswith("mrp-spec"):
            continue
        same = sum(tokens[(r.task, r.decoder, i)] == tokens[(r.task, "static", i)]
                   for (task, dec, i) in tokens if task == r.task and dec == r.decoder)
        b = base[r.task]
        lines.append(f"| {r.task} | {r.decoder} | {r.accuracy:.1%} | {r.tpf:.2f} | {r.tpf / b.tpf:.2f}x | "
                     f"{same}/{r.n} | {r.wall_s:.2f} | {b.wall_s / r.wall_s:.2f}x |")
    return "\n".join(lines)


def curve_table(records, prefixes) -> str:
    lines = ["| task | decoder | accuracy | TPF | wall s |", "|---|---|---|---|---|"]
    for r in records:
        if r.decoder == "static" or r.decoder.startswith(prefixes):
            lines.append(f"| {r.task} | {r.decoder} | {r.accuracy:.1%} | {r.tpf:.2f} | {r.wall_s:.2f} |")
    return "\n".join(lines)


def plot_direct(records, out: Path):
    fig, axes = plt.subplots(1, len(TASKS), figsize=(11, 4))
    for ax, task in zip(axes, TASKS):
        for prefix, label, style in (("mrp-direct", "mrp-direct (mrp_steps 0-4)", "o-"), ("static", "static:k", "s--")):
            rs = [r for r in records if r.task == task and r.decoder.split(":")[0] == prefix]
            rs.sort(key=lambda r: r.tpf)
            ax.plot([r.tpf for r in rs], [100 * r.accuracy for r in rs], style, label=label)
        ax.set_title(task)
        ax.set_xlabel("tokens per forward")
        ax.set_ylabel("accuracy %")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "direct.png", dpi=120)


def pre_name(tau):
    return f"mrp-remask:tau={tau},delta=1.0,head_input=pre"


def plot_remask(records, taus, deltas, out: Path, task="toy-constraint"):
    fig, (acc, tpf, front) = plt.subplots(3, 1, figsize=(6, 10))
    by = {r.decoder: r for r in records if r.task == task}
    series = [("threshold", [f"threshold:tau={t}" for t in taus], "k--")]
    series += [(f"mrp-remask delta={d}", [f"mrp-remask:tau={t},delta={d}" for t in taus], "o-") for d in deltas]
    series += [("mrp-remask delta=1.0 head_input=pre", [pre_name(t) for t in taus], "x:")]
    for label, names, style in series:
        acc.plot(taus, [100 * by[n].accuracy for n in names], style, label=label)
        tpf.plot(taus, [by[n].tpf for n in names], style, label=label)
        front.plot([by[n].tpf for n in names], [100 * by[n].accuracy for n in names], style, label=label)
    acc.axhline(100 * by["static"].accuracy, color="grey", lw=0.8, label="static")
    acc.set_title(f"{task}: mrp-remask (rule both) vs threshold")
    acc.set_ylabel("accuracy %")
    tpf.set_ylabel("tokens per forward")
    tpf.set_xlabel("tau")
    front.set_xlabel("tokens per forward (each point one tau)")
    front.set_ylabel("accuracy %")
    acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "remask.png", dpi=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="toy-sdar")
    parser.add_argument("--limit", type=int, default=128)
    parser.add_argument("--taus", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,0.95")
    parser.add_argument("--deltas", default="0.5,1,2,4")
    parser.add_argument("--out", default="benchmarks/results/mrp_toy")
    args = parser.parse_args()

    _, model, tokenizer, head = load_checkpoint(args.model)
    taus = [float(t) for t in args.taus.split(",")]
    deltas = [float(d) for d in args.deltas.split(",")]

    spec = ["static"] + [f"mrp-spec:drafts={k}" for k in (2, 3, 4, 6)]
    direct = [f"mrp-direct:mrp_steps={s}" for s in range(5)] + [f"static:k={k}" for k in (2, 3, 4)]
    remask = [f"threshold:tau={t}" for t in taus]
    remask += [f"mrp-remask:tau={t},delta={d}" for t in taus for d in deltas]
    remask += [f"mrp-remask:tau={t},delta=1.0,rule={rule}" for t in taus for rule in ("residual", "confidence")]
    remask += [pre_name(t) for t in taus]
    eval_sets = {task: load_eval_set(task, limit=args.limit) for task in TASKS}
    records, outputs = run_eval(model, tokenizer, list(eval_sets.values()), spec + direct, model_name=args.model,
                                head=head)
    remask_records, _ = run_eval(model, tokenizer, [eval_sets["toy-constraint"]], ["static"] + remask,
                                 model_name=args.model, head=head)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps([r.to_json() for r in records + remask_records], indent=2))
    plot_direct(records, out)
    plot_remask(remask_records, taus, deltas, out)
    report = "\n\n".join([
        f"# MRP on {args.model} ({args.limit} prompts per task)",
        "## mrp-spec (lossless) vs static\n\n" + spec_table(records, outputs),
        "## mrp-direct quality/speed (direct.png)\n\n" + curve_table(records, ("mrp-direct", "static:k")),
        "## mrp-remask vs threshold on toy-constraint (remask.png)\n\n"
        + curve_table(remask_records, ("threshold", "mrp-remask")),
    ])
    (out / "results.md").write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
