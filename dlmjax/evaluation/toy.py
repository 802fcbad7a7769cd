"""Quick accuracy of a model on a toy task (used during training and by the tests)."""

from __future__ import annotations

from dlmjax.decoding.api import generate
from dlmjax.toy.tasks import get_task

# Generation budget per toy task: the longest target plus EOS, rounded up to a block multiple
# for every block size that divides 16.
TOY_MAX_NEW_TOKENS = {"toy-arith": 48, "toy-constraint": 16}


def default_decoder(model) -> str:
    return "ar" if model.config.attention == "causal" else "static"


def toy_accuracy(model, tokenizer, task_name: str, *, n: int, seed: int = 1234, decoder: str | None = None,
                 batch_size: int = 64) -> float:
    """Fraction of `n` seeded examples solved; static (1 token per step) or greedy AR by default."""
    task = get_task(task_name)
    examples = task.generate(n, seed)
    decoder = decoder or default_decoder(model)
    correct = 0
    for start in range(0, n, batch_size):
        chunk = examples[start : start + batch_size]
        result = generate(model, [ex.prompt for ex in chunk], tokenizer=tokenizer, decoder=decoder,
                          max_new_tokens=TOY_MAX_NEW_TOKENS[task_name], row_ids=range(start, start + len(chunk)))
        correct += sum(task.score(ex, row.text) for ex, row in zip(chunk, result.rows))
    return correct / n


RECORD_SLICE = 64  # the fixed held-out slice (seed 1234) whose accuracy ships with each toy model


def recorded_decoders(model) -> list[str]:
    """The decoders whose accuracy is recorded: AR for causal models; for block diffusion one
    token per step (static) and the whole block at once."""
    if model.config.attention == "causal":
        return ["ar"]
    return ["static", f"static:k={model.config.block_size}"]


def record_accuracy(model, tokenizer, tasks=tuple(TOY_MAX_NEW_TOKENS), n: int = RECORD_SLICE) -> dict:
    """{task: {decoder: accuracy}} on the first `n` held-out prompts (seed 1234) of each task."""
    return {task: {dec: toy_accuracy(model, tokenizer, task, n=n, decoder=dec) for dec in recorded_decoders(model)}
            for task in tasks}
