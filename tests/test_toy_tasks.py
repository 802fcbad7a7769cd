"""Toy task generators and scorers, and GSM8K final-answer extraction (pure Python, no jax work)."""

import itertools
import json
import random

import pytest

from dlmjax.evaluation.tasks import GSM8K_TEST
from dlmjax.toy.tasks import (TASKS, ArithConfig, ArithTask, ConstraintConfig, ConstraintTask, Example,
                              extract_final_number, get_task, gsm8k_correct)
from dlmjax.toy.tokenizer import CHARS
ALL_TASKS = [ArithTask(), ArithTask(ArithConfig(ops=("+", "-", "*"))), ConstraintTask(),
             ConstraintTask(ConstraintConfig(min_digits=2, max_digits=6, min_solution_sets=1))]


@pytest.mark.parametrize("task", ALL_TASKS, ids=lambda t: f"{t.name}-{t.config}")
def test_generate_is_deterministic_per_seed(task):
    assert task.generate(50, seed=3) == task.generate(50, seed=3)
    assert task.generate(50, seed=3) != task.generate(50, seed=4)
    state = random.getstate()
    task.generate(5, seed=0)
    assert random.getstate() == state  # no global random state used


@pytest.mark.parametrize("task", ALL_TASKS, ids=lambda t: f"{t.name}-{t.config}")
def test_targets_score_and_use_the_tokenizer_alphabet(task):
    alphabet = set(CHARS)
    for ex in task.generate(300, seed=0):
        assert task.score(ex, ex.target), ex
        assert task.score(ex, ex.target + "\ntrailing junk ####"), ex  # text after the answer line ignored
        assert set(ex.prompt) <= alphabet and set(ex.target) <= alphabet, ex
        assert ex.prompt.endswith("\n") and not ex.target.endswith("\n")


def test_registry():
    assert set(TASKS) == {"toy-arith", "toy-constraint"}
    for name, task in TASKS.items():
        assert get_task(name) is task and task.name == name
    with pytest.raises(ValueError, match="toy-arith, toy-constraint"):
        get_task("toy-nope")


def test_arith_format_bounds_and_left_to_right():
    task = ArithTask()
    for ex in task.generate(300, seed=1):
        values, expr = ex.meta["values"], ex.meta["expression"]
        assert ex.prompt == expr + "\n"
        assert 3 <= len(values) <= 4  # 2-3 operations
        assert all(0 <= v <= 99 for v in values)
        operands = [int(x) for x in expr.replace("+", " ").replace("-", " ").split()]
        assert all(0 <= x <= 20 for x in operands) and operands[0] == values[0]
        lines = ex.target.split("\n")
        assert lines[-1] == f"#### {ex.meta['answer']}" and values[-1] == ex.meta["answer"]
        for line, before, after in zip(lines[:-1], values, values[1:]):
            left, right = line.split("=")
            assert int(right) == after and left.startswith(str(before))
            assert eval(left) == after  # one operation per line, so left to right


def test_arith_multiplication_is_optional_and_small():
    assert all("*" not in ex.prompt for ex in ArithTask().generate(200, seed=0))
    exs = ArithTask(ArithConfig(ops=("+", "-", "*"))).generate(200, seed=0)
    assert any("*" in ex.prompt for ex in exs)
    for ex in exs:
        assert all(0 <= v <= 99 for v in ex.meta["values"])
        for line in ex.target.split("\n")[:-1]:
            if "*" in line:
                assert 0 <= int(line.split("*")[1].split("=")[0]) <= 5
    with pytest.raises(ValueError):
        ArithConfig(ops=("/",))
    with pytest.raises(ValueError):
        ArithConfig(min_ops=3, max_ops=2)


def test_arith_scorer():
    task = ArithTask()
    ex = Example("7+12-5\n", "7+12=19\n19-5=14\n#### 14", {"answer": 14})
    assert task.score(ex, ex.target)
    assert task.score(ex, "#### 14")
    assert task.score(ex, "7+12=20\n20-5=14\n####   14  \n#### 99")  # chain not checked; first #### line
    for wrong in ["7+12=19\n19-5=14\n#### 15", "#### 140", "#### -14", "#### 14.5", "#### 14 apples",
                  "14", "", "#### ", "####\n14", "#### 99\n#### 14"]:
        assert not task.score(ex, wrong), wrong
    for ex in task.generate(100, seed=2):  # perturbing the final number always fails
        head, answer = ex.target.rsplit("#### ", 1)
        assert not task.score(ex, f"{head}#### {int(answer) + 1}")


def test_constraint_scorer():
    task = ConstraintTask()
    ex = Example("4 distinct digits, sum 17\n", "3 5 9 0", {"k": 4, "sum": 17})
    for right in ["3 5 9 0", "0 9 5 3", "1 2 6 8", "  8 6 2 1 \nanything"]:
        assert task.score(ex, right), right
    for wrong in ["3 5 9 9",  # repeated digit (sum 26 anyway)
                  "8 8 1 0",  # repeated digit with the right sum
                  "3 5 9 1",  # wrong sum
                  "3 5 9", "3 5 9 0 0", "0 1 2 3 4 7",  # wrong count
                  "3590", "3,5,9,0", "3  5 9 0", "3 5 9 0x", "12 5 0 0", "-3 5 9 6", "", "\n3 5 9 0",
                  "abc"]:
        assert not task.score(ex, wrong), wrong


def test_constraint_has_many_answers_and_random_targets():
    task = ConstraintTask()
    exs = task.generate(200, seed=0)
    assert {ex.meta["k"] for ex in exs} == {3, 4}
    assert sum(ex.meta["num_sets"] > 1 for ex in exs) >= 0.9 * len(exs)
    # brute force agrees with the counted solutions and the prompt is solvable
    for ex in exs[:20]:
        k, total = ex.meta["k"], ex.meta["sum"]
        assert ex.prompt == f"{k} distinct digits, sum {total}\n"
        valid = [p for p in itertools.permutations(range(10), k) if sum(p) == total]
        assert len(valid) == ex.meta["num_solutions"] > 1
        assert all(task.score(ex, " ".join(map(str, p))) for p in valid[:50])
    # the same prompt gets different reference answers: training data has many answers per prompt
    by_prompt: dict[str, set[str]] = {}
    for ex in task.generate(2000, seed=1):
        by_prompt.setdefault(ex.prompt, set()).add(ex.target)
    assert sum(len(targets) > 1 for targets in by_prompt.values()) >= 0.9 * len(by_prompt)


def test_constraint_config_checks():
    with pytest.raises(ValueError):
        ConstraintConfig(min_digits=0)
    with pytest.raises(ValueError):
        ConstraintConfig(min_digits=4, max_digits=3)
    with pytest.raises(ValueError):
        ConstraintTask(ConstraintConfig(min_digits=10, max_digits=10, min_solution_sets=2))  # one set only


@pytest.mark.parametrize("text, expected", [
    ("#### 1,234", "1234"), ("#### -5", "-5"), ("#### 3.50", "3.5"), ("#### 4.0", "4"),
    ("The answer is $12.", "12"), ("no number", None), ("", None), ("#### 3\nmore\n#### 7", "7"),
    ("#### 1,000,000", "1000000"), ("She has 16-3-4=9 eggs", "9"), ("x = -7", "-7"),
    ("costs $1,250.00 in total.", "1250"), ("#### $18", "18"), ("#### 0.25", "0.25"), ("#### -0", "0"),
    ("#### 007", "7"), ("12 then 13 then #### 14 and 15", "14"), ("####", None),
    # markdown headings are not answer lines: the last number counts (lm-eval's flexible-extract)
    ("#### Step 1: eggs\n16 - 3 - 4 = 9\n#### Step 2: money\n9 * 2 = 18\nThe answer is 18.", "18"),
    ("#### 12\n#### Check: 12 + 3 = 15", "12"),
    ("#### 1. Compute the cost\n3 * 4 = 12\n#### 2) Answer\nThe total is 42.", "42"),  # numbered headings
])
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected


def test_gsm8k_correct():
    ref = "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\n#### 1,800"
    assert gsm8k_correct("... so she makes $1800.", ref)
    assert gsm8k_correct("step\n#### 1800.00", ref)
    assert not gsm8k_correct("#### 180", ref)
    assert not gsm8k_correct("I don't know", ref)
    assert not gsm8k_correct("#### 5", "no final answer here")


def test_gsm8k_rows_score_against_their_own_answers():
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines()[:200] if line.strip()]
    assert rows
    for row in rows:
        answer = row["answer"]
        final = answer.rsplit("####", 1)[1].strip()
        expected = extract_final_number(answer)
        assert expected is not None and expected == final.replace(",", "")
        assert gsm8k_correct(answer, answer)
        assert gsm8k_correct(f"The answer is {final}.", answer)
        assert not gsm8k_correct(answer.rsplit("####", 1)[0] + f"#### {int(expected) + 1}", answer)
