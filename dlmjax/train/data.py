"""Training batches from the toy tasks: a pure function of (seed, step), so a resumed run sees
exactly the batches it would have seen.

One row is `prompt + target + EOS`, then for block-diffusion models EOS again up to the end of the
block holding the first EOS (the engine stops a row once a finished block contains EOS, so that
block must be learnt whole), then padding that no token attends to. Positions count from 0 at the
first prompt token, as the decoding engine lays rows out, so the training blocks are the decoding
blocks.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import numpy as np

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
    shapes to compile, little padding."""
    rows = [
        encode_row(tokenizer.encode(ex.prompt), tokenizer.encode(ex.target), eos_id=tokenizer.eos_id,
                   pad_id=pad_id, seq_len=seq_len, block=block)
        for ex in examples
    ]
    tokens, valid, target = (np.stack(parts) for parts in zip(*rows))
    width = min(seq_len, -(-int(valid.sum(axis=1).max()) // bucket) * bucket)
    return Batch(tokens=tokens[:, :width], valid=valid[:, :width], target=target[:, :width])
