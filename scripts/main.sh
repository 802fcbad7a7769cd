#!/usr/bin/env bash
# The main job on the embedded default: creates or reuses the virtualenv, then runs dlmjax.
# With arguments, they go to the `dlmjax` command (e.g. scripts/main.sh generate --help).
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$ROOT"
if [ "$#" -gt 0 ]; then exec "$VENV/bin/dlmjax" "$@"; fi
for decoder in static threshold:tau=0.5; do
  "$VENV/bin/dlmjax" generate --model random-sdar --decoder "$decoder" --max-new-tokens 16 \
    --prompt "Q: 12+30=? A:" --prompt "Write a word:"
done
