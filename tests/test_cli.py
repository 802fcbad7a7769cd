"""The `dlmjax` command line: generate (--json contract) and export."""

import json
import subprocess
import sys

import pytest

import dlmjax
import dlmjax.presets
from dlmjax.cli import main


@pytest.fixture(autouse=True)
def preset_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DLMJAX_CACHE", str(tmp_path_factory.getbasetemp() / "dlmjax-cache"))


def test_generate_json_one_object_per_prompt(capsys):
    code = main(["generate", "--model", "random-sdar", "--prompt", "Hello", "--prompt", "What is 2+3?",
                 "--decoder", "threshold:tau=0.5", "--max-new-tokens", "8", "--json"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        row = json.loads(line)
        assert {"text", "tokens", "nfe", "tpf"} <= set(row)
        assert 0 < len(row["tokens"]) <= 8 and row["nfe"] >= 1 and row["tpf"] >= 1.0


def test_generate_ar_preset(capsys):
    assert main(["generate", "--model", "random-qwen3", "--prompt", "Hi", "--decoder", "ar",
                 "--max-new-tokens", "5", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert len(row["tokens"]) == 5 and row["tpf"] == 1.0


def test_generate_bad_decoder_is_a_clear_error(capsys):
    assert main(["generate", "--model", "random-sdar", "--prompt", "Hi", "--decoder", "nope"]) == 2
    assert "unknown decoder 'nope'; valid decoders:" in capsys.readouterr().err


def test_unknown_model_lists_presets(capsys):
    assert main(["generate", "--model", "no/such/dir", "--prompt", "Hi"]) == 2
    assert "presets: toy-sdar, toy-ar, random-sdar, random-qwen3" in capsys.readouterr().err


def test_export_cli_roundtrip(tmp_path, capsys):
    src = dlmjax.presets.resolve_model("random-qwen3")
    assert main(["export", str(src), str(tmp_path / "out"), "--format", "torch"]) == 0
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    original, exported = dlmjax.load_model(src), dlmjax.load_model(tmp_path / "out")
    assert original.config == exported.config
    assert (original.embed[...] == exported.embed[...]).all()


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "dlmjax.cli", "--help"], capture_output=True, text=True, check=True)
    assert "generate" in out.stdout and "export" in out.stdout
