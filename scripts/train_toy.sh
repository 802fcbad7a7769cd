#!/usr/bin/env bash
# Rebuild the shipped toy models (about 30 minutes each on 2 CPU cores; rerun to resume):
# trains toy-sdar and toy-ar from configs/, then copies each into dlmjax/toy/checkpoints with
# its recorded accuracy. Extra args are config overrides for both runs (e.g. train.steps=100).
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$ROOT"
for name in toy-sdar toy-ar; do
  "$VENV/bin/dlmjax" train "configs/$name.yaml" --out "runs/$name" "$@"
  "$PY" train/ship_toy.py "runs/$name" "$name"
done
