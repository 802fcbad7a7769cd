"""The seeds' benchmark tasks mbpp and math500: shipped data, scorers on hand-made right and wrong
answers (real sandboxed execution for MBPP), malformed rows reported with line numbers."""

import json
from pathlib import Path

import pytest

from dlmjax.evaluation.math_answer import equivalent, last_boxed, math_correct, normalize
from dlmjax.evaluation.sandbox import run_python
from dlmjax.evaluation.tasks import (
    DatasetError, MATH500_TEST, MBPP_SANITIZED_TEST, MBPP_TEST, extract_code, load_eval_set, mbpp_code, mbpp_program,
)


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------ MBPP


def test_the_shipped_mbpp_test_split_is_task_ids_11_to_510():
    rows = [json.loads(line) for line in MBPP_TEST.read_text().splitlines()]
    assert [r["task_id"] for r in rows] == list(range(11, 511))
    loaded = load_eval_set("mbpp")
    assert len(loaded.items) == 500 and not loaded.skipped
    first = loaded.items[0]
    assert "remove first and last occurrence" in first.prompt and 'assert remove_Occ("hello","l") == "heo"' in first.prompt


def test_mbpp_reference_solutions_pass_and_wrong_code_fails():
    loaded = load_eval_set("mbpp")
    sample = loaded.items[::25]  # 20 problems across the split
    right = [f"Here is the code:\n```python\n{item.reference['code']}\n```\nDone." for item in sample]
    assert loaded.score(sample, right) == [True] * len(sample)
    item = loaded.items[0]  # remove_Occ
    wrong = [
        "```python\ndef remove_Occ(s, ch):\n    return s\n```",  # wrong result
        "def remove_Occ(s, ch):\n    raise ValueError('no')\n",  # raises
        "def remove_Occ(s, ch) return s",  # syntax error
        "```python\n```",  # nothing
    ]
    assert loaded.score([item] * len(wrong), wrong) == [False] * len(wrong)
    # an unfenced chat answer: the prose before and after its code is not part of the program
    code = item.reference["code"].replace("\r\n", "\n")
    chatty = [f"Here is the function:\n\n{code}", f"{code}\n\nThis removes the first and last occurrence."]
    assert loaded.score([item] * 2, chatty) == [True, True]
    assert mbpp_code("Sure:\ndef f(x):\n    return x\n    y = (\n") == "def f(x):\n    return x\n    y = (\n"  # a broken block stays broken


def test_the_shipped_sanitized_mbpp_is_its_257_test_problems_with_opencompass_prompt():
    """mbpp-sanitized: the hand-verified problems with task ids 11-510 (OpenCompass's sanitized_mbpp
    test split, the SDAR and MRP authors' MBPP), prompted as OpenCompass's zero-shot mdblock config."""
    rows = [json.loads(line) for line in MBPP_SANITIZED_TEST.read_text().splitlines()]
    ids = [r["task_id"] for r in rows]
    assert len(rows) == 257 and ids == sorted(ids) and set(ids) <= set(range(11, 511))
    loaded = load_eval_set("mbpp-sanitized")
    assert loaded.task == "mbpp-sanitized" and len(loaded.items) == 257 and not loaded.skipped
    assert loaded.items[0].prompt == (
        "You are an expert Python programmer, and here is your task:\nWrite a python function to remove first and "
        "last occurrence of a given character from the string.\nYour code should pass these tests:\n\n"
        'assert remove_Occ("hello","l") == "heo"\nassert remove_Occ("abcda","a") == "bcd"\n'
        'assert remove_Occ("PHP","P") == "H"\n You should submit your final solution in the following format: '
        "```python\n\n```")
    # the rows whose asserts need their test_imports: the reference solutions pass, a wrong one fails
    needing = [item for item in loaded.items if item.reference["test_imports"]]
    assert len(needing) == 13
    sample = loaded.items[::40] + needing[:3]
    right = [f"```python\n{item.reference['code']}\n```" for item in sample]
    assert loaded.score(sample, right) == [True] * len(sample)
    assert loaded.score(loaded.items[:1], ["```python\ndef remove_Occ(s, ch):\n    return s\n```"]) == [False]


def test_sanitized_mbpp_test_imports_run_before_the_asserts(tmp_path):
    row = {"prompt": "t", "task_id": 11, "test_imports": ["import math"],
           "test_list": ["assert math.isclose(half(3), 1.5)"]}
    assert run_python(mbpp_program(row, "def half(x):\n    return x / 2\n"), timeout_s=5).passed
    assert not run_python(mbpp_program({**row, "test_imports": []}, "def half(x):\n    return x / 2\n"),
                          timeout_s=5).passed  # math is not imported by the code
    bad = _write_jsonl(tmp_path / "s.jsonl", [row, {**row, "test_imports": "import math"}, {**row, "task_id": 600},
                                              {"text": "an MBPP row, not a sanitized one", "task_id": 12,
                                               "test_list": ["assert True"]}])
    loaded = load_eval_set("mbpp-sanitized", data=bad)
    assert len(loaded.items) == 1 and loaded.skipped == [
        "row 2: 'test_imports' must be a list of import lines",
        "row 3: task id 600 is not in MBPP's test split (11-510)",
        "row 4: missing or empty 'prompt'",
    ]


def test_mbpp_code_that_loops_is_killed_and_fails():
    item = load_eval_set("mbpp", limit=1).items[0]
    program = mbpp_program(item.reference, "def remove_Occ(s, ch):\n    while True:\n        pass\n")
    result = run_python(program, timeout_s=1.0)
    assert result.status == "timeout" and not result.passed


def test_mbpp_setup_code_runs_before_the_asserts():
    row = {"text": "t", "test_setup_code": "K = 3", "test_list": ["assert triple(2) == 6"]}
    assert run_python(mbpp_program(row, "def triple(x):\n    return K * x\n"), timeout_s=5).passed
    assert not run_python(mbpp_program(row, "def triple(x):\n    return 2 * x\n"), timeout_s=5).passed


def test_code_is_taken_from_the_first_fence_or_the_text_before_done():
    assert extract_code("Sure:\n```python\nx = 1\n```\n```python\ny = 2\n```") == "x = 1\n"
    assert extract_code("```\nx = 1\n") == "x = 1\n"  # unclosed fence: to the end
    assert extract_code("x = 1\n[DONE] trailing words") == "x = 1\n"
    # a completion that began inside a block (the chat template opened it) and closes it
    assert extract_code("def f(x):\n    return x\n```\n\nIt returns x.") == "def f(x):\n    return x\n"
    assert extract_code("Sure\n```\nx = 1\n```") == "x = 1\n"  # two fences: the first opens
    assert extract_code("[BEGIN]\nx = 1\n[DONE]") == "\nx = 1\n"  # the MBPP paper's delimiters, both dropped


def test_malformed_mbpp_rows_are_reported_with_line_numbers_and_skipped(tmp_path):
    good = {"text": "Add one.", "task_id": 11, "test_setup_code": "", "test_list": ["assert f(1) == 2"]}
    path = _write_jsonl(tmp_path / "mbpp.jsonl", [
        good,
        "{not json",
        {"text": "x", "task_id": 12, "test_list": []},
        {"text": "x", "task_id": 13, "test_list": ["assert True", 5]},
        {"task_id": 14, "test_list": ["assert True"]},
        {"text": "x", "task_id": 3, "test_list": ["assert True"]},
        [1, 2],
    ])
    loaded = load_eval_set("mbpp", data=str(path))
    assert [item.index for item in loaded.items] == [0]
    reasons = dict(line.split(": ", 1) for line in loaded.skipped)
    assert set(reasons) == {"row 2", "row 3", "row 4", "row 5", "row 6", "row 7"}
    assert "invalid JSON" in reasons["row 2"] and "test_list" in reasons["row 3"] and "test_list" in reasons["row 4"]
    assert "'text'" in reasons["row 5"] and "11-510" in reasons["row 6"] and "not a JSON object" in reasons["row 7"]
    assert loaded.score(loaded.items, ["def f(x):\n    return x + 1\n"]) == [True]
    with pytest.raises(DatasetError, match="6 unusable rows"):
        load_eval_set("mbpp", data=str(path), strict=True)


# --------------------------------------------------------------------------------------------- MATH-500


def test_the_shipped_math500_loads_and_every_solutions_boxed_answer_matches_its_answer():
    rows = [json.loads(line) for line in MATH500_TEST.read_text().splitlines()]
    assert len(rows) == 500 and len({r["unique_id"] for r in rows}) == 500
    assert all(math_correct(r["solution"], r["answer"]) for r in rows)
    loaded = load_eval_set("math500")
    assert len(loaded.items) == 500 and not loaded.skipped
    assert loaded.items[0].prompt.endswith("put your final answer within \\boxed{}.")


@pytest.mark.parametrize("predicted, reference", [
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{1}{2}", "\\frac12"),
    ("\\tfrac12", "1/2"),
    ("-\\frac{3}{4}", "-0.75"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("(1, 0.5)", "\\left(1,\\frac{1}{2}\\right)"),
    ("90^\\circ", "90"),
    ("90^{\\circ}", "90"),
    ("90 degrees", "90"),
    ("12 \\text{ cm}", "12"),
    ("5\\mbox{ inches}", "5"),
    ("864", "864 \\mbox{ inches}^2"),  # two MATH-500 answers carry a squared unit
    ("15 \\text{ cm}^{2}", "15\\mbox{ cm}^2"),
    ("x = 7", "7"),
    ("10{,}000", "10000"),
    ("1,000", "1000"),
    ("25\\%", "25"),
    ("\\$18.90", "18.90"),
    ("\\text{(C)}", "(C)"),
    ("\\textbf{(C)}", "\\text{(C)}"),
    ("2\\sqrt2", "2\\sqrt{2}"),
    ("\\displaystyle \\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}"),
    ("$4$.", "4"),
    # a matrix's row breaks written compactly or across lines, against MATH's `\\ ` with spaces
    ("\\begin{pmatrix}-2\\\\-14\\end{pmatrix}", "\\begin{pmatrix} -2 \\\\ -14 \\end{pmatrix}"),
    ("\\begin{pmatrix}-2\\\\\n-14\\end{pmatrix}", "\\begin{pmatrix} -2 \\\\ -14 \\end{pmatrix}"),
    # MATH-500's multiple-choice references are `\text{(C)}`; its interval answers may name the variable
    ("C", "\\text{(C)}"),
    ("\\text{E}", "\\text{(E)}"),
    ("[-2,7]", "x \\in [-2,7]"),
    ("12 inches", "12"),
    ("60 \\text{ km/h}", "60"),
    ("\\pi/2", "\\frac{\\pi}{2}"),
    ("\\sqrt{3}/2", "\\frac{\\sqrt{3}}{2}"),
    ("1 \\text{ and } 2", "1, 2"),
    ("3, 5, \\text{ and } 7", "3, 5, 7"),  # a list's last "and" after its comma
    ("3, 5, and 7", "3, 5, 7"),
    ("11111111100", "11,\\! 111,\\! 111,\\! 100"),  # MATH-500's thousands separators, spaced
    ("11,111,111,100", "11,\\! 111,\\! 111,\\! 100"),
    ("\\text{East}", "east"),
    ("\u22125", "-5"),
    ("90°", "90"),
    ("-\\pi/2", "-\\frac{\\pi}{2}"),
    ("\\frac\\pi2", "\\frac{\\pi}{2}"),
    ("\\mathbf{5}", "5"),
    ("{1}", "1"),
    ("6 square units", "6"),
    ("\\frac{9}{5}", "1\\frac{4}{5}"),  # MATH-500 references write mixed numbers
    ("137.5", "137 \\frac{1}{2}"),
    # sets and MATH's "all the solutions, separated by commas" in any order; tuples inside them kept whole
    ("\\{2,1\\}", "\\{1, 2\\}"),
    ("3, -2", "-2,3"),
    ("x = 3, -2", "-2, 3"),
    ("\\{(3,4),(1,2)\\}", "\\{(1, 2), (3, 4)\\}"),
    ("(3,4),(1,2)", "(1,2), (3,4)"),
    ("\\frac{1}{2}, 2", "2, 0.5"),
])
def test_math_answers_equal_in_common_latex_forms(predicted, reference):
    assert equivalent(predicted, reference)
    assert math_correct(f"so the answer is $\\boxed{{{predicted}}}$", reference)


@pytest.mark.parametrize("predicted, reference", [
    ("\\frac{1}{3}", "0.33"),  # numbers compare exactly
    ("3", "2"),
    ("(1,2)", "(2,1)"),
    ("[1,2)", "(1,2)"),
    ("-2", "2"),
    ("2\\sqrt{2}", "\\sqrt{8}"),  # no algebra: documented
    ("1,2", "1,2,3"),
    ("C", "D"),
    ("3m", "3"),  # a variable, not a unit
    ("10^{3}", "1000"),  # no algebra
    ("\\pi/2", "\\frac{2}{\\pi}"),
    ("1+\\sqrt{5}/2", "\\frac{1+\\sqrt{5}}{2}"),  # a slash binds tighter than +
    ("11+9a/20", "\\frac{11+9a}{20}"),  # a MATH-500 reference
    ("5 \\text{ million}", "5"),  # only unit words are dropped
    ("2\\frac{1}{2}", "1"),
    ("\\begin{pmatrix}-2\\\\-14\\end{pmatrix}", "\\begin{pmatrix} -2 \\\\ 14 \\end{pmatrix}"),
    ("1100", "1, 100"),  # two answers, not a thousands separator
    ("\\{1,2\\}", "\\{1,1,2\\}"),
    ("\\{(1,2)\\}", "\\{(2,1)\\}"),  # a set's tuples keep their order
    ("1,1", "1,2"),
])
def test_different_math_answers_are_not_equal(predicted, reference):
    assert not equivalent(predicted, reference)


def test_the_last_boxed_answer_is_scored():
    assert last_boxed("first \\boxed{1}, then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("nested \\boxed{\\frac{a}{b^{2}}} end") == "\\frac{a}{b^{2}}"
    assert last_boxed("\\boxed 7.") == "7"
    assert last_boxed("truncated \\boxed{\\frac{1}{2") is None  # an unclosed box is no answer
    assert last_boxed("\\boxed{3}, no: \\boxed{\\frac{1") is None  # nor is the box before a truncated one
    assert last_boxed("no box: the answer is 4") is None
    assert not math_correct("the answer is 4", "4")
    assert math_correct("\\fbox{4}", "4")
    assert normalize(" \\left[ 1 , 2 \\right] ") == "[1,2]"


def test_malformed_math500_rows_are_reported_with_line_numbers_and_skipped(tmp_path):
    path = _write_jsonl(tmp_path / "test.jsonl", [
        {"problem": "1+1?", "answer": "2"},
        {"problem": "no answer"},
        {"problem": "", "answer": "3"},
        "[",
        {"problem": "2+2?", "answer": "4"},
    ])
    loaded = load_eval_set("math500", data=str(path))
    assert [item.index for item in loaded.items] == [0, 4]
    assert [line.split(":")[0] for line in loaded.skipped] == ["row 2", "row 3", "row 4"]
    assert loaded.score(loaded.items, ["\\boxed{2}", "\\boxed{5}"]) == [True, False]
    with pytest.raises(DatasetError, match="3 unusable rows"):
        load_eval_set("math500", data=str(path), strict=True)


# ------------------------------------------------------------------------------------------------ GSM8K


def benchmark_module(name: str):
    """benchmarks/`name`.py as a module (the benchmarks are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_drafter_benchmark_reads_the_shipped_gsm8k():
    """benchmarks/drafter_smollm2.py takes its questions from dlmjax's own GSM8K files (a clone
    without ../shared runs it)."""
    from dlmjax.evaluation.tasks import GSM8K_TEST

    bench = benchmark_module("drafter_smollm2")
    assert bench.GSM8K.resolve() == GSM8K_TEST.parent.resolve()
    assert bench.questions("train", 2)[0].startswith("Natalia sold clips to 48 of her friends")
    assert len(bench.questions("test", 3)) == 3


# ------------------------------------------------------------------------------------------------ exactness


def test_the_exactness_benchmark_stopped_at_its_limit_writes_the_rows_it_measured(tmp_path, monkeypatch, capsys):
    """A lent machine's stage ends the benchmark with SIGINT at its time limit, which Python raises
    as KeyboardInterrupt: the agreement rows measured before it are kept in the results file, marked
    unfinished (toy-sdar, CPU). The interrupt comes right after the first row, in the process (a
    signal sent from outside raced with the benchmark's last rows on a loaded machine)."""
    import sys

    bench = benchmark_module("exactness")
    measure = bench.agreement_runs

    def stopped_after_the_first_row(*args, **kwargs):
        yield next(iter(measure(*args, **kwargs)))
        raise KeyboardInterrupt  # what SIGINT's default handler raises

    monkeypatch.setattr(bench, "agreement_runs", stopped_after_the_first_row)
    monkeypatch.setattr(sys, "argv", ["exactness.py", "--skip-cost", "--modes", "fast", "--prompts", "2", "--max-new",
                                      "8", "--batches", "2", "--comparisons", "psd", "batch", "--out", str(tmp_path)])
    with pytest.raises(KeyboardInterrupt):
        bench.main()
    assert any(line.startswith("wrote ") for line in capsys.readouterr().out.splitlines())
    results = json.loads((tmp_path / "cpu-toy-sdar.json").read_text())
    assert results["finished"] is False
    assert [row["comparison"] for row in results["agreement"]] == [
        "psd:policy=threshold,tau=0.9,depth=3 vs threshold:tau=0.9"]
    assert results["agreement"][0]["identical_rows"] == 1.0  # lossless by construction
    assert "Stopped before the end" in (tmp_path / "cpu-toy-sdar.md").read_text()


def test_the_exactness_benchmark_runs_the_comparisons_asked_for():
    """--comparisons mrp-spec measures mrp-spec against static alone (a lent machine's short call),
    lossless on toy-sdar."""
    from dlmjax.presets import load_checkpoint

    bench = benchmark_module("exactness")
    _, model, tokenizer, head = load_checkpoint("toy-sdar")
    rows = list(bench.agreement_runs(model, head, tokenizer, ["1+2=", "3+4="], 8, 2, ("mrp-spec",)))
    assert rows == [("mrp-spec:drafts=3 vs static", 1.0, 1.0)]


def test_the_likelihood_benchmark_runs_and_its_scorers_agree(tmp_path):
    """benchmarks/likelihood_cpu.py at a tiny random shape: the cached scorer (first batch and a
    further one) and the [noisy ; clean] layout each report FLOPs, temporary bytes and time, and
    their log-probs agree; the results file is written."""
    bench = benchmark_module("likelihood_cpu")
    record = bench.main(["--contexts", "40", "--hidden", "64", "--layers", "1", "--vocab", "128", "--patterns", "4",
                         "--repeats", "1", "--out", str(tmp_path)])
    (row,) = record["rows"]
    for scorer in ("cached", "next", "layout"):
        assert row[scorer]["gflops"] > 0 and row[scorer]["temp_mib"] >= 0 and row[scorer]["cpu_ms"] > 0
    assert row["next"]["gflops"] < row["cached"]["gflops"]  # a further batch does not forward the clean row again
    assert row["max_abs_diff"] < 1e-5
    assert "| 40 |" in (tmp_path / "cpu-random-block4.md").read_text()


def test_the_seen_prompts_benchmark_splits_accuracy_by_the_training_draws(tmp_path, capsys):
    """benchmarks/toy_seen_prompts.py: an eval output row counts as seen exactly when its prompt (the
    eval's draw at its index) is among the training configs' draws, per number of operations too."""
    from dlmjax.evaluation.tasks import TOY_SEED
    from dlmjax.toy.tasks import get_task
    from dlmjax.train.config import load_run_config
    from dlmjax.train.data import sample_examples

    bench = benchmark_module("toy_seen_prompts")
    config = bench.ROOT / "configs" / "toy-sdar.yaml"
    run = load_run_config(config)
    drawn = {ex.prompt for step in range(2)
             for ex in sample_examples(run.data.tasks, run.train.batch_size, run.data.seed, step)}
    assert bench.trained_prompts([config], steps=2) == drawn

    examples = get_task("toy-arith").generate(6, TOY_SEED)
    seen = {examples[0].prompt, examples[3].prompt}
    rows = [{"task": "toy-arith", "decoder": "static", "index": i, "correct": i % 2 == 0} for i in range(6)]
    split = bench.split_accuracy(rows, seen)
    assert split["toy-arith", "static", "all"] == {"seen": [1, 2], "unseen": [2, 4]}
    kinds = {bench.prompt_kind(ex) for ex in examples}
    assert sum(split["toy-arith", "static", kind]["unseen"][1] for kind in kinds) == 4

    outputs = tmp_path / "outputs.jsonl"
    outputs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    bench.main([str(outputs), "--config", str(config), "--steps", "1"])
    printed = capsys.readouterr().out
    assert printed.strip() == bench.markdown(bench.split_accuracy(rows, bench.trained_prompts([config], steps=1)))
    assert "| toy-arith | `static` | all |" in printed


ROOT = Path(__file__).resolve().parents[1]
TINY = ["--batch", "2", "--hidden", "64", "--layers", "1", "--max-new", "8", "--prompt-len", "8"]


@pytest.mark.parametrize("script, args", [
    ("decode_cpu.py", TINY + ["--repeats", "1", "--inner", "2", "--decoders", "static", "threshold:tau=0.9"]),
    ("psd_depth.py", TINY + ["--block", "4", "--vocab", "64", "--repeats", "1", "--policies", "topk,k=1"]),
    ("round_cost_cpu.py", ["--prompt-len", "16", "--batch", "2", "--hidden", "64", "--layers", "1", "--short", "4",
                           "--long", "8"]),
    ("cache_modes_cpu.py", TINY + ["--vocab", "64", "--block", "4", "--repeats", "1"]),
    ("forward_cpu.py", ["--hidden", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
                        "--intermediate", "128", "--vocab", "128", "--seq", "16", "--batches", "1,2", "--warmup", "1",
                        "--repeats", "1"]),
    ("moe_cpu.py", ["--hidden", "64", "--experts", "8", "--width", "32", "--top-k", "2", "--tokens", "1", "4",
                    "--warmup", "1", "--repeats", "1"]),
    ("moe_ep_cpu.py", ["--hidden", "32", "--experts", "8", "--width", "16", "--top-k", "2", "--tokens", "8",
                       "--meshes", "expert=4,data=2", "--warmup", "1", "--repeats", "1"]),
    ("eval_data_parallel_cpu.py", ["--limit", "4", "--batch-size", "4", "--widths", "1", "2"]),
    ("decode_throughput.py", ["--prompts", "2", "--batches", "1", "--max-new", "8", "--decoders", "static",
                              "--out", "results"]),  # in the test's own directory
    ("fused_projections.py", ["--hidden", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
                              "--intermediate", "128", "--tokens", "4", "--dtypes", "float32", "--layers", "1",
                              "--warmup", "1", "--repeats", "1", "--out", "results"]),
    ("invariant_parts.py", ["--shape", "sdar-mini", "--batches", "1", "--repeats", "1"]),
    ("psd_toy.py", ["--limit", "4", "--taus", "0.9", "--depths", "2", "--out", "results"]),
])
def test_benchmark_scripts_run_from_anywhere_on_this_checkout(script, args, tmp_path):
    """Run as their README commands run them, from another directory with no PYTHONPATH: each puts
    this checkout first on its path (an installed dlmjax, e.g. another clone's editable install,
    would have been the one measured), and its default options fit (psd_depth: depths that fit
    the block)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # as `python benchmarks/SCRIPT` runs it (its own folder first on the path), then which dlmjax ran
    probe = ("import os, sys, runpy\nsys.argv = sys.argv[1:]; sys.path[0] = os.path.dirname(sys.argv[0])\n"
             "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "except SystemExit as end:  # raise SystemExit(main()): 0 or None is a success\n    assert not end.code\n"
             "print('DLMJAX_FROM', sys.modules['dlmjax'].__file__)")
    done = subprocess.run([sys.executable, "-c", probe, str(ROOT / "benchmarks" / script), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"DLMJAX_FROM {ROOT / 'dlmjax' / '__init__.py'}" in done.stdout
