#!/usr/bin/env bash
# The main job: `dlmjax eval` on the embedded default (toy-sdar, both toy tasks, the default
# decoders); prints the accuracy/speed table and writes eval-results/ (results.json, results.md,
# pareto.png). Creates or reuses the virtualenv first. With arguments, they go to the `dlmjax`
# command instead (e.g. scripts/main.sh generate --model toy-sdar --prompt $'12+7-3\n': toy prompts end in a newline),
# run where you are, so relative paths in them are yours.
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
if [ "$#" -gt 0 ]; then exec "$PY" -m dlmjax.cli "$@"; fi
cd "$ROOT"
exec "$PY" -m dlmjax.cli eval
