"""Accuracy of a model on the toy tasks' fixed eval prompts (used during training, when shipping a
toy model, and by the tests); the decoding and scoring are the evaluation harness's."""

from __future__ import annotations

from dlmjax.evaluation.runner import run_eval
from dlmjax.evaluation.tasks import TOY_MAX_NEW_TOKENS, load_eval_set

RECORD_SLICE = 64  # the fixed eval slice whose accuracy ships with each toy model


def recorded_decoders(model) -> list[str]:
    """The decoders whose accuracy is recorded: AR for causal models; for block diffusion one
    token per step (static) and the whole block at once. The first is the default."""
    if model.config.attention == "causal":
        return ["ar"]
    return ["static", f"static:k={model.config.block_size}"]


def toy_accuracy(model, tokenizer, task_name: str, *, n: int, decoder: str | None = None) -> float:
    """Fraction of the first `n` eval prompts solved; static (1 token per step) or greedy AR by default."""
    decoder = decoder or recorded_decoders(model)[0]
    records, _ = run_eval(model, tokenizer, [load_eval_set(task_name, limit=n)], [decoder], model_name="",
                          progress=False, warmup=False)
    return records[0].accuracy


def record_accuracy(model, tokenizer, tasks=tuple(TOY_MAX_NEW_TOKENS), n: int = RECORD_SLICE) -> dict:
    """{task: {decoder: accuracy}} on the first `n` eval prompts of each task."""
    return {task: {dec: toy_accuracy(model, tokenizer, task, n=n, decoder=dec) for dec in recorded_decoders(model)}
            for task in tasks}
