"""How much the toy accuracies gain from evaluation prompts the toy models were trained on.

The toy models' training draws prompts from the same generators as `dlmjax eval` (seed 1234), and
toy-arith has few distinct short prompts, so about half of its evaluation prompts are in the draws.
This replays the draws of training configs (their data.tasks, data.seed, train.steps and
train.batch_size; the default is the shipped toy-sdar's recipe: toy-ar, then toy-sdar stage 1 and 2)
and splits each decoder's accuracy in an `eval --save-outputs` file between the prompts seen in
training and the rest, per kind of prompt (toy-arith: its number of operations; toy-constraint: its
number of digits). The kinds matter: short prompts are both easier and far more often seen, so
seen against unseen over all prompts mixes memorisation with difficulty.

    dlmjax eval --task toy-arith --decoder static --decoder tspd+ce --limit 1024 --batch-size 128 \
        --save-outputs --out /tmp/seen
    PYTHONPATH=. python benchmarks/toy_seen_prompts.py /tmp/seen/outputs.jsonl

Results: benchmarks/results/toy_seen_prompts/results.md.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from dlmjax.evaluation.tasks import load_eval_set
from dlmjax.toy.tasks import TASKS
from dlmjax.train.config import load_run_config
from dlmjax.train.data import sample_examples

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_TOY_SDAR = ("configs/toy-ar.yaml", "configs/toy-sdar-stage1.yaml", "configs/toy-sdar.yaml")


def trained_prompts(config_paths, steps: int | None = None) -> set[str]:
    """Every prompt the training runs of `config_paths` drew (the first `steps` of each, if given)."""
    seen = set()
    for path in config_paths:
        config = load_run_config(path)
        for step in range(min(config.train.steps, steps or config.train.steps)):
            batch = sample_examples(config.data.tasks, config.train.batch_size, config.data.seed, step)
            seen.update(example.prompt for example in batch)
    return seen


def prompt_kind(example) -> str:
    """What makes a toy prompt harder: toy-arith's number of operations, toy-constraint's digits."""
    if "values" in example.meta:
        return f"{len(example.meta['values']) - 1} operations"
    return f"{example.meta['k']} digits"


def split_accuracy(outputs, seen: set[str]) -> dict:
    """{(task, decoder, kind): {"seen": [correct, n], "unseen": [correct, n]}} over `eval
    --save-outputs` rows (kind "all" too), each row's example loaded as `dlmjax eval` loads it."""
    rows = list(outputs)
    examples = {}
    for task in {row["task"] for row in rows}:
        count = 1 + max(row["index"] for row in rows if row["task"] == task)
        examples[task] = [item.reference for item in load_eval_set(task, limit=count).items]
    split = defaultdict(lambda: {"seen": [0, 0], "unseen": [0, 0]})
    for row in rows:
        example = examples[row["task"]][row["index"]]
        for kind in ("all", prompt_kind(example)):
            part = split[row["task"], row["decoder"], kind]["seen" if example.prompt in seen else "unseen"]
            part[0] += bool(row["correct"])
            part[1] += 1
    return dict(split)


def markdown(split: dict) -> str:
    def cell(part):
        return f"{part[0] / part[1]:.1%} ({part[0]}/{part[1]})" if part[1] else "-"
    runs = list(dict.fromkeys(key[:2] for key in split))  # in the evaluation's order
    keys = sorted(split, key=lambda key: (runs.index(key[:2]), key[2] != "all", key[2]))
    lines = ["| task | decoder | prompts | seen in training | not seen |", "|---|---|---|---:|---:|"]
    lines += [f"| {task} | `{decoder}` | {kind} | {cell(split[task, decoder, kind]['seen'])} | "
              f"{cell(split[task, decoder, kind]['unseen'])} |" for task, decoder, kind in keys]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outputs", help="outputs.jsonl of `dlmjax eval --save-outputs` on toy tasks")
    parser.add_argument("--config", action="append", help="training config whose draws count as seen; "
                        "repeat (default: toy-ar, toy-sdar-stage1, toy-sdar)")
    parser.add_argument("--steps", type=int, help="replay only each config's first N steps (tests)")
    args = parser.parse_args(argv)
    configs = args.config or [ROOT / path for path in SHIPPED_TOY_SDAR]
    with open(args.outputs) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [row for row in rows if row["task"] in TASKS]
    if not rows:
        raise SystemExit(f"{args.outputs}: no toy-task rows (run dlmjax eval --save-outputs on toy tasks)")
    print(markdown(split_accuracy(rows, trained_prompts(configs, args.steps))))


if __name__ == "__main__":
    main()
