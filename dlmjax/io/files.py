"""Writes that a killed process cannot leave half done.

Every file dlmjax writes into a checkpoint goes to a temporary name first and is renamed into
place (`atomic_file`, `write_atomic`): a file is either its previous version or its new one.
A whole checkpoint directory is staged beside its target (`staged_dir`) and swapped in by two
renames at the end, so a kill while writing leaves the previous directory as it was. The one
window left, between the two renames, leaves the previous directory whole under its backup name;
the next `staged_dir` of the same target puts it back first.
(Training checkpoints are Orbax's, which stages them the same way.)

Staging names carry the host and the process id (`.NAME.partial-HOST-PID`): leftovers of killed
processes are removed by the next write on the same host, and never those of another host, whose
processes this one cannot see (a filesystem shared between machines).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

from dlmjax.validation import InputError

PARTIAL = ".partial-"  # staging names: `.NAME.partial-HOST-PID` beside the target (hidden)
PREVIOUS = ".previous"  # the target's old version while it is swapped: `.NAME.previous`
_ACTIVE: set[Path] = set()  # this process's open staging directories (a staged_dir into one writes there)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "localhost"


def _staging_name(name: str) -> str:
    return f".{name}{PARTIAL}{_host()}-{os.getpid()}"


def is_staging_name(name: str) -> bool:
    """Names `staged_dir` and `atomic_file` use beside their targets (skipped by directory checks)."""
    return name.startswith(".") and (PARTIAL in name or name.endswith(PREVIOUS))


def _remove_stale(parent: Path) -> None:
    """Staging leftovers in `parent` of this host's processes that were killed (nested ones included);
    another host's are kept (its processes may be alive), and so are names without a host."""
    own = f"{PARTIAL}{_host()}"
    for leftover in parent.glob(f".*{PARTIAL}*"):
        head, _, pid = leftover.name.rpartition("-")
        if head.endswith(own) and pid.isascii() and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(leftover) if leftover.is_dir() and not leftover.is_symlink() else leftover.unlink()


@contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a temporary path beside `path`; on success it replaces `path` (one rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path.parent)
    tmp = path.parent / _staging_name(path.name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def absolute_if_local(source):
    """A local file's or directory's absolute path (`~` expanded) where it exists here, so that a
    run resumes, and a results file is read, from any working directory; anything else (a Hugging
    Face name, a preset name, None, or a mistake the reader will name) as given."""
    local = Path(source).expanduser() if source else None
    return str(local.resolve()) if local is not None and local.exists() else source


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes (read in chunks: a data file may be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def restore_interrupted(target: Path) -> None:
    """Put back a directory whose swap was killed between its two renames."""
    previous = target.parent / f".{target.name}{PREVIOUS}"
    if previous.is_dir() and not target.exists():
        os.rename(previous, target)


def check_output_dir(target: str | os.PathLike) -> Path:
    """`target` as an absolute path to a directory that can be made or written, refused
    (InputError) where it or a folder above it is a file, or where the nearest existing folder
    cannot be written. Commands call it before their work, so a mistyped --out is refused at
    once, not after a run. A URL (gs://, s3://) is refused: a local path would be made of it."""
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", str(target)):
        raise InputError(f"output directory {target} is a URL, which dlmjax does not write to; mount the bucket "
                         "(e.g. gcsfuse) and pass the mount's path")
    path = Path(os.path.abspath(target))
    for folder in (path, *path.parents):
        if folder.is_symlink() and not folder.exists():  # (exists() follows the link, to nothing)
            raise InputError(f"output directory {target}: {folder} is a link to nothing ({os.readlink(folder)}); "
                             "remove it or make its target")
        if folder.exists():
            if not folder.is_dir():
                where = "is a file" if folder == path else f"lies under {folder}, which is a file"
                raise InputError(f"output directory {target} {where}; choose a directory (new, or one to write into)")
            if not os.access(folder, os.W_OK | os.X_OK):  # a read-only filesystem, or no permission
                where = "" if folder == path else f": {folder} above it"
                raise InputError(f"output directory {target} cannot be written{where} (read-only or not yours); "
                                 "choose a directory you can write")
            break
    return path


def _check_target(target: str | os.PathLike) -> Path:
    """`target` as an absolute path, refused where it cannot be renamed away safely: the filesystem
    root, a mount point, or the current directory (or one holding it); or where it is a file."""
    path = check_output_dir(target)
    real = path.resolve()
    fix = f"write into a subdirectory of it instead (e.g. {path / 'model'})"
    if real.parent == real:
        raise InputError(f"{target} is the filesystem root, which cannot be replaced; {fix}")
    if os.path.ismount(real):
        raise InputError(f"{target} is a mount point, which cannot be replaced; {fix}")
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the current directory was removed: nothing to replace under the process
        cwd = None
    if cwd is not None and (real == cwd or real in cwd.parents):
        what = "the current directory" if real == cwd else "a directory holding the current directory"
        raise InputError(f"{target} is {what}, which would be replaced under the running process; {fix}")
    return path


def _link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    try:
        os.link(src, dst)  # same filesystem (the staging directory is beside the target): no bytes copied
    except OSError:
        shutil.copy2(src, dst)  # filesystems without hard links


def _carry_over(old: Path, new: Path) -> None:
    """Bring into `new` each entry of `old` that `new` lacks, as hard links (nothing big is copied).
    Called once the block has written everything, so no linked file is written through."""
    for entry in old.iterdir():
        dest = new / entry.name
        if dest.exists() or dest.is_symlink() or is_staging_name(entry.name):
            continue  # written by the block: its version wins, directories included (not merged)
        if entry.is_symlink():
            os.symlink(os.readlink(entry), dest)
        elif entry.is_dir():
            shutil.copytree(entry, dest, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, dest)


def _remove(path: Path) -> None:
    """Remove `path` whatever it is (a directory, a file, a symlink), if it exists."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def staged_dir(target: str | os.PathLike, *, keep_existing: bool = False):
    """Yield a fresh, empty staging directory beside `target`; when the block ends without an
    error, it replaces `target` (the old directory is removed only after the new one is in place).
    With `keep_existing`, the entries of `target` the block did not write are carried into the new
    directory (hard links, made after the block, so the old files are never written through). On an
    error the staging directory is removed and `target` is left as it was.

    Refused (InputError): the filesystem root, a mount point, the current directory or one holding
    it -- none can be renamed away; write into a subdirectory. A target that is an open staging
    directory of this process (an export into `dlmjax export`'s stage) is yielded as it is: one
    staged write, not two nested ones."""
    if Path(os.path.abspath(target)) in _ACTIVE:
        yield Path(os.path.abspath(target))  # the enclosing staged_dir swaps it in
        return
    target = Path(os.path.realpath(_check_target(target)))  # a symlink's directory is replaced, the link kept
    target.parent.mkdir(parents=True, exist_ok=True)
    restore_interrupted(target)
    _remove_stale(target.parent)
    staging = target.parent / _staging_name(target.name)
    previous = target.parent / f".{target.name}{PREVIOUS}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    _ACTIVE.add(staging)
    try:
        yield staging
        if keep_existing and target.is_dir():
            _carry_over(target, staging)
        _remove(previous)
        if target.exists():
            os.rename(target, previous)
        os.rename(staging, target)
        _remove(previous)
    finally:
        _ACTIVE.discard(staging)
        shutil.rmtree(staging, ignore_errors=True)
