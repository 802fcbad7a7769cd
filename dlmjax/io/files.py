"""Writes that a killed process cannot leave half done.

Every file dlmjax writes into a checkpoint goes to a temporary name first and is renamed into
place (`atomic_file`, `write_atomic`): a file is either its previous version or its new one.
A whole checkpoint directory is staged beside its target (`staged_dir`) and swapped in by two
renames at the end, so a kill while writing leaves the previous directory as it was. The one
window left, between the two renames, leaves the previous directory whole under its backup name;
the next `staged_dir` of the same target puts it back first.
(Training checkpoints are Orbax's, which stages them the same way.)
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

PARTIAL = ".partial-"  # staging names: `.NAME.partial-PID` beside the target (hidden)
PREVIOUS = ".previous"  # the target's old version while it is swapped: `.NAME.previous`


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_staging_name(name: str) -> bool:
    """Names `staged_dir` and `atomic_file` use beside their targets (skipped by directory checks)."""
    return name.startswith(".") and (PARTIAL in name or name.endswith(PREVIOUS))


def _remove_stale(parent: Path) -> None:
    """Staging leftovers in `parent` of processes that were killed (nested ones included)."""
    for leftover in parent.glob(f".*{PARTIAL}*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()


@contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a temporary path beside `path`; on success it replaces `path` (one rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path.parent)
    tmp = path.parent / f".{path.name}{PARTIAL}{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def restore_interrupted(target: Path) -> None:
    """Put back a directory whose swap was killed between its two renames."""
    previous = target.parent / f".{target.name}{PREVIOUS}"
    if previous.is_dir() and not target.exists():
        os.rename(previous, target)


@contextmanager
def staged_dir(target: str | os.PathLike, *, keep_existing: bool = False):
    """Yield a fresh staging directory beside `target`; when the block ends without an error, it
    replaces `target` (the old directory is removed only after the new one is in place). With
    `keep_existing`, the staging directory starts as a copy of `target`'s current files. On an
    error the staging directory is removed and `target` is left as it was."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    restore_interrupted(target)
    _remove_stale(target.parent)
    staging = target.parent / f".{target.name}{PARTIAL}{os.getpid()}"
    previous = target.parent / f".{target.name}{PREVIOUS}"
    shutil.rmtree(staging, ignore_errors=True)
    if keep_existing and target.is_dir():
        shutil.copytree(target, staging, symlinks=True)
    else:
        staging.mkdir()
    try:
        yield staging
        shutil.rmtree(previous, ignore_errors=True)
        if target.exists():
            os.rename(target, previous)
        os.rename(staging, target)
        shutil.rmtree(previous, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
