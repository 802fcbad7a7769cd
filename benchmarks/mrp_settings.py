"""MRP head training on toy-sdar with one noise level per row (`mrp.mask_rate=per_row`, the
reference's draw and the default) against one per (row, block) (`per_block`, the shipped head's
config): each head is trained for --steps steps from configs/mrp/toy-sdar.yaml (all else equal),
then scored on held-out toy-constraint batches under both kinds of noise.

    PYTHONPATH=. python benchmarks/mrp_mask_rate.py [--steps 600] [--runs runs/mrp-mask-rate]
        [--out benchmarks/results/mrp_mask_rate]

A run directory that already holds a finished run is reused (train resumes it, a no-op). Writes
results.md: mean KL(next step's logits || logits + residual) over 4 batches of 64 held-out
problems at the positions still masked after one reveal, beside the no-residual baseline.
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
BATCHES, EXAMPLES, SEED = 4, 64, 777  # held out: the training data uses seed 2


def train_head(rate: str, steps: int, run_dir: Path) -> Path:
    run = load_run_config(CONFIG, [f"mrp.mask_rate={rate}", f"train.steps={steps}", f"train.eval_every={steps}",
                                   f"train.checkpoint_every={steps}"])
    train(run, run_dir, progress=True)
    return run_dir / "model"


def held_out_kl(model_dir: Path, rate: str) -> tuple[float, float]:
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
    ap.add_argument("--runs", default="runs/mrp-mask-rate")
    ap.add_argument("--out", default="benchmarks/results/mrp_mask_rate")
    args = ap.parse_args()
    heads = {rate: train_head(rate, args.steps, Path(args.runs) / rate) for rate in MASK_RATES}
    lines = [f"# MRP head on toy-sdar: noise per row vs per block ({args.steps} steps each, {CONFIG})", "",
             f"Held-out {TASK}: mean KL over {BATCHES} x {EXAMPLES} problems (lower is better).", "",
             "| trained with | scored with | KL with head | KL without head |", "|---|---|---|---|"]
    for trained, model_dir in heads.items():
        for scored in MASK_RATES:
            kl, baseline = held_out_kl(model_dir, scored)
            lines.append(f"| {trained} | {scored} | {kl:.4f} | {baseline:.4f} |")
    lines += ["", f"`PYTHONPATH=. python benchmarks/mrp_mask_rate.py --steps {args.steps}`"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
