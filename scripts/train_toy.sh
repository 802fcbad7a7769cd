#!/usr/bin/env bash
# Rebuild the shipped toy models and the toy-sdar MRP head (about 1 h 30 min in all on 2 CPU cores; rerun to resume):
# trains toy-ar, then toy-sdar from it, from configs/, then copies each into dlmjax/toy/checkpoints with
# its recorded accuracy. Extra args are config overrides for both runs (e.g. train.steps=100).
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$ROOT"
# toy-sdar adapts toy-ar (as SDAR adapts Qwen3) in two stages, so toy-ar comes first.
train() { "$PY" -m dlmjax.cli train "configs/$1.yaml" --out "runs/$1" "${@:2}"; }
train toy-ar "$@"
"$PY" train/ship_toy.py runs/toy-ar toy-ar
train toy-sdar-stage1 "$@"
train toy-sdar "$@"
"$PY" train/ship_toy.py runs/toy-sdar toy-sdar
# The MRP head of toy-sdar (frozen backbone), stored beside it.
train mrp/toy-sdar "$@"
"$PY" train/ship_mrp_head.py runs/mrp/toy-sdar toy-sdar
