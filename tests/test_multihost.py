"""Multi-host training, tested on one machine.

- `dlmjax.distributed.plan`: which launch the flags and the environment describe; half-given
  settings are refused naming what is missing.
- On 8 fake CPU devices: training on a 2x4 (data x model) mesh takes the single-device steps; its
  checkpoint restores on 4x2 and 8x1 to the same params, bit for bit, and training resumes there
  with the single-device run's losses.
- 2 processes x 4 CPU devices through jax.distributed (a local coordinator, gloo collectives):
  train, stop, resume through `dlmjax train --coordinator ...`, and end at the single-process
  run's params; eval and generate equal one process's; scoring is split over the processes.
"""

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dlmjax.distributed import plan
from dlmjax.io.hf import load_model
from dlmjax.sharding import make_mesh
from dlmjax.train.config import load_run_config
from dlmjax.train.data import global_batch, process_rows
from dlmjax.train.loop import restore_checkpoint, train
from dlmjax.validation import InputError

REPO = Path(__file__).resolve().parent.parent
OVERRIDES = ["train.steps=4", "train.batch_size=8", "train.log_every=1", "train.checkpoint_every=2",
             "train.eval_every=0", "train.warmup_steps=2", "train.init_from=null", "data.tasks={toy-arith: 1}",
             "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.head_dim=8",
             "model.block_size=4"]


def run_config():
    return load_run_config(REPO / "configs/toy-sdar.yaml", OVERRIDES)


def flat_params(model) -> dict:
    return {".".join(map(str, path)): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model))}


# ---------------------------------------------------------------------------------------------
# Launch planning: flags > DLMJAX_* variables > SLURM > TPU VM > one process.


def test_plan_single_explicit_and_slurm():
    assert plan(environ={}).mode == "single"
    env = {"DLMJAX_COORDINATOR": "10.0.0.2:8476", "DLMJAX_NUM_PROCESSES": "4", "DLMJAX_PROCESS_ID": "3"}
    launch = plan(environ=env)
    assert (launch.mode, launch.coordinator, launch.num_processes, launch.process_id) == ("explicit", "10.0.0.2:8476",
                                                                                            4, 3)
    assert plan("h:1", 2, 0, environ=env).process_id == 0  # flags win over the environment
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_PROCID": "5"}
    assert plan(environ=slurm).mode == "slurm"
    assert plan(environ={**slurm, "SLURM_NTASKS": "1"}).mode == "single"  # one task: nothing to join
    assert plan(environ={**slurm, "SLURM_STEP_NUM_TASKS": "1"}).mode == "single"  # a batch script's own step
    # an explicit coordinator under SLURM takes the process id from SLURM_PROCID
    assert plan("h:1", 8, environ=slurm).process_id == 5
    assert plan(environ={"DLMJAX_DISTRIBUTED": "off", **slurm}).mode == "single"


@pytest.mark.parametrize("args, env, match", [
    (("h:1", None, None), {}, "missing --num-processes N.*--process-id I"),
    ((None, None, None), {"DLMJAX_NUM_PROCESSES": "2"}, r"missing --coordinator HOST:PORT \(or DLMJAX_COORDINATOR\)"),
    (("localhost", 2, 0), {}, "not HOST:PORT"),
    (("h:99999", 2, 0), {}, "not HOST:PORT"),
    (("h:1", 2, 2), {}, r"process id 2 is out of range for 2 processes; ids run 0..1"),
    (("h:1", 0, 0), {}, "--num-processes=0 must be >= 1"),
    ((None, None, None), {"DLMJAX_COORDINATOR": "h:1", "DLMJAX_NUM_PROCESSES": "two", "DLMJAX_PROCESS_ID": "0"},
     "DLMJAX_NUM_PROCESSES='two' is not an integer"),
    (("h:1", 2, 0), {"DLMJAX_DISTRIBUTED": "off"}, "turns multi-process off"),
    # the variable named is the one the value came from
    ((None, None, None),
     {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "eight", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "0"},
     "SLURM_NTASKS='eight' is not an integer"),
])
def test_plan_refuses_half_given_settings(args, env, match):
    with pytest.raises(InputError, match=match):
        plan(*args, environ=env)


def test_a_coordinator_port_in_use_is_refused_before_jax_binds_it():
    """JAX's gRPC server segfaulted process 0 on a port another program held."""
    from dlmjax.distributed import check_port_free

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(InputError, match=f"coordinator port {port} is in use on this machine .*pick a free port"):
            check_port_free(f"127.0.0.1:{port}")
    check_port_free(f"127.0.0.1:{port}")  # free again once closed


def test_cli_refuses_a_half_given_launch(tmp_path, capsys):
    from dlmjax.cli import main

    code = main(["train", str(REPO / "configs/toy-sdar.yaml"), "--out", str(tmp_path / "run"), "--coordinator",
                 "localhost:1234"])
    assert code == 2
    assert "missing --num-processes N" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# 8 fake devices in one process.


@pytest.mark.devices(8)
def test_process_rows_and_global_batch_on_one_process():
    mesh = make_mesh(model=2)  # 4 x 2
    rows = process_rows(mesh, 8)
    assert rows.tolist() == list(range(8))
    tokens = np.arange(8 * 3).reshape(8, 3)
    arrays = global_batch({"tokens": tokens}, rows, mesh, 8)
    assert arrays["tokens"].sharding.spec[0] == "data"
    np.testing.assert_array_equal(np.asarray(arrays["tokens"]), tokens)
    with pytest.raises(InputError, match="multiple of the 4 data-parallel devices"):
        process_rows(mesh, 6)


@pytest.fixture(scope="module")
def single_device_run(tmp_path_factory):
    """The reference: the same 4 steps on one device."""
    out = tmp_path_factory.mktemp("single")
    result = train(run_config(), out / "run", progress=False, mesh=make_mesh(devices=jax.devices()[:1]))
    return result.losses, flat_params(load_model(result.model_dir))


@pytest.mark.devices(8)
def test_checkpoint_of_a_2x4_mesh_restores_on_4x2_and_8x1(tmp_path, single_device_run):
    losses, params = single_device_run
    run = run_config()
    first = train(run, tmp_path / "a", stop_at=2, progress=False, mesh=make_mesh(data=2, model=4))
    assert first.step == 2 and first.model_dir is None
    for step in (1, 2):  # the sharded step is the single-device step (up to float summation order)
        np.testing.assert_allclose(first.losses[step], losses[step], rtol=1e-5)

    _, saved, saved_opt = restore_checkpoint(tmp_path / "a", make_mesh(data=2, model=4))
    assert saved["layers"][0]["mlp"]["gate_up"]["kernel"][...].sharding.spec == P(None, "model")  # tensor-parallel
    for shape in ((4, 2), (8, 1)):
        mesh = make_mesh(data=shape[0], model=shape[1])
        _, restored, opt_state = restore_checkpoint(tmp_path / "a", mesh)
        gate_up = restored["layers"][0]["mlp"]["gate_up"]["kernel"][...]
        assert dict(gate_up.sharding.mesh.shape)["model"] == shape[1] and gate_up.sharding.spec == P(None, "model")
        for x, y in zip(jax.tree.leaves((saved, saved_opt)), jax.tree.leaves((restored, opt_state))):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # the same params and moments

        resumed_dir = tmp_path / f"resumed-{shape[0]}x{shape[1]}"
        shutil.copytree(tmp_path / "a", resumed_dir)
        resumed = train(run, resumed_dir, progress=False, mesh=mesh)
        assert sorted(resumed.losses) == [3, 4]
        for step in (3, 4):
            np.testing.assert_allclose(resumed.losses[step], losses[step], rtol=1e-5)
        got = flat_params(load_model(resumed.model_dir))
        for name, value in params.items():
            np.testing.assert_allclose(got[name], value, atol=2e-6, rtol=0, err_msg=name)
    lines = [json.loads(line)["step"] for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3, 4]
    with pytest.raises(InputError, match=r"no checkpoint of step 3; its checkpoints: \[2, 4\]"):
        restore_checkpoint(resumed_dir, mesh, step=3)


# ---------------------------------------------------------------------------------------------
# 2 processes x 4 CPU devices.

FIRST_LAUNCH = """
import json, sys
from dlmjax.distributed import initialize
launch = initialize(sys.argv[1], 2, int(sys.argv[2]))  # the explicit arguments
from dlmjax.sharding import make_mesh
from dlmjax.train.config import load_run_config
from dlmjax.train.loop import train
run = load_run_config(sys.argv[3], json.loads(sys.argv[4]))
result = train(run, sys.argv[5], stop_at=2, progress=False, mesh=make_mesh(model=2))  # 4 x 2 over 2 processes
import jax
print("RESULT", json.dumps({"mode": launch.mode, "processes": jax.process_count(), "devices": jax.device_count(),
                            "step": result.step, "losses": result.losses}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCH_LOCK = Path(tempfile.gettempdir()) / "dlmjax-tests-multiprocess.lock"


def _launch(make_commands, logs: Path, timeout=300):
    """Start one process per command of `make_commands(coordinator)` (a free local port each try)
    and wait for all; their outputs. A process that fails stops the others at once (a survivor
    would wait for it in a collective); a coordinator port taken meanwhile is retried with another.
    One launch at a time across the suite's xdist workers (a file lock): two launches that drew the
    same free port would join one another's run."""
    with LAUNCH_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _launch_alone(make_commands, logs, timeout)


def _launch_alone(make_commands, logs: Path, timeout):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"}
    for name in ("DLMJAX_DISTRIBUTED", "DLMJAX_COORDINATOR", "DLMJAX_NUM_PROCESSES", "DLMJAX_PROCESS_ID"):
        env.pop(name, None)
    for attempt in range(3):
        commands = make_commands(f"127.0.0.1:{_free_port()}")
        paths = [logs / f"launch-{attempt}-process-{i}.log" for i in range(len(commands))]
        procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=path.open("w"), stderr=subprocess.STDOUT)
                 for cmd, path in zip(commands, paths)]
        deadline = time.monotonic() + timeout
        try:
            while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
                if any(proc.poll() not in (None, 0) for proc in procs):
                    break
                time.sleep(0.2)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGABRT)  # faulthandler prints where it was stuck
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        outs = [path.read_text() for path in paths]
        if all(proc.returncode == 0 for proc in procs):
            return outs
        if attempt < 2 and any("already in use" in out.lower() or "failed to bind" in out.lower() for out in outs):
            continue
        report = "\n".join(f"--- process {i} (exit {proc.returncode}):\n{out[-3000:]}"
                            for i, (proc, out) in enumerate(zip(procs, outs)))
        pytest.fail(f"a process failed or hung:\n{report}")


def test_two_processes_train_stop_and_resume(tmp_path, single_device_run):
    losses, params = single_device_run
    config, run_dir = str(REPO / "configs/toy-sdar.yaml"), str(tmp_path / "run")
    overrides = OVERRIDES + ["train.eval_every=4", "train.eval_examples=2"]  # process 0 evaluates at the end

    outs = _launch(lambda coordinator: [[sys.executable, "-c", FIRST_LAUNCH, coordinator, str(i), config,
                                         json.dumps(overrides), run_dir] for i in range(2)], tmp_path)
    results = [json.loads(line.split("RESULT ", 1)[1]) for out in outs for line in out.splitlines()
               if line.startswith("RESULT ")]
    assert [(r["mode"], r["processes"], r["devices"], r["step"]) for r in results] == [("explicit", 2, 8, 2)] * 2
    for r in results:  # every process sees the same replicated loss: the global batch's
        for step in (1, 2):
            np.testing.assert_allclose(r["losses"][str(step)], losses[step], rtol=1e-5)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]  # one checkpoint, once

    # Resume through the CLI, on the default mesh (8 x 1 over both processes), a new coordinator.
    outs = _launch(lambda coordinator: [[sys.executable, "-m", "dlmjax.cli", "train", config, *overrides, "--out",
                                         run_dir, "--no-progress", "--coordinator", coordinator, "--num-processes",
                                         "2", "--process-id", str(i)] for i in range(2)], tmp_path)
    assert "trained 4 steps; model written to" in outs[0]
    assert "trained 4 steps" not in outs[1]  # process 0 alone reports
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [1, 2, 3, 4, 4]  # written by process 0 only
    assert {"eval/toy-arith"} == set(logged[-1]) - {"step"}  # evaluated by process 0 alone
    for line in logged[:-1]:
        np.testing.assert_allclose(line["loss"], losses[line["step"]], rtol=1e-5)
    got = flat_params(load_model(tmp_path / "run" / "model"))
    print("largest difference from the single-device params:", max(np.abs(got[k] - v).max() for k, v in params.items()))
    for name, value in params.items():
        np.testing.assert_allclose(got[name], value, atol=2e-6, rtol=0, err_msg=name)


def test_two_processes_evaluate_as_one_process(tmp_path):
    """`dlmjax eval` on 2 processes x 4 devices (the default mesh: data=8 over both): each process
    decodes its rows of every batch, and process 0 alone prints and writes results whose outputs
    and accuracy equal one process's on 8 devices."""
    from dlmjax.evaluation.runner import run_eval
    from dlmjax.evaluation.tasks import load_eval_set
    from dlmjax.presets import load_checkpoint

    out = tmp_path / "eval"
    args = ["eval", "--model", "toy-sdar", "--task", "toy-arith", "--limit", "12", "--decoder", "threshold",
            "--batch-size", "8", "--save-outputs", "--no-progress", "--out", str(out)]
    outs = _launch(lambda coordinator: [[sys.executable, "-m", "dlmjax.cli", *args, "--coordinator", coordinator,
                                         "--num-processes", "2", "--process-id", str(i)] for i in range(2)], tmp_path)
    assert "wrote " in outs[0] and "| toy-arith |" in outs[0]
    assert "wrote " not in outs[1] and "| toy-arith |" not in outs[1]  # process 0 alone reports
    got = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    results = json.loads((out / "results.json").read_text())

    mesh = make_mesh(data=8)
    _, model, tokenizer, _ = load_checkpoint("toy-sdar", mesh=mesh)
    records, expected = run_eval(model, tokenizer, [load_eval_set("toy-arith", limit=12)], ["threshold"],
                                 model_name="toy-sdar", batch_size=8, mesh=mesh, progress=False, warmup=False)
    assert [(o["index"], o["tokens"]) for o in got] == [(o["index"], o["tokens"]) for o in expected]
    assert results["runs"][0]["accuracy"] == records[0].accuracy
    assert results["settings"]["devices"] == {**results["settings"]["devices"], "count": 8, "processes": 2}


SHARED_FLAGS_SCRIPT = """
import json, sys
import jax
from dlmjax import distributed
distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
seen = []
from dlmjax.sharding import make_mesh
flags = distributed.shared_flags(lambda share: seen.extend(share) or [i % 3 == 0 for i in share], 7, mesh=make_mesh())
alone = distributed.shared_flags(lambda share: [i % 3 == 0 for i in share], 7, mesh=make_mesh(devices=jax.local_devices()))
print(json.dumps({"seen": seen, "flags": flags, "alone": alone}))
"""


def test_shared_flags_splits_the_work_over_processes_and_gives_each_the_whole(tmp_path):
    """Work each host would repeat (eval scoring, the code sandbox) is split over a mesh of every
    process: process p computes the indices p, p+2, ..., and both get all 7 flags back, in order,
    as one process computes them. On a mesh of one process's devices (process 0 evaluating alone
    in training) each computes all, with no collective, which would pair with another's."""
    from dlmjax.distributed import shared_flags

    outs = _launch(lambda coordinator: [[sys.executable, "-c", SHARED_FLAGS_SCRIPT, coordinator, str(i)]
                                        for i in range(2)], tmp_path)
    got = [json.loads(next(line for line in out.splitlines() if line.startswith("{"))) for out in outs]
    assert [g["seen"] for g in got] == [[0, 2, 4, 6], [1, 3, 5]]
    expected = shared_flags(lambda share: [i % 3 == 0 for i in share], 7)
    assert expected == [True, False, False, True, False, False, True]
    assert got[0]["flags"] == got[1]["flags"] == expected
    assert got[0]["alone"] == got[1]["alone"] == expected  # a mesh of one process's devices: no collective


@pytest.mark.devices(8)
def test_two_processes_generate_as_one_process(tmp_path, capsys):
    """`dlmjax generate` on 2 processes x 4 devices without --mesh splits its prompts over every
    device (copies of the last prompt fill the last device's share: 3 prompts over 8), and
    process 0 alone prints the rows one process prints on the same mesh."""
    from dlmjax.cli import main

    args = ["generate", "--model", "toy-sdar", "--prompt", "12+7=", "--prompt", "3+4=", "--prompt", "5+5=",
            "--max-new-tokens", "8", "--json"]
    outs = _launch(lambda coordinator: [[sys.executable, "-m", "dlmjax.cli", *args, "--coordinator", coordinator,
                                         "--num-processes", "2", "--process-id", str(i)] for i in range(2)], tmp_path)
    rows = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outs]
    assert main([*args, "--mesh", "data=8"]) == 0
    expected = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(expected) == 3 and rows[1] == []
    assert [r["tokens"] for r in rows[0]] == [r["tokens"] for r in expected]
