#!/usr/bin/env bash
# The whole test suite: creates or reuses the virtualenv, then runs pytest (extra args pass through).
#   scripts/test.sh                 on the CPU, with 8 fake devices (CI)
#   scripts/test.sh --device gpu    on the machine's accelerator (gpu or tpu): full-fp32 matmuls and
#                                   batch-invariant numerics; tests that need 8 devices skip
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$ROOT"
workers=(-n auto)
if [ "${1:-}" = "--device" ]; then
  export DLMJAX_TEST_DEVICE="${2:?--device takes cpu, gpu or tpu}"
  shift 2
  case "$DLMJAX_TEST_DEVICE" in
    cpu) ;;
    gpu|tpu) workers=(-n 2) ;;  # two processes share the one accelerator
    *) echo "scripts/test.sh: --device $DLMJAX_TEST_DEVICE: choose cpu, gpu or tpu" >&2; exit 2 ;;
  esac
fi
exec "$PY" -m pytest -q "${workers[@]}" "$@"
