"""dlmjax as a model in EleutherAI's lm-evaluation-harness (`pip install dlmjax[lm-eval]`).

`import dlmjax.lm_eval` registers the model `dlmjax`:

    import dlmjax.lm_eval, lm_eval
    lm_eval.simple_evaluate(model="dlmjax", model_args="pretrained=toy-sdar,decoder=threshold:tau=0.9",
                            tasks=["gsm8k"], num_fewshot=5)

`dlmjax lm-eval ARGS` runs lm-eval's own command line with the model registered (`run_cli`), and
prints the decoding metrics after lm-eval's table. See `model.MODEL_ARGS` for the model_args.

Offline tasks: `dlmjax.lm_eval.tasks` holds lm-eval's gsm8k, humaneval, mbpp and minerva_math500
over the data dlmjax ships (`python -m dlmjax.lm_eval.tasks DIR` writes them for
`--include_path DIR`); `dlmjax eval --backend lm-eval` runs them (`backend.run_backend`).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

try:
    from lm_eval.api.registry import register_model
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("dlmjax.lm_eval needs lm-evaluation-harness: pip install 'dlmjax[lm-eval]' "
                      "(or pip install 'lm-eval>=0.4,<0.5')") from err

from dlmjax.lm_eval.metrics import decoding_table, recorded_runs
from dlmjax.lm_eval.model import MODEL_ARGS, DlmjaxLM, ModelArgsError, RequestError
from dlmjax.validation import InputError

MODEL_NAME = "dlmjax"
register_model(MODEL_NAME)(DlmjaxLM)

__all__ = ["MODEL_ARGS", "MODEL_NAME", "DlmjaxLM", "ModelArgsError", "RequestError", "decoding_table", "run_cli"]


def _raised_by_lm_evals_arguments(err: BaseException) -> bool:
    """Whether `err` comes from lm-eval's check of its command line (its EvaluatorConfig: unknown
    tasks, no task, conflicting flags, a missing config file): a user's mistake, not dlmjax's."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and Path(frames[-1].filename).as_posix().endswith("lm_eval/config/evaluate_config.py")


def run_cli(argv: list[str]) -> int:
    """lm-eval's command line (`lm-eval [run] ARGS`) with `dlmjax` registered, then the decoding
    metrics of each dlmjax run as a table."""
    from lm_eval.__main__ import cli_evaluate

    before = len(recorded_runs())
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except (ValueError, TypeError, FileNotFoundError) as err:
        if not _raised_by_lm_evals_arguments(err):
            raise
        raise InputError(f"lm-eval refused its arguments: {err} (`lm-eval ls tasks` lists the task names, "
                         "`dlmjax lm-eval --help` the flags)") from None
    finally:
        sys.argv = saved
    for info in recorded_runs()[before:]:
        table = decoding_table(info)
        if table:
            print("\n" + table)
    return 0
