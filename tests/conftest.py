"""Test setup: 8 fake CPU devices (set before jax starts) and offline Hugging Face libraries.

`scripts/test.sh --device gpu` (or tpu) sets DLMJAX_TEST_DEVICE: the suite then runs on the
accelerator with full-fp32 matmuls (JAX_DEFAULT_MATMUL_PRECISION=highest) and batch-invariant
numerics (DLMJAX_INVARIANT=1), the settings under which parity and lossless equalities hold
there. Tests marked `devices(n)` skip, with their reason, where fewer devices exist. Where the
python's jax has no such device, the run stops before any test, naming the fix.
"""

import gc
import os
import sys
from pathlib import Path

# The test models are tiny, so the suite's time is mostly XLA compiling; LLVM's backend
# optimisation level 0 compiles about 25% faster (same HLO, same numerics to test tolerance).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
if os.environ.get("DLMJAX_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # XLA:CPU's older fusion emitters compile the engine's programs 20-30% faster than its MLIR
    # ones (benchmarks/results/compile_flags/cpu.md); test_numerics checks the users' default
    # flags in a process of its own.
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
else:
    # XLA's GPU autotuner times several configurations of every matmul it compiles; the tests'
    # many small programs need none of that (and each one's choice is then fixed, not timed).
    os.environ["XLA_FLAGS"] += " --xla_gpu_autotune_level=0"
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    os.environ.setdefault("DLMJAX_INVARIANT", "1")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and several workers share the device
# Most of the suite's time is XLA compiling decode programs, and tests in different modules, the
# two xdist workers and the CLI tests' subprocesses compile many of the same ones: one persistent
# compilation cache per run (unless the environment names one), made by the first process to
# import this file (pytest's, before its workers start), shared through the environment with the
# workers and subprocesses, and removed by that process at the end.
_RUN_CACHE_OWNER = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _RUN_CACHE_OWNER:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="dlmjax-test-jax-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).parent))  # test helpers (tiny_models.py)

# Hypothesis draws the same examples on every run (seeded from each test), and keeps no example
# database: a run neither depends on nor writes what an earlier run found.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("dlmjax", derandomize=True, database=None)
_hypothesis_settings.load_profile("dlmjax")


import jax  # noqa: E402  (after the XLA flags above)
import pytest  # noqa: E402


def pytest_unconfigure(config):
    if _RUN_CACHE_OWNER:
        import shutil

        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def kernel_numerics():
    """For tests that check the kernels: the batch-invariant numerics keep the references (which
    `scripts/test.sh --device gpu` turns on for the rest of the suite), so they are off here."""
    import dlmjax

    with dlmjax.numerics(invariant=False):
        yield


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Each worker runs hundreds of tests; jax keeps every compiled program (and the arrays its
    caches hold) until told otherwise, so without this a worker's memory only grows. Tests in
    one module share shapes; across modules they rarely do."""
    yield
    jax.clear_caches()
    gc.collect()


def pytest_configure(config):
    config.addinivalue_line("markers", "devices(n): needs n jax devices (8 fake CPU devices here); skipped with fewer")
    wanted = os.environ.get("DLMJAX_TEST_DEVICE", "cpu")
    if wanted != "cpu" and jax.default_backend() != wanted:  # else the "device" suite would run on the CPU
        pytest.exit(f"scripts/test.sh --device {wanted}: this python's jax ({sys.executable}) has no {wanted} "
                    f"backend, only {jax.default_backend()}. Run the suite with a python whose jax has the "
                    f"accelerator's plugin: DLMJAX_PYTHON=python3 scripts/test.sh --device {wanted} (the "
                    f"virtualenv that scripts/test.sh makes holds CPU jax), or install it into that virtualenv.",
                    returncode=2)


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("devices")
    if marker is not None and len(jax.devices()) < marker.args[0]:
        pytest.skip(f"needs {marker.args[0]} devices, {jax.default_backend()} has {len(jax.devices())}")
