"""Functions the task YAMLs beside this file name with `!function utils.NAME`.

Code tasks: pass@k by running each program in dlmjax's sandbox (`dlmjax.evaluation.sandbox`)
instead of HF evaluate's `code_eval` (which lm-eval's own humaneval/mbpp load from the Hub).
A program is the prediction, a newline and the reference tests, as `code_eval` builds it; a
program passes when it exits cleanly within `CODE_TIMEOUT_S` (code_eval's default timeout).
MATH-500: lm-eval's own Minerva functions (`lm_eval.tasks.minerva_math.utils`), imported when
first called since they need lm-eval's math extra.

`dlmjax.lm_eval.tasks.write_tasks` writes a one-line `utils.py` that imports this module next
to the YAMLs it writes, so the YAMLs resolve these names from any directory.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from math import comb
from pathlib import Path

CODE_TIMEOUT_S = 3.0
MBPP_FEWSHOT = Path(__file__).with_name("mbpp_fewshot.jsonl")


def _passed(programs: list[str]) -> list[bool]:
    from dlmjax.evaluation.sandbox import run_python

    with ThreadPoolExecutor(max_workers=4) as pool:
        return [r.passed for r in pool.map(lambda p: run_python(p, timeout_s=CODE_TIMEOUT_S), programs)]


def _pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which `correct` pass (Chen et al., 2021)."""
    if n - correct < k:
        return 1.0
    return 1.0 - comb(n - correct, k) / comb(n, k)


def pass_at_k(references: list[str], predictions: list[list[str]], k: list[int] | int | None = None) -> dict:
    """{"pass@K": mean over problems} for each K in `k`; predictions[i] are problem i's samples."""
    ks = [k] if isinstance(k, int) else list(k or [1])
    fewest = min(map(len, predictions))
    if max(ks) > fewest:  # HF code_eval reports no pass@K then; counting such a problem as failed under-reports
        raise ValueError(f"pass@{max(ks)} needs at least {max(ks)} samples of every problem, and one has {fewest}: "
                         f"raise the task's `repeats` to {max(ks)} or drop pass@{max(ks)}")
    results = [_passed([f"{p}\n{ref}" for p in preds]) for ref, preds in zip(references, predictions)]
    return {f"pass@{kk}": sum(_pass_at_k(len(r), sum(r), kk) for r in results) / len(results) for kk in ks}


def pass_at_1(references: str | list[str], predictions: str | list[str] | list[list[str]]) -> float:
    """MBPP's pass@1: one response per problem."""
    references = [references] if isinstance(references, str) else references
    predictions = [predictions] if isinstance(predictions, str) else predictions
    predictions = [[p] if isinstance(p, str) else p for p in predictions]
    return pass_at_k(references, predictions, [1])["pass@1"]


def build_predictions(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """HumanEval: each response appended to its problem's prompt (the function header)."""
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs)]


def mbpp_fewshot_samples() -> list[dict]:
    """MBPP task ids 2, 3 and 4 (its prompt split), marked as few-shot examples."""
    with MBPP_FEWSHOT.open() as f:
        return [{**json.loads(line), "is_fewshot": True} for line in f if line.strip()]


def _minerva():
    from lm_eval.tasks.minerva_math import utils  # needs sympy, math_verify, antlr4 4.11: lm-eval[math]

    return utils


def minerva_process_docs(dataset):
    return _minerva().process_docs(dataset)


def minerva_doc_to_text(doc: dict) -> str:
    return _minerva().doc_to_text(doc)


def minerva_process_results(doc: dict, results: list[str]) -> dict:
    return _minerva().process_results(doc, results)


def minerva_fewshot_samples() -> list[dict]:
    return _minerva().list_fewshot_samples()
