"""Copy a finished toy run's model into the package and record its accuracy.

    python train/ship_toy.py runs/toy-sdar toy-sdar

Writes dlmjax/toy/checkpoints/NAME/{config.json, model.safetensors, tokenizer files,
accuracy.json, TRAINING.md}; accuracy.json holds the static / whole-block (or AR) accuracy on the fixed
64-prompt held-out slice that tests/test_toy_models.py checks. What else the directory holds
(toy-ar's drafter/, toy-sdar's MRP head and TSPD controller) is kept, and named as trained on
the previous weights.
"""

import json
import shutil
import sys
from pathlib import Path

import yaml

from dlmjax.evaluation.tasks import TOY_SEED
from dlmjax.evaluation.toy import RECORD_SLICE, record_accuracy
from dlmjax.io.hf import load_model
from dlmjax.io.tokenizer import load_tokenizer
from dlmjax.presets import SHIPPED_DIR


WRITTEN = ("config.json", "accuracy.json", "TRAINING.md", "tokenizer.json", "tokenizer_config.json",
           "generation_config.json", "special_tokens_map.json")  # the model's own files, replaced


def ship(run_dir: Path, name: str) -> Path:
    model_dir = run_dir / "model"
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"{model_dir} has no exported model; finish the training run first")
    target = SHIPPED_DIR / name
    target.mkdir(parents=True, exist_ok=True)
    for old in target.iterdir():  # the previous model's files (its shard layout may differ), not the heads beside it
        if old.is_file() and (old.name in WRITTEN or old.name.startswith("model.safetensors")):
            old.unlink()
    for new in model_dir.iterdir():
        shutil.copy2(new, target / new.name) if new.is_file() else shutil.copytree(new, target / new.name)
    kept = sorted(p.name for p in target.iterdir() if not (model_dir / p.name).exists() and p.name not in WRITTEN)
    if kept:  # e.g. toy-ar's drafter/, toy-sdar's MRP head and TSPD controller
        print(f"kept beside the new {name}: {', '.join(kept)}; they were trained on the previous weights: retrain them "
              "(scripts/train_toy.sh retrains the MRP head; the others' TRAINING notes give their commands)",
              file=sys.stderr)
    model = load_model(target)
    accuracy = record_accuracy(model, load_tokenizer(target, model.config))
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    record = {"slice": {"seed": TOY_SEED, "n": RECORD_SLICE}, "accuracy": accuracy, "train_steps": config["train"]["steps"]}
    (target / "accuracy.json").write_text(json.dumps(record, indent=2) + "\n")
    (target / "TRAINING.md").write_text(training_record(run_dir, name, record))
    return target


def training_record(run_dir: Path, name: str, record: dict) -> str:
    """How the model was made: the commands, the resolved config, accuracy during training."""
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval/" in line]
    tasks = sorted({k for e in evals for k in e if k.startswith("eval/")})
    rows = [f"| {e['step']} | " + " | ".join(f"{100 * e[t]:.1f}%" for t in tasks) + " |" for e in evals]
    accuracy = "\n".join(f"- {task}: " + ", ".join(f"`{d}` {100 * a:.1f}%" for d, a in by_dec.items())
                         for task, by_dec in record["accuracy"].items())
    init_from = yaml.safe_load((run_dir / "config.yaml").read_text())["train"].get("init_from")
    start = f"It starts from the weights of `{init_from}`. " if init_from else "It starts from random weights. "
    return f"""# {name}

Made by (from the repository root; rerunning a train command resumes an interrupted run):

```bash
dlmjax train configs/{name}.yaml --out runs/{name}
python train/ship_toy.py runs/{name} {name}
```

{start}`scripts/train_toy.sh` runs the whole recipe of every shipped model in order.

Resolved config (`runs/{name}/config.yaml`):

```yaml
{(run_dir / "config.yaml").read_text().rstrip()}
```

Held-out accuracy during training (first {record['slice']['n']} prompts of seed {record['slice']['seed']}; static or
greedy AR decoding):

| step | {" | ".join(t.removeprefix("eval/") for t in tasks)} |
|---|{"---|" * len(tasks)}
{chr(10).join(rows)}

Recorded accuracy of the shipped weights (accuracy.json; tests/test_toy_models.py checks it):

{accuracy}
"""


if __name__ == "__main__":
    out = ship(Path(sys.argv[1]), sys.argv[2])
    print(f"shipped {out}:\n{(out / 'accuracy.json').read_text()}")
