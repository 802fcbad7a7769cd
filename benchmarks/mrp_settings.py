"""The settings of configs/mrp/toy-sdar.yaml against the alternatives its comments name: an MRP
head on toy-sdar trained for --steps steps from that config with one setting changed (all else
equal), then scored on toy-constraint batches drawn with another seed (new answers and masks; the
task's 39 prompts are all in the training draws).

- noise: one level per row (`mrp.mask_rate=per_row`, the reference's draw and the default)
  against one per (row, block) (`per_block`, the config's), each scored under both kinds;
- the head's output norm starting at 1 (`mrp.init_norm_scale=1.0`, the reference's) instead of 0;
- head matrices drawn with std 0.02 (`mrp.init_std=0.02`) instead of 0.2 (the reference's);
- learning rate 1e-3 (`train.lr=1e-3`, the reference's) instead of 3e-3.

    PYTHONPATH=. python benchmarks/mrp_settings.py [--steps 600] [--runs runs/mrp-settings]
        [--out benchmarks/results/mrp_settings]

A run directory that already holds a finished run is reused (train resumes it, a no-op). Writes
results.md: mean KL(next step's logits || logits + residual) over 4 batches of 64 problems drawn
with seeds 777-780 at the positions still masked after one reveal, beside the no-residual baseline. One
seed per run: `--seed N` trains every run with `train.seed=N` and `data.seed=N + 2` (the config's
are 0 and 2) and writes results-seedN.md.
"""

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax.heads.mrp import load_head
from dlmjax.io.hf import load_model
from dlmjax.io.tokenizer import load_tokenizer
from dlmjax.train.config import load_run_config
from dlmjax.train.data import make_batch, sample_examples
from dlmjax.train.loop import train
from dlmjax.train.mrp import mrp_loss
from dlmjax.train.objectives import MASK_RATES

CONFIG = "configs/mrp/toy-sdar.yaml"
TASK = "toy-constraint"
BATCHES, EXAMPLES, SEED = 4, 64, 777  # other draws than the training data's (seed 2)


CHANGES = {  # the config's own settings first; each other run changes one (scored with per-block noise)
    "the config (per_block noise, output norm from 0, init_std 0.2, lr 3e-3)": [],
    "per_row noise": ["mrp.mask_rate=per_row"],
    "output norm from 1": ["mrp.init_norm_scale=1.0"],
    "init_std 0.02": ["mrp.init_std=0.02"],
    "lr 1e-3": ["train.lr=1e-3"],
}


def train_head(change: list[str], steps: int, seed: int, run_dir: Path) -> Path:
    run = load_run_config(CONFIG, [*change, f"train.seed={seed}", f"data.seed={seed + 2}", f"train.steps={steps}",
                                   f"train.eval_every={steps}", f"train.checkpoint_every={steps}"])
    train(run, run_dir, progress=True)
    return run_dir / "model"


def eval_kl(model_dir: Path, rate: str) -> tuple[float, float]:
    """(mean KL with the head's residual, mean KL without it) under noise drawn `rate`."""
    model = load_model(model_dir)
    head = load_head(model_dir, model.config)
    tokenizer, cfg = load_tokenizer(model_dir, model.config), model.config
    kl, baseline = [], []
    for i in range(BATCHES):
        batch = make_batch(sample_examples({TASK: 1}, EXAMPLES, SEED + i, 0), tokenizer, seq_len=64,
                           block=cfg.block_size, pad_id=cfg.pad_token_id)
        arrays = {k: jnp.asarray(v) for k, v in vars(batch).items()}
        metrics = mrp_loss(head, model, arrays, jax.random.key(i), block=cfg.block_size, mask_id=cfg.mask_token_id,
                           mask_rate=rate)[1]
        kl.append(float(metrics["kl"]))
        baseline.append(float(metrics["kl_baseline"]))
    return float(np.mean(kl)), float(np.mean(baseline))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0, help="train.seed (data.seed is this + 2)")
    ap.add_argument("--runs", default="runs/mrp-settings")
    ap.add_argument("--out", default="benchmarks/results/mrp_settings")
    args = ap.parse_args()
    runs = Path(args.runs) / f"seed{args.seed}"
    heads = {name: train_head(change, args.steps, args.seed, runs / f"run{i}")
             for i, (name, change) in enumerate(CHANGES.items())}
    config_head, per_row_head = list(heads.values())[:2]
    lines = [f"# MRP head on toy-sdar: the settings of {CONFIG} against one change each ({args.steps} steps each)",
             "", f"{TASK}, batches drawn with seeds {SEED}-{SEED + BATCHES - 1}: mean KL over {BATCHES} x {EXAMPLES} "
             f"problems (lower is better); `train.seed` {args.seed}, `data.seed` {args.seed + 2}.", "",
             "## Noise per row vs per block", "",
             "| trained with | scored with | KL with head | KL without head |", "|---|---|---|---|"]
    for trained, model_dir in (("per_block", config_head), ("per_row", per_row_head)):
        for scored in MASK_RATES:
            kl, baseline = eval_kl(model_dir, scored)
            lines.append(f"| {trained} | {scored} | {kl:.4f} | {baseline:.4f} |")
    lines += ["", "## One change each, scored with per-block noise", "",
              "| run | KL with head | KL without head |", "|---|---|---|"]
    for name, model_dir in heads.items():
        kl, baseline = eval_kl(model_dir, "per_block")
        lines.append(f"| {name} | {kl:.4f} | {baseline:.4f} |")
    lines += ["", f"`PYTHONPATH=. python benchmarks/mrp_settings.py --steps {args.steps} --seed {args.seed}`"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("results.md" if args.seed == 0 else f"results-seed{args.seed}.md")).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
