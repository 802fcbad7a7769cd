"""`dlmjax regenerate`: a training file's answers written again by the model, the data a drafter
trains on; a stopped run resumes to the file an uninterrupted run writes."""

import fcntl
import json
import random
from pathlib import Path

import pytest

from dlmjax.cli import main
from dlmjax.decoding.api import Stream, generate
from dlmjax.presets import load_checkpoint
from dlmjax.toy.tasks import get_task
from dlmjax.train.config import load_run_config
from dlmjax.train.data import file_tasks


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    rng = random.Random(5)
    examples = [get_task("toy-arith").sample(rng) for _ in range(9)]
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    lines = [json.dumps({"question": ex.prompt, "answer": ex.target}) for ex in examples]
    lines.insert(3, json.dumps({"answer": "no question"}))  # reported and skipped
    path.write_text("\n".join(lines) + "\n")
    return path


def regenerate_argv(rows_file, out, *extra):
    return ["regenerate", "--model", "toy-ar", "--data", str(rows_file), "--field", "question", "--max-new-tokens",
            "30", "--out", str(out), "--batch-size", "4", "--no-progress", *extra]


def test_answers_are_the_models_own_and_unfinished_ones_are_null(rows_file, tmp_path, capsys):
    out = tmp_path / "regen.jsonl"
    assert main(regenerate_argv(rows_file, out)) == 0
    printed = capsys.readouterr().out
    assert "skipped 1 row(s) without a text field 'question' (row 4: missing or empty 'question')" in printed
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["source_row"] for line in lines] == [1, 2, 3, 5, 6, 7, 8, 9, 10]  # in row order
    assert not (tmp_path / "regen.jsonl.partial").exists()
    _, model, tokenizer, _ = load_checkpoint("toy-ar")
    for line in lines:
        alone = generate(model, [line["question"]], tokenizer=tokenizer, decoder="ar", max_new_tokens=30).rows[0]
        finished = alone.tokens[-1] in model.config.eos_token_ids
        assert line["response"] == (alone.text if finished else None)
        assert line["answer"] == next(json.loads(r)["answer"] for r in rows_file.read_text().splitlines()
                                      if json.loads(r).get("question") == line["question"])  # the row's fields kept
    finished = sum(line["response"] is not None for line in lines)
    assert 0 < finished < len(lines)  # 30 tokens end some answers, not all
    assert f"wrote 9 rows to {out}; {len(lines) - finished} reached --max-new-tokens 30 unfinished" in printed

    # training reads it: the null answers are reported and skipped
    run = load_run_config("configs/drafter/toy-ar.yaml", [f"data.files={{{out}: 1}}", "data.tasks=null",
                                                          "data.prompt_field=question", "data.response_field=response"])
    (task,) = file_tasks(run.data, tokenizer, block=None, report=print).values()
    assert [ex.target for ex in task.examples] == [line["response"] for line in lines if line["response"]]
    assert f"skipped {len(lines) - finished} line" in capsys.readouterr().out


def test_a_stopped_run_resumes_to_the_uninterrupted_runs_file(rows_file, tmp_path, monkeypatch, capsys):
    whole = tmp_path / "whole.jsonl"  # uninterrupted, its rows split over two devices three at a time
    assert main(regenerate_argv(rows_file, whole, "--mesh", "data=2", "--batch-size", "3")) == 0
    stopped = tmp_path / "stopped.jsonl"
    real_iter = Stream.__iter__

    def stop_after(rows):
        def iterate(self):
            for count, item in enumerate(real_iter(self)):
                if count == rows:
                    raise KeyboardInterrupt
                yield item
        return iterate

    monkeypatch.setattr(Stream, "__iter__", stop_after(3))
    assert main(regenerate_argv(rows_file, stopped)) == 130
    assert "rerun the same command to keep the rows written" in capsys.readouterr().err
    partial = tmp_path / "stopped.jsonl.partial"
    assert not stopped.exists() and len(partial.read_text().splitlines()) == 1 + 3  # settings, three rows
    with partial.open("ab") as f:
        f.write('{"question": "cut short in Zü'.encode()[:-1])  # a line the stop cut, inside a character
    with partial.open("rb") as f:  # while another run writes the file, a second is refused
        fcntl.flock(f, fcntl.LOCK_EX)
        assert main(regenerate_argv(rows_file, stopped)) == 2
    assert f"another dlmjax regenerate is writing {partial}" in capsys.readouterr().err
    monkeypatch.setattr(Stream, "__iter__", stop_after(2))  # stopped again: the cut line is gone, five rows kept
    assert main(regenerate_argv(rows_file, stopped)) == 130
    assert [json.loads(line)["source_row"] for line in partial.read_text().splitlines()[1:]] == [1, 2, 3, 5, 6]
    monkeypatch.setattr(Stream, "__iter__", real_iter)

    # other settings are refused, naming them; the same command finishes the file
    assert main(regenerate_argv(rows_file, stopped, "--seed", "3")) == 2
    assert "was started with other settings (seed: 0; now 3)" in capsys.readouterr().err
    assert main(regenerate_argv(rows_file, stopped)) == 0
    assert ", 5 of them from the stopped run" in capsys.readouterr().out
    assert stopped.read_bytes() == whole.read_bytes() and not partial.exists()
    assert main(regenerate_argv(rows_file, stopped)) == 2  # a finished file is not overwritten
    assert "exists; pick another --out" in capsys.readouterr().err


def test_drafter_alone_decodes_with_it_to_the_ar_answers(rows_file, tmp_path, monkeypatch):
    """--drafter DIR with no --decoder decodes with the drafter (as `generate` does): lossless, so
    the file is the `ar` one."""
    from dlmjax.decoding import api

    drafter = Path(__file__).resolve().parents[1] / "dlmjax/toy/checkpoints/toy-ar/drafter"
    ar, drafted = tmp_path / "ar.jsonl", tmp_path / "drafted.jsonl"
    assert main(regenerate_argv(rows_file, ar, "--limit", "4")) == 0
    calls = []
    real = api.generate_with_drafter
    monkeypatch.setattr(api, "generate_with_drafter", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert main(regenerate_argv(rows_file, drafted, "--limit", "4", "--drafter", str(drafter))) == 0
    assert calls and drafted.read_bytes() == ar.read_bytes()


def test_a_diffusion_model_regenerates_with_its_decoder(rows_file, tmp_path):
    """Row by row the tokens `generate` gives each prompt alone (continuous batching beside)."""
    out = tmp_path / "sdar.jsonl"
    argv = regenerate_argv(rows_file, out, "--decoder", "threshold:tau=0.9", "--limit", "4", "--max-new-tokens", "48")
    assert main([*argv[:2], "toy-sdar", *argv[3:]]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    _, model, tokenizer, _ = load_checkpoint("toy-sdar")
    alone = [generate(model, [line["question"]], tokenizer=tokenizer, decoder="threshold:tau=0.9",
                      max_new_tokens=48).rows[0] for line in lines]
    assert len(lines) == 4 and [line["response"] for line in lines] == [a.text for a in alone]


@pytest.mark.parametrize("extra, message", [
    (["--field", "q"], "has no row with a text field 'q'; pass --field NAME"),
    (["--chat"], "this tokenizer has no chat template"),
    (["--chat", "[1]"], "is not a JSON object of chat template variables"),  # argparse's refusal
    (["--response-field", "question"], "--response-field question is the prompt's field"),
    (["--response-field", "answer"], "row 1 already has a field 'answer', which the output writes; write the "
                                     "answers to another field (--response-field NAME)"),
])
def test_bad_input_is_one_line_naming_the_fix(rows_file, tmp_path, capsys, extra, message):
    try:
        code = main(regenerate_argv(rows_file, tmp_path / "x.jsonl", *extra))
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2 and message in capsys.readouterr().err
