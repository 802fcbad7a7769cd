"""Put a finished MRP head run's head beside its shipped backbone and record how it was made.

    python train/ship_mrp_head.py runs/mrp-toy-sdar toy-sdar

Writes dlmjax/toy/checkpoints/NAME/{mrp_head.safetensors (reference names), the index, the residual
scale in config.json, MRP_TRAINING.md (command, resolved config, KL to the next step's logits
during training against the no-residual baseline)}.
"""

import json
import sys
from pathlib import Path

from dlmjax.heads.mrp import load_head, save_head
from dlmjax.io.hf import load_config
from dlmjax.presets import SHIPPED_DIR


def ship(run_dir: Path, name: str) -> Path:
    model_dir = run_dir / "model"
    if not (model_dir / "mrp_head.safetensors").is_file():
        raise SystemExit(f"{model_dir} has no exported MRP head; finish the training run first")
    target = SHIPPED_DIR / name
    save_head(load_head(model_dir, load_config(target)), target)
    (target / "MRP_TRAINING.md").write_text(training_record(run_dir, name))
    return target


def training_record(run_dir: Path, name: str) -> str:
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval/" in line]
    keys = sorted(k for k in evals[-1] if k.startswith("eval/")) if evals else []
    rows = [f"| {e['step']} | " + " | ".join(f"{e.get(k, float('nan')):.4f}" for k in keys) + " |" for e in evals]
    return f"""# The MRP head of {name}

Made by (from the repository root; rerunning the train command resumes an interrupted run):

```bash
dlmjax train configs/mrp/{name}.yaml --out {run_dir}
python train/ship_mrp_head.py {run_dir} {name}
```

The backbone is frozen; only the head (`mrp_head.safetensors`, reference weight names
`mrp_modules.{{i}}.model.*`) trains. Resolved config (`{run_dir}/config.yaml`):

```yaml
{(run_dir / "config.yaml").read_text().rstrip()}
```

Held-out metrics during training: `kl` = KL(next-step logits || logits + head residual) at the
positions still masked after one more reveal, `kl_baseline` = the same with no residual; `top1`
= how often the corrected argmax equals the next step's.

| step | {" | ".join(k.removeprefix("eval/") for k in keys)} |
|---|{"---|" * len(keys)}
{chr(10).join(rows)}
"""


if __name__ == "__main__":
    print(ship(Path(sys.argv[1]), sys.argv[2]))
