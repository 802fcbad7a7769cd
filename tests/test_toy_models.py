"""The shipped toy models load by preset name and still score what their accuracy.json records
on the fixed 64-prompt eval slice (seed 1234), and they meet the issue's targets."""

import json

import pytest

from dlmjax.evaluation.toy import record_accuracy
from dlmjax.io.hf import load_model
from dlmjax.io.tokenizer import load_tokenizer
from dlmjax.presets import resolve_model


@pytest.mark.parametrize("name", ["toy-sdar", "toy-ar"])
def test_shipped_model_reaches_its_recorded_accuracy(name):
    path = resolve_model(name)
    model = load_model(path)
    recorded = json.loads((path / "accuracy.json").read_text())
    assert recorded["slice"] == {"seed": 1234, "n": 64}
    measured = record_accuracy(model, load_tokenizer(path, model.config))
    for task, by_decoder in recorded["accuracy"].items():
        for decoder, accuracy in by_decoder.items():
            assert measured[task][decoder] == pytest.approx(accuracy, abs=0.02), (task, decoder)


def test_toy_sdar_meets_the_targets():
    """>= 80% one token per step on both tasks; committing a whole block at once loses >= 15
    points on toy-constraint (the regime the accelerators exist for)."""
    path = resolve_model("toy-sdar")
    model = load_model(path)
    accuracy = json.loads((path / "accuracy.json").read_text())["accuracy"]
    whole_block = f"static:k={model.config.block_size}"
    assert model.config.block_size == 8 and model.config.attention == "block_causal"
    assert accuracy["toy-arith"]["static"] >= 0.8
    assert accuracy["toy-constraint"]["static"] >= 0.8
    assert accuracy["toy-constraint"]["static"] - accuracy["toy-constraint"][whole_block] >= 0.15


def test_toy_ar_meets_the_targets():
    path = resolve_model("toy-ar")
    accuracy = json.loads((path / "accuracy.json").read_text())["accuracy"]
    assert load_model(path).config.attention == "causal"
    assert accuracy["toy-arith"]["ar"] >= 0.8 and accuracy["toy-constraint"]["ar"] >= 0.8


def test_unknown_preset_lists_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="toy-sdar, toy-ar"):
        resolve_model("toy-sdarr")


@pytest.mark.parametrize("name", ["toy-sdar", "toy-ar"])
def test_the_toy_tokenizer_reads_every_character_newlines_included(name, tmp_path):
    """One token per character: blank lines (few-shot separators) were one unknown piece, as the
    split's `.` does not match a newline. The shipped tokenizer is the one the package writes."""
    from dlmjax.toy.tokenizer import save_char_tokenizer

    tok = load_tokenizer(resolve_model(name))
    text = "Q: 1+1\n\n\nA: 2\n"
    assert len(tok.encode(text)) == len(text) and tok.decode(tok.encode(text)) == text
    save_char_tokenizer(tmp_path)
    written, shipped = (json.loads((d / "tokenizer.json").read_text()) for d in (tmp_path, resolve_model(name)))
    assert written == shipped


def test_reshipping_a_toy_model_replaces_its_files_and_keeps_the_heads_beside_it(tmp_path, monkeypatch, capsys):
    """train/ship_toy.py replaces the model's own files (a stale shard index too) and keeps what
    else the preset holds (toy-ar's drafter/), naming it as trained on the previous weights: it
    used to delete the whole directory, drafter and controller with it."""
    import shutil
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "train"))
    import ship_toy

    shipped = tmp_path / "shipped" / "toy-ar"
    shutil.copytree(resolve_model("toy-ar"), shipped)
    (shipped / "model.safetensors.index.json").write_text("{}")  # the previous model's shard layout
    run = tmp_path / "run"
    shutil.copytree(resolve_model("toy-ar"), run / "model",
                    ignore=shutil.ignore_patterns("drafter", "accuracy.json", "TRAINING.md"))
    (run / "config.yaml").write_text("train: {steps: 5, init_from: null}\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 5, "eval/toy-arith": 0.5}) + "\n")
    monkeypatch.setattr(ship_toy, "SHIPPED_DIR", tmp_path / "shipped")
    ship_toy.ship(run, "toy-ar")
    assert sorted(p.name for p in shipped.iterdir()) == [
        "TRAINING.md", "accuracy.json", "config.json", "drafter", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    assert (shipped / "drafter" / "model.safetensors").is_file()
    assert "kept beside the new toy-ar: drafter; they were trained on the previous weights" in capsys.readouterr().err
