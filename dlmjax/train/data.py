"""Training batches from the toy tasks: a pure function of (seed, step), so a resumed run sees
exactly the batches it would have seen.

Multi-process runs: each process encodes only the rows of the global batch that its devices hold
(`process_rows`) and `global_batch` assembles the global [B, ...] arrays, split over the mesh's
batch axes ('data', and 'fsdp' where there is one), from those process-local rows (no process
ever holds another's rows on device). The rows' padded width is the global batch's (the largest
over processes), so the global batch is the one a single process would build. The toy sampler
draws a step's examples in sequence from one RNG, so every process draws all of them
(microseconds) and keeps its own.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from dlmjax.sharding import batch_sharding
from dlmjax.toy.tasks import get_task
from dlmjax.validation import InputError


@dataclass(frozen=True)
class Batch:
    tokens: np.ndarray  # [B, L] int32
    valid: np.ndarray  # [B, L] bool: real tokens (prompt, target, EOS fill)
    target: np.ndarray  # [B, L] bool: positions the model generates (target + EOS fill)


class DataError(InputError):
    pass


def _step_rng(seed: int, step: int) -> random.Random:
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def sample_examples(task_weights: dict[str, float], batch_size: int, seed: int, step: int):
    """`batch_size` examples for `step`, all from one task drawn with `task_weights`.

    One task per step keeps a batch's rows of similar length, so short tasks are not padded to
    the longest task's length (see `make_batch`)."""
    rng = _step_rng(seed, step)
    names = sorted(task_weights)
    task = get_task(rng.choices(names, [task_weights[n] for n in names])[0])
    return [task.sample(rng) for _ in range(batch_size)]


def encode_row(prompt_ids, target_ids, *, eos_id: int, pad_id: int, seq_len: int, block: int | None):
    """(tokens, valid, target) for one row; `block` None for autoregressive models."""
    row = list(prompt_ids) + list(target_ids) + [eos_id]
    if block:
        row += [eos_id] * (-len(row) % block)
    if len(row) > seq_len:
        raise DataError(
            f"an example needs {len(row)} tokens but seq_len={seq_len}; raise seq_len in the config "
            f"(e.g. seq_len={-(-len(row) // 16) * 16})"
        )
    tokens = np.full(seq_len, pad_id, np.int32)
    tokens[: len(row)] = row
    valid = np.arange(seq_len) < len(row)
    target = valid & (np.arange(seq_len) >= len(prompt_ids))
    return tokens, valid, target


def make_batch(examples, tokenizer, *, seq_len: int, block: int | None, pad_id: int, bucket: int = 8) -> Batch:
    """Rows padded to the longest row rounded up to `bucket` (at most `seq_len`): few distinct
    shapes to compile, little padding. In a multi-process run, `pad_batch` then widens each
    process's rows to the global batch's width."""
    rows = [
        encode_row(tokenizer.encode(ex.prompt), tokenizer.encode(ex.target), eos_id=tokenizer.eos_id,
                   pad_id=pad_id, seq_len=seq_len, block=block)
        for ex in examples
    ]
    tokens, valid, target = (np.stack(parts) for parts in zip(*rows))
    width = min(seq_len, -(-int(valid.sum(axis=1).max()) // bucket) * bucket)
    return Batch(tokens=tokens[:, :width], valid=valid[:, :width], target=target[:, :width])


def batch_split(mesh: Mesh) -> tuple[tuple[str, ...], int]:
    """(the mesh axes a batch is split over, the number of slices): dlmjax.sharding's rule for the
    'batch' logical axis ('data', and 'fsdp' where the mesh has one)."""
    axes = batch_sharding(mesh, 1).spec[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return axes, int(np.prod([mesh.shape[a] for a in axes]))


def process_rows(mesh: Mesh, batch_size: int) -> np.ndarray:
    """The rows of a [batch_size, ...] global batch (split over the batch axes) that this process's
    devices hold, ascending; all of them on one process."""
    axes, split = batch_split(mesh)
    if batch_size % split:
        raise InputError(f"train.batch_size={batch_size} must be a multiple of the {split} data-parallel devices "
                         f"(mesh {' x '.join(axes)}); change the batch size or the mesh")
    rows = set()
    for index in batch_sharding(mesh, 1).addressable_devices_indices_map((batch_size,)).values():
        rows.update(range(batch_size)[index[0]])
    return np.asarray(sorted(rows), np.int64)


def pad_batch(batch: Batch, width: int, pad_id: int) -> Batch:
    """`batch` widened to `width` columns of padding (not valid, not target)."""
    extra = width - batch.tokens.shape[1]
    if extra <= 0:
        return batch
    pad = lambda a, value: np.pad(a, ((0, 0), (0, extra)), constant_values=value)  # noqa: E731
    return Batch(tokens=pad(batch.tokens, pad_id), valid=pad(batch.valid, False), target=pad(batch.target, False))


def global_width(local_width: int) -> int:
    """The widest process's batch width (this process's own on one process)."""
    if jax.process_count() == 1:
        return local_width
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.int32(local_width))))


def global_batch(local: dict, rows: np.ndarray, mesh: Mesh, batch_size: int) -> dict:
    """Global jax.Arrays [batch_size, ...] split over the batch axes from this process's `rows` of them
    (`local[name][i]` is global row `rows[i]`); each device gets its slice of the local rows."""

    def assemble(array):
        array = np.asarray(array)
        if array.shape[0] != len(rows):
            raise ValueError(f"{array.shape[0]} local rows for the {len(rows)} rows this process holds")
        sharding = batch_sharding(mesh, array.ndim)
        shape = (batch_size,) + array.shape[1:]

        def shard(index):
            wanted = np.arange(batch_size)[index[0]]
            return array[np.searchsorted(rows, wanted)][(slice(None),) + tuple(index[1:])]

        return jax.make_array_from_callback(shape, sharding, shard)

    return {name: assemble(array) for name, array in local.items()}
