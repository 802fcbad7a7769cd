"""Multi-process JAX: `jax.distributed.initialize` from the environment, and process-0 helpers.

`initialize()` (called by `dlmjax train` before anything touches a device) picks, in order:

1. an explicit coordinator: the arguments (`dlmjax train --coordinator HOST:PORT --num-processes N
   --process-id I`) or the environment (DLMJAX_COORDINATOR, DLMJAX_NUM_PROCESSES,
   DLMJAX_PROCESS_ID); all three or none (the process id may come from SLURM_PROCID instead);
2. SLURM: inside an `srun` step of more than one task (SLURM_JOB_ID, SLURM_STEP_NODELIST,
   SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS > 1; a batch script's own step has one),
   JAX reads the coordinator, process count and id from SLURM;
3. a Cloud TPU VM (libtpu installed and TPU chips present, or TPU_WORKER_HOSTNAMES set): JAX
   detects the pod slice's workers from the TPU metadata; a single-host slice is one process;
4. otherwise nothing: one process, every device local (the default, and what tests run).

DLMJAX_DISTRIBUTED=off skips all of it. On CPU, cross-process collectives use gloo (jax's
default, `jax_cpu_collectives_implementation`), so N local processes behave like N hosts.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import multihost_utils

from dlmjax.validation import InputError

ENV_COORDINATOR = "DLMJAX_COORDINATOR"
ENV_NUM_PROCESSES = "DLMJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "DLMJAX_PROCESS_ID"
ENV_SWITCH = "DLMJAX_DISTRIBUTED"  # "off": never initialise


@dataclass(frozen=True)
class Launch:
    """How this process joins (or not) a multi-process run: `mode` is explicit, slurm, tpu or single."""

    mode: str
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def _count(name: str, value, low: int) -> int | None:
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}={value!r} is not an integer; give a whole number >= {low}") from None
    if number < low:
        raise InputError(f"{name}={number} must be >= {low}")
    return number


def _on_tpu_vm(environ) -> bool:
    if environ.get("TPU_WORKER_HOSTNAMES") or environ.get("TPU_PROCESS_ADDRESSES"):
        return True
    if importlib.util.find_spec("libtpu") is None:
        return False
    return any(name.startswith("accel") for name in _listdir("/dev")) or bool(_listdir("/dev/vfio"))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def plan(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
         environ=None) -> Launch:
    """The launch the arguments and the environment describe (nothing is started). A half-given
    explicit setting (a coordinator without a process count, an id beyond the count, ...) is an
    InputError naming what is missing."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_SWITCH, "").lower() in ("off", "0", "false", "no"):
        if coordinator or num_processes or process_id is not None:
            raise InputError(f"{ENV_SWITCH}={environ[ENV_SWITCH]} turns multi-process off, but a coordinator, "
                             "process count or id was given; unset one of them")
        return Launch("single")
    coordinator = coordinator or environ.get(ENV_COORDINATOR) or None
    num_processes = _count("--num-processes", num_processes, 1) if num_processes is not None else _count(
        ENV_NUM_PROCESSES, environ.get(ENV_NUM_PROCESSES), 1)
    process_id = _count("--process-id", process_id, 0) if process_id is not None else _count(
        ENV_PROCESS_ID, environ.get(ENV_PROCESS_ID), 0)
    if coordinator is not None or num_processes is not None or process_id is not None:
        if process_id is None and environ.get("SLURM_PROCID", "") != "":
            process_id = _count("SLURM_PROCID", environ["SLURM_PROCID"], 0)
        missing = [name for name, value in (
            (f"--coordinator HOST:PORT (or {ENV_COORDINATOR})", coordinator),
            (f"--num-processes N (or {ENV_NUM_PROCESSES})", num_processes),
            (f"--process-id I (or {ENV_PROCESS_ID})", process_id)) if value is None]
        if missing:
            raise InputError(f"a multi-process run needs a coordinator, the number of processes and this process's "
                             f"id; missing {', '.join(missing)} (or give none of them on one process)")
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InputError(f"coordinator {coordinator!r} is not HOST:PORT (e.g. 10.0.0.2:8476, the address of "
                             "process 0 and a free port)")
        if process_id >= num_processes:
            raise InputError(f"process id {process_id} is out of range for {num_processes} processes; ids run "
                             f"0..{num_processes - 1}")
        return Launch("explicit", coordinator, num_processes, process_id)
    # the step's task count (a batch script's own step: 1), named by the variable it came from
    tasks_var = "SLURM_STEP_NUM_TASKS" if environ.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    if environ.get("SLURM_JOB_ID") and environ.get("SLURM_STEP_NODELIST") and environ.get("SLURM_PROCID") and \
            (_count(tasks_var, environ.get(tasks_var), 1) or 1) > 1:
        return Launch("slurm")
    if _on_tpu_vm(environ):
        return Launch("tpu")
    return Launch("single")


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, local_device_ids=None) -> Launch:
    """Join the multi-process run the arguments or the environment describe (see the module
    docstring); on one process, do nothing. Call it before any JAX computation. Calling it again
    (or after `jax.distributed.initialize`) is a no-op."""
    launch = plan(coordinator, num_processes, process_id)
    if launch.mode == "single" or jax.distributed.is_initialized():
        return launch
    if launch.mode == "explicit":
        if launch.process_id == 0:
            check_port_free(launch.coordinator)
        jax.distributed.initialize(launch.coordinator, launch.num_processes, launch.process_id,
                                   local_device_ids=local_device_ids)
    elif launch.mode == "slurm":
        jax.distributed.initialize(cluster_detection_method="slurm", local_device_ids=local_device_ids)
    else:  # tpu: a single-host TPU VM has no cluster to join, and stays one process
        try:
            jax.distributed.initialize(local_device_ids=local_device_ids)
        except ValueError:
            return Launch("single")
    return launch


def check_port_free(coordinator: str) -> None:
    """Process 0 serves the coordinator on its port: refuse a port another program holds (JAX's
    gRPC server crashes the process with a segfault there)."""
    port = int(coordinator.rpartition(":")[2])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port a closed run left in TIME_WAIT is free
        try:
            probe.bind(("", port))
        except OSError as err:
            raise InputError(f"coordinator port {port} is in use on this machine ({err.strerror}); pick a free port "
                             "for --coordinator HOST:PORT on every process") from None


def is_main() -> bool:
    """Process 0: the one that logs, shows progress and writes the run's own files."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """Every process waits here until all have arrived (nothing to do on one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def shared_flags(fn, count: int, *, mesh=None) -> list[bool]:
    """fn(indices) -> one bool per index, for the indices 0..count-1, computed once across the
    processes of `mesh`, which must be every process (it is a collective): process p takes every
    P-th index from p (`jax.process_count()` = P), and every process gets the whole list back.
    Used for work each host would otherwise repeat, such as scoring eval outputs in the code
    sandbox. Without a mesh, or on a mesh of one process's devices (e.g. process 0 evaluating
    alone during training), it is fn(range(count))."""
    processes = jax.process_count()
    if mesh is None or len({device.process_index for device in mesh.devices.flat}) == 1:
        return [bool(flag) for flag in fn(list(range(count)))]
    mine = list(range(jax.process_index(), count, processes))
    local = np.zeros(-(-count // processes), np.int32)
    local[:len(mine)] = [bool(flag) for flag in fn(mine)]
    gathered = np.asarray(multihost_utils.process_allgather(local))  # [processes, share]
    return [bool(gathered[index % processes, index // processes]) for index in range(count)]
