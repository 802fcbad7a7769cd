#!/usr/bin/env bash
# The whole test suite: creates or reuses the virtualenv, then runs pytest (extra args pass through).
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$ROOT"
exec "$PY" -m pytest -q -n auto "$@"
