"""Training batches from the toy tasks or from JSONL files of a real model's data (`FileTask`): a
pure function of (seed, step), so a resumed run sees exactly the batches it would have seen.

Multi-process runs: each process encodes only the rows of the global batch that its devices hold
(`process_rows`) and `global_batch` assembles the global [B, ...] arrays, split over the mesh's
batch axes ('data', and 'fsdp' where there is one), from those process-local rows (no process
ever holds another's rows on device). The rows' padded width is the global batch's (the largest
over processes), so the global batch is the one a single process would build. The toy sampler
draws a step's examples in sequence from one RNG, so every process draws all of them
(microseconds) and keeps its own.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from dlmjax.sharding import batch_sharding
from dlmjax.toy.tasks import Example, get_task
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


def sample_examples(task_weights: dict[str, float], batch_size: int, seed: int, step: int, tasks=None):
    """`batch_size` examples for `step`, all from one task drawn with `task_weights`: a toy task by
    name (examples generated from the step's RNG), or `tasks[name]` (a `FileTask`) where given:
    its next rows, in epochs (`FileTask.rows`).

    One task per step keeps a batch's rows of similar length, so short tasks are not padded to
    the longest task's length (see `make_batch`)."""
    names = sorted(task_weights)
    weights = tuple(task_weights[n] for n in names)
    rng = _step_rng(seed, step)
    name = rng.choices(names, weights)[0]
    if tasks is None:
        task = get_task(name)
        return [task.sample(rng) for _ in range(batch_size)]
    drawn_before = step if len(names) == 1 else _earlier_draws(seed, names, weights, step)
    return tasks[name].rows(seed, drawn_before * batch_size, batch_size)


# (seed, names, weights) -> (per step: how many earlier steps drew that step's task, draws per task so far)
_TASK_DRAWS: dict[tuple, tuple[list[int], Counter]] = {}


def _earlier_draws(seed: int, names: list[str], weights: tuple, step: int) -> int:
    """How many steps before `step` drew the task `step` draws (as `sample_examples` draws it).
    The draws are replayed once and kept, so a resumed run counts its tasks' rows with nothing
    stored."""
    before, counts = _TASK_DRAWS.setdefault((seed, tuple(names), weights), ([], Counter()))
    while len(before) <= step:
        name = _step_rng(seed, len(before)).choices(names, weights)[0]
        before.append(counts[name])
        counts[name] += 1
    return before[step]


@dataclass(frozen=True)
class FileTask:
    """Training rows of a real model's data (`data.files`): the examples of one JSONL file, named
    in metrics by `name`."""

    name: str
    examples: tuple[Example, ...]

    def rows(self, seed: int, start: int, count: int) -> list[Example]:
        """Rows `start`..`start + count - 1` of the task's stream: epoch after epoch, each a
        shuffle of every row (seeded by `seed`, the task and the epoch), so each row is seen once
        an epoch and a batch may straddle two epochs."""
        return [self.examples[_epoch_order(seed, self.name, epoch, len(self.examples))[k]]
                for epoch, k in (divmod(g, len(self.examples)) for g in range(start, start + count))]


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, name: str, epoch: int, n: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(hashlib.sha256(f"{seed}:{name}:{epoch}".encode()).digest()).shuffle(order)
    return tuple(order)


def file_tasks(data, tokenizer, *, block: int | None, report=print, stop_ids=None) -> dict[str, FileTask]:
    """{path: FileTask} of `data.files` (a DataConfig): each line's `prompt_field` and
    `response_field`; where `data.chat`, the prompt as a user turn of `tokenizer`'s chat template
    and the answer as the assistant turn after it, up to its first stop token of `stop_ids`
    (`Tokenizer.chat_row`; the model's `decode_stop_ids`).
    Lines without both fields, and lines whose row (`encode_row` with `block`) is longer than
    `data.seq_len`, are reported and skipped; a file without one good line is refused."""
    from dlmjax.evaluation.tasks import DatasetError, usable_rows, read_rows

    names = [Path(path).name for path in data.files]  # in metrics: the file's name where it tells them apart
    names = names if len(set(names)) == len(names) else list(data.files)
    tasks = {}
    for path, name in zip(data.files, names):
        try:
            rows = read_rows(path, split="train")
        except DatasetError as err:
            raise DataError(f"data.files: {err}") from None
        usable, malformed = usable_rows(rows, (data.prompt_field, data.response_field))  # as evaluation reads them
        numbered = [(n, Example(prompt=row[data.prompt_field], target=row[data.response_field])) for n, row in usable]
        if not numbered:
            raise DataError(f"data.files: {path} has no line with text fields {data.prompt_field!r} and "
                            f"{data.response_field!r} ({_first_problems(malformed)}); set data.prompt_field and "
                            "data.response_field to its keys, or write it one JSON object a line")
        unsplit = []  # rows the chat template cannot write as (prompt turn, answer turn)
        if data.chat:
            numbered, unsplit = _chat_rows(numbered, tokenizer, data.chat, stop_ids)
            if not numbered:
                raise DataError(f"data.chat: {path}: {_first_problems(unsplit)}; set data.chat=false to train on the "
                                "prompts as they are")
        fits = [_row_length(tokenizer, ex, block) <= data.seq_len for _, ex in numbered]
        long = [n for (n, _), ok in zip(numbered, fits) if not ok]
        examples = tuple(ex for (_, ex), ok in zip(numbered, fits) if ok)
        if malformed:
            report(f"{path}: skipped {_lines(malformed)} without text fields {data.prompt_field!r} and "
                   f"{data.response_field!r} ({_first_problems(malformed)})")
        if unsplit:
            report(f"{path}: skipped {_lines(unsplit)} the chat template does not write as a prompt turn and an "
                   f"answer turn after it ({_first_problems(unsplit)})")
        if long:
            report(f"{path}: skipped {_lines(long)} longer than data.seq_len={data.seq_len} tokens ({_numbers(long)})")
        if not examples:
            raise DataError(f"data.files: no line of {path} fits in data.seq_len={data.seq_len} tokens; raise it")
        tasks[path] = FileTask(name=name, examples=examples)
    return tasks


def _chat_rows(numbered, tokenizer, chat, stop_ids):
    """([(line, Example as chat turns)], ["row N: why the template cannot split it"])."""
    if not tokenizer.chat_template:
        return [], ["the tokenizer has no chat template"]
    rows, unsplit = [], []
    for n, ex in numbered:
        try:
            prompt, answer = tokenizer.chat_row(ex.prompt, ex.target, chat, stop_ids)
        except InputError as err:
            unsplit.append(f"row {n}: {err}")
        else:
            rows.append((n, Example(prompt=prompt, target=answer)))
    return rows, unsplit


TOY_ROWS_CHECKED = 4096  # examples drawn per toy task to find its longest row before a run starts


def check_toy_rows_fit(task_weights: dict, tokenizer, *, seq_len: int, block: int | None) -> None:
    """Refuse a toy-task run whose rows can outgrow `seq_len` before it starts: found mid-run, after
    a checkpoint, the fix (a larger seq_len) would be a different config, which cannot resume."""
    rng = random.Random(0)
    longest = max(_row_length(tokenizer, get_task(name).sample(rng), block)
                  for name in sorted(task_weights) for _ in range(TOY_ROWS_CHECKED))
    if longest > seq_len:
        raise DataError(f"the toy tasks {sorted(task_weights)} have rows of {longest} tokens but data.seq_len={seq_len}; "
                        f"raise data.seq_len in the config (e.g. seq_len={-(-longest // 16) * 16})")


def _row_length(tokenizer, example: Example, block: int | None) -> int:
    """The tokens `encode_row` gives `example`."""
    return len(_row(tokenizer.encode_prompt(example.prompt), tokenizer.encode(example.target), tokenizer.eos_id, block))


def _row(prompt_ids, target_ids, eos_id: int, block: int | None) -> list[int]:
    """Prompt, answer, EOS (none more where the answer ends with it: a chat turn whose end-of-turn
    token is the EOS), and EOS up to a block's end."""
    row = list(prompt_ids) + list(target_ids)
    row += [] if target_ids and target_ids[-1] == eos_id else [eos_id]
    return row + [eos_id] * (-len(row) % block) if block else row


def _first_problems(malformed: list[str]) -> str:
    return "; ".join(malformed[:5]) + (" ..." if len(malformed) > 5 else "") if malformed else "the file holds no rows"


def _lines(numbers: list[int]) -> str:
    return f"{len(numbers)} line{'s' if len(numbers) > 1 else ''}"


def _numbers(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:5]))
    return f"line{'s' if len(numbers) > 1 else ''} {shown}{' ...' if len(numbers) > 5 else ''}"


def encode_row(prompt_ids, target_ids, *, eos_id: int, pad_id: int, seq_len: int, block: int | None):
    """(tokens, valid, target) for one row; `block` None for autoregressive models."""
    row = _row(prompt_ids, target_ids, eos_id, block)
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
        encode_row(tokenizer.encode_prompt(ex.prompt), tokenizer.encode(ex.target), eos_id=tokenizer.eos_id,
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
