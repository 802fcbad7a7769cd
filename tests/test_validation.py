"""Issue 23: one validation layer. Each mistake a user can make gets the library's own error
(`dlmjax.validation.InputError`) naming the input and the fix, the CLI exits 2 with one line,
nothing is lost by writing into the wrong directory or by a killed write, and any
max_new_tokens decodes."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

import dlmjax
import dlmjax.presets
from dlmjax.cli import main
from dlmjax.config import ConfigError, ModelConfig
from dlmjax.decoding.api import Stream, generate
from dlmjax.decoding.spec import DecoderSpecError, Entropy, Static, Threshold, parse_decoder
from dlmjax.evaluation.tasks import DatasetError, load_eval_set
from dlmjax.io.safetensors import CheckpointError, SafetensorsFile, save_file
from dlmjax.io.tokenizer import TokenizerError, load_tokenizer
from dlmjax.toy.tokenizer import save_char_tokenizer
from dlmjax.train.config import RunConfigError, load_run_config
from dlmjax.validation import InputError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def preset_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DLMJAX_CACHE", str(tmp_path_factory.getbasetemp() / "dlmjax-cache"))


def tiny_config(ids) -> ModelConfig:
    return ModelConfig(family="sdar", attention="block_causal", block_size=4, vocab_size=ids["vocab_size"],
                       hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                       max_position_embeddings=64, qk_norm=True, mask_token_id=ids["mask"], eos_token_ids=(ids["eos"],),
                       pad_token_id=ids["pad"])


@pytest.fixture
def checkpoint(tmp_path):
    """A tiny toy-tokenizer SDAR checkpoint with two shards and an index."""
    path = tmp_path / "ckpt"
    ids = save_char_tokenizer(path)
    return dlmjax.export_model(dlmjax.init_model(tiny_config(ids), seed=0), path, max_shard_bytes=8_000)


def one_line_error(capsys, argv) -> str:
    """Run the CLI; it must exit 2 with one `dlmjax CMD: error:` line and no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dlmjax {argv[0]}: error: ") and "Traceback" not in err and "\n" not in err, err
    return err


# -- decoder specs: every option typed and ranged --------------------------------------------------


@pytest.mark.parametrize("spec,message", [
    ("threshold:tau=2", "threshold: tau=2.0 must be in (0, 1]"),
    ("threshold:tau=-1", "threshold: tau=-1.0 must be in (0, 1]"),
    ("threshold:tau=0", "threshold: tau=0.0 must be in (0, 1]"),
    ("threshold:tau=nan", "threshold: tau=nan must be a finite number"),
    ("entropy:gamma=-0.5", "entropy: gamma=-0.5 must be >= 0"),
    ("psd:tau=1.5", "psd: tau=1.5 must be in (0, 1]"),
    ("mrp-remask:tau=0", "mrp-remask: tau=0.0 must be in (0, 1]"),
    ("static:top_p=0", "static: top_p=0.0 must be in (0, 1]"),
    ("threshold:tau=0.5,tau=0.6", "option 'tau' is given twice"),
    # sampling options at temperature 0 would do nothing, yet ride along in the decoder's name
    ("static:top_p=0.1", "static: top_p=0.1: top_p and sampled_scores shape sampling, and temperature=0 is greedy"),
    ("threshold:sampled_scores=true", "threshold: sampled_scores=True: top_p and sampled_scores shape sampling"),
    ("ar:top_p=0.5", "ar: top_p=0.5: top_p and sampled_scores shape sampling"),
    ("drafter:top_p=0.5", "drafter: top_p=0.5: top_p and sampled_scores shape sampling"),
    ("llada2:sampled_scores=false", "llada2: sampled_scores=False: top_p and sampled_scores shape sampling"),
])
def test_out_of_range_decoder_options_are_refused(spec, message):
    with pytest.raises(DecoderSpecError) as err:
        parse_decoder(spec)
    assert message in str(err.value)


def test_python_decoder_configs_are_checked_like_specs():
    with pytest.raises(DecoderSpecError, match=r"threshold: tau=2 must be in \(0, 1\]"):
        Threshold(tau=2)
    with pytest.raises(DecoderSpecError, match="static: k=1.5 must be an integer"):
        Static(k=1.5)
    with pytest.raises(DecoderSpecError, match="static: k=True must be an integer"):
        Static(k=True)
    with pytest.raises(DecoderSpecError, match="entropy: gamma='0.5' must be a finite number"):
        Entropy(gamma="0.5")
    assert parse_decoder(" threshold : tau = 0.5 ") == Threshold(tau=0.5)


def test_cli_refuses_an_out_of_range_decoder(capsys):
    err = one_line_error(capsys, ["generate", "--model", "random-sdar", "--prompt", "Hi", "--decoder",
                                  "threshold:tau=-1", "--max-new-tokens", "4"])
    assert "tau=-1.0 must be in (0, 1]" in err


# -- lengths: any max_new_tokens >= 1 --------------------------------------------------------------


def test_max_new_tokens_must_be_positive(capsys):
    model = dlmjax.load_model(dlmjax.presets.resolve_model("random-sdar"))
    for bad in (0, -5):
        with pytest.raises(InputError, match=f"max_new_tokens={bad} must be >= 1"):
            generate(model, [[5, 6]], max_new_tokens=bad)
    with pytest.raises(InputError, match="max_new_tokens=2.5 must be an integer"):
        generate(model, [[5, 6]], max_new_tokens=2.5)
    with pytest.raises(SystemExit):
        main(["generate", "--model", "random-sdar", "--prompt", "Hi", "--max-new-tokens", "0"])
    assert "argument --max-new-tokens: 0 must be >= 1" in capsys.readouterr().err


def test_prompts_are_checked():
    model = dlmjax.load_model(dlmjax.presets.resolve_model("random-sdar"))
    with pytest.raises(InputError, match=r"pass one prompt as \[prompt\]"):
        generate(model, "What is 2+3?", max_new_tokens=4)  # a string is not a list of prompts
    with pytest.raises(InputError, match=r"prompt 1 holds token ids outside the model's vocabulary \[0, 100\)"):
        generate(model, [[1, 2], [3, 100]], max_new_tokens=4)
    with pytest.raises(InputError, match="prompt 0 is neither text nor a list of token ids"):
        generate(model, [[1, 2.5]], max_new_tokens=4)
    with pytest.raises(InputError, match="prompt 0 is neither text nor a list of token ids"):
        generate(model, [b"hi"], max_new_tokens=4)  # bytes are not ids of their byte values
    with pytest.raises(InputError, match=r"a 1-d array of token ids is one prompt; pass one prompt as \[prompt\]"):
        generate(model, np.array([1, 2, 3]), max_new_tokens=4)
    with pytest.raises(InputError, match=r"neither a spec string nor a decoder; .*not the class"):
        generate(model, [[1, 2]], decoder=Threshold, max_new_tokens=4)
    # a mask id in a prompt would be generated over where it falls in the first generation block
    mask = model.config.mask_token_id
    with pytest.raises(InputError, match=rf"prompt 1 holds the mask token \(id {mask}\) at position 2; .*remove it"):
        generate(model, [[1, 3], [3, 4, mask]], max_new_tokens=4)
    # prompts read once: a generator (or an iterator as one prompt) is every prompt it yields
    listed = [r.tokens for r in generate(model, [[1, 3, 4], [4, 5], [6]], max_new_tokens=4).rows]
    assert [r.tokens for r in generate(model, (p for p in [[1, 3, 4], [4, 5], [6]]), max_new_tokens=4).rows] == listed
    assert generate(model, [iter([1, 3, 4])], max_new_tokens=4).rows[0].tokens == listed[0]
    tokenizer = load_tokenizer(dlmjax.presets.resolve_model("random-sdar"))
    texts = np.array(["12+3=", "4+5="], dtype=object)  # what pandas' .to_numpy() gives
    assert len(generate(model, (t for t in texts), tokenizer=tokenizer, max_new_tokens=2).rows) == 2
    assert len(generate(model, texts, tokenizer=tokenizer, max_new_tokens=2).rows) == 2


def test_numpy_values_and_out_of_range_ids_seeds_and_stream_sizes():
    """numpy's integers and [B, L] arrays are what they look like; ids and seeds outside their
    range, and a Stream's refill or limit below 1, are InputErrors, not hangs or raw errors (the
    prompts avoid id 2, random-sdar's mask)."""
    model = dlmjax.load_model(dlmjax.presets.resolve_model("random-sdar"))
    plain = generate(model, [[1, 3, 4], [4, 5, 6]], max_new_tokens=4)
    same = generate(model, np.array([[1, 3, 4], [4, 5, 6]]), max_new_tokens=np.int64(4), seed=np.int32(0))
    assert [r.tokens for r in same.rows] == [r.tokens for r in plain.rows]
    texts = generate(model, np.array(["12+3=", "4+5="]), tokenizer=load_tokenizer(
        dlmjax.presets.resolve_model("random-sdar")), max_new_tokens=2)  # numpy's strings are texts
    assert len(texts.rows) == 2
    as_jax = generate(model, [[1, 3], [3, 4]], max_new_tokens=4, row_ids=jax.numpy.arange(2), seed=jax.numpy.int32(0))
    assert [r.tokens for r in as_jax.rows] == [r.tokens for r in generate(model, [[1, 3], [3, 4]], max_new_tokens=4).rows]
    for kwargs, message in [(dict(row_ids=[2**40, 1]), r"row_ids must lie in \[0, 2147483647\]"),
                            (dict(row_ids=[0.5, 1]), "row_ids must be one integer per prompt"),
                            (dict(seed=2**70), "seed=1180591620717411303424 must be"),
                            (dict(seed=1.5), "seed=1.5 must be an integer")]:
        with pytest.raises(InputError, match=message):
            generate(model, [[1, 3], [3, 4]], max_new_tokens=4, **kwargs)
    for kwargs in (dict(refill=-1), dict(refill=2.5), dict(refill=0), dict(limit=0), dict(seed=-1)):
        with pytest.raises(InputError, match=f"{next(iter(kwargs))}="):
            Stream(model, [[1, 3], [3, 4]], batch_size=2, max_new_tokens=4, **kwargs)


def test_any_max_new_tokens_is_decoded_and_cut(capsys):
    """5 tokens at block 4: two whole blocks are decoded and the first 5 kept, by generate, by
    the Stream (continuous batching) and by the CLI alike."""
    path = dlmjax.presets.resolve_model("random-sdar")
    model, tok = dlmjax.load_model(path), None
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    eight = generate(model, prompts, decoder="threshold:tau=0.5", max_new_tokens=8)
    five = generate(model, prompts, decoder="threshold:tau=0.5", max_new_tokens=5)
    for whole, cut in zip(eight.rows, five.rows):
        assert cut.tokens == whole.tokens[:5] and cut.num_tokens == len(cut.tokens) <= 5
    streamed = dict(Stream(model, prompts, batch_size=2, tokenizer=tok, decoder="threshold:tau=0.5", max_new_tokens=5))
    assert [streamed[i].tokens for i in range(3)] == [r.tokens for r in five.rows]

    assert main(["generate", "--model", "random-sdar", "--prompt", "Hello", "--max-new-tokens", "5", "--json"]) == 0
    assert 0 < len(json.loads(capsys.readouterr().out)["tokens"]) <= 5


# -- config.json and YAML: the file, the line, the key ---------------------------------------------


def test_config_json_syntax_error_names_file_and_line(checkpoint, capsys):
    text = (checkpoint / "config.json").read_text()
    (checkpoint / "config.json").write_text(text.replace('"vocab_size"', '"vocab_size" 7,', 1))
    with pytest.raises(ConfigError, match=r"config.json: invalid JSON at line \d+, column \d+"):
        dlmjax.load_model(checkpoint)
    err = one_line_error(capsys, ["generate", "--model", str(checkpoint), "--prompt", "Hi"])
    assert str(checkpoint / "config.json") in err


@pytest.mark.parametrize("change,message", [
    ({"num_attention_heads": 0}, "config.json `num_attention_heads`=0 must be >= 1"),
    ({"hidden_size": "32"}, "config.json `hidden_size`='32' must be an integer"),
    ({"tie_word_embeddings": "false"}, "config.json `tie_word_embeddings`='false' must be true or false"),
    ({"eos_token_id": [1, "x"]}, "config.json `eos_token_id`='x' must be an integer"),
])
def test_config_json_values_are_typed(checkpoint, change, message):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as err:
        dlmjax.load_model(checkpoint)
    assert message.replace("config.json", str(checkpoint / "config.json")) in str(err.value)  # which file


def test_a_key_given_twice_in_a_run_config_is_refused_naming_the_line(tmp_path, capsys):
    """A second `train:` section used to replace the first, its unset keys back at their defaults."""
    config = tmp_path / "twice.yaml"
    config.write_text("objective: block_diffusion\ntrain:\n  steps: 3\n  lr: 1e-3\ntrain:\n  steps: 10\n")
    err = one_line_error(capsys, ["train", str(config), "--out", str(tmp_path / "run")])
    assert f"{config}: YAML syntax error: line 5, column 1: key 'train' is given twice; keep one" in err
    config.write_text("objective: block_diffusion\ntrain:\n  steps: 3\n  steps: 4\n")
    assert "line 4, column 3: key 'steps' is given twice" in one_line_error(
        capsys, ["train", str(config), "--out", str(tmp_path / "run")])
    # an override's value too (the last weight used to win)
    assert "key 'toy-arith' is given twice" in one_line_error(
        capsys, ["train", "configs/toy-sdar.yaml", "data.tasks={toy-arith: 1, toy-arith: 2}", "--out",
                 str(tmp_path / "run")])


@pytest.mark.parametrize("override, message", [
    ("train.seed=4294967297", r"train.seed=4294967297 must be in \[0, 4294967295\]"),
    ("data.seed=-1", r"data.seed=-1 must be in \[0, 4294967295\]"),
])
def test_run_config_seeds_are_32_bit(override, message):
    """jax keeps a seed's low 32 bits: seed 2**32 + 1 was the run of seed 1, 2**63 an internal error."""
    from dlmjax.train.config import RunConfigError, load_run_config

    with pytest.raises(RunConfigError, match=f"^configs/toy-sdar.yaml with the overrides {override}: {message}"):
        load_run_config("configs/toy-sdar.yaml", [override])  # the override named, not the file alone


def test_a_run_config_error_in_the_file_names_the_file_alone(tmp_path):
    from dlmjax.train.config import RunConfigError, load_run_config

    config = tmp_path / "run.yaml"
    config.write_text("objective: block_diffusion\ntrain:\n  steps: abc\n")
    with pytest.raises(RunConfigError, match=f"^{config}: train.steps='abc' must be an integer"):
        load_run_config(config, ["train.lr=0.001"])


def test_mrp_temperature_is_refused_where_the_loss_does_not_read_it():
    from dlmjax.train.config import RunConfigError, load_run_config

    assert load_run_config("configs/mrp/toy-sdar.yaml", ["mrp.temperature=2.0"]).mrp.temperature == 2.0
    with pytest.raises(RunConfigError, match="mrp.temperature=2.0 is the KD temperature.*mrp.loss=ce does not"):
        load_run_config("configs/mrp/toy-sdar.yaml", ["mrp.temperature=2.0", "mrp.loss=ce"])


def test_yaml_syntax_error_names_file_and_line(tmp_path, capsys):
    config = tmp_path / "broken.yaml"
    config.write_text("objective: block_diffusion\ntrain:\n  steps: 3\n   lr: 1e-3\n")
    err = one_line_error(capsys, ["train", str(config), "--out", str(tmp_path / "run")])
    assert f"{config}: YAML syntax error: line 4, column" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override,message", [
    ("train.steps=-1", "train.steps=-1 must be >= 0"),
    ("train.lr=fast", "train.lr='fast' must be a finite number"),
    ("data.tasks={toy-arith: 0}", "data.tasks.toy-arith=0 must be > 0"),
    ("data.tasks={gsm8k: 1}", "data.tasks='gsm8k'; choose one of toy-arith, toy-constraint"),
    ("train=3", "`train` must be a mapping of keys to values"),
    ("train.steps=[", "is not valid YAML"),
])
def test_yaml_semantic_errors_name_file_key_and_allowed_values(override, message):
    with pytest.raises(RunConfigError) as err:
        load_run_config(REPO / "configs" / "toy-sdar.yaml", [override])
    where = f"{REPO / 'configs' / 'toy-sdar.yaml'} with the overrides {override}: "  # the override at fault
    assert str(err.value).startswith(where) and message in str(err.value)


# -- checkpoint files -------------------------------------------------------------------------------


def test_a_shard_the_index_does_not_list_is_refused(checkpoint):
    assert (checkpoint / "model.safetensors.index.json").is_file()
    save_file({"stray": np.zeros(2, np.float32)}, checkpoint / "leftover.safetensors")
    with pytest.raises(CheckpointError, match=r"holds shards that model.safetensors.index.json does not list: "
                                              r"\['leftover.safetensors'\]"):
        dlmjax.load_model(checkpoint)


def test_an_index_that_misplaces_a_tensor_is_refused(checkpoint):
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    name, shard = next(iter(index["weight_map"].items()))
    other = next(f for f in set(index["weight_map"].values()) if f != shard)
    index["weight_map"][name] = other
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"places tensors in shards that do not hold them: \\['{name}'\\]"):
        dlmjax.load_model(checkpoint)


def test_a_tokenizer_larger_than_the_vocab_is_refused(checkpoint):
    cfg = dlmjax.load_config(checkpoint)
    with pytest.raises(TokenizerError, match=f"has {cfg.vocab_size} tokens but the model's vocab_size is 50"):
        load_tokenizer(checkpoint, cfg.replace(vocab_size=50))


def test_a_wrong_dtype_in_a_shard_names_the_file(checkpoint):
    shard = next(checkpoint.glob("model-*.safetensors"))
    tensors = {k: np.array(SafetensorsFile(shard).get(k)) for k in SafetensorsFile(shard).keys()}
    first = next(iter(tensors))
    tensors[first] = tensors[first].astype(np.float64)  # F64 is readable: it is cast to the config's dtype
    save_file(tensors, shard)
    assert dlmjax.load_model(checkpoint).config.dtype == "float32"
    data = bytearray(shard.read_bytes())
    size = int.from_bytes(data[:8], "little")
    data[8:8 + size] = data[8:8 + size].decode().replace('"F64"', '"I64"', 1).encode()
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name}: tensor '{first}' has dtype 'I64'"):
        dlmjax.load_model(checkpoint)


# -- data files: unreadable rows reported with their line numbers, or refused ------------------------


def test_unreadable_data_rows_are_skipped_with_line_numbers_or_refused(tmp_path, capsys):
    data = tmp_path / "gsm.jsonl"
    good = json.dumps({"question": "1+1?", "answer": "2\n#### 2"})
    data.write_bytes("\n".join([good, "{not json", json.dumps({"question": "q"}), good]).encode() + b"\n\xff\xfe\n")
    loaded = load_eval_set("gsm8k", data=data)
    assert len(loaded.items) == 2
    assert loaded.skipped == ["row 2: invalid JSON (Expecting property name enclosed in double quotes)",
                              "row 3: missing or empty 'answer'", "row 5: not UTF-8 text"]
    # --limit 1 evaluates row 1 alone: the problems of rows it never reached are not its own
    assert load_eval_set("gsm8k", data=data, limit=1).skipped == []
    assert load_eval_set("gsm8k", data=data, limit=2).skipped == loaded.skipped[:2]  # rows 1 and 4 evaluated
    bad = tmp_path / "bad.jsonl"  # no usable row: every problem is reported, whatever the limit
    bad.write_text("{not json\n" + json.dumps({"question": "q"}) + "\n")
    assert len(load_eval_set("gsm8k", data=bad, limit=1).skipped) == 2
    with pytest.raises(DatasetError, match=r"gsm.jsonl: 3 unusable rows \(row 2: invalid JSON"):
        load_eval_set("gsm8k", data=data, strict=True)
    err = one_line_error(capsys, ["eval", "--model", "random-sdar", "--task", "gsm8k", "--data", str(data),
                                  "--strict-data", "--no-progress", "--out", str(tmp_path / "out")])
    assert "drop --strict-data to skip them" in err
    err = one_line_error(capsys, ["eval", "--model", "toy-sdar", "--task", "toy-arith", "--strict-data",
                                  "--no-progress", "--out", str(tmp_path / "toy")])  # nothing it could refuse
    assert "toy-arith read no file (they are generated); drop --strict-data" in err


def test_export_refuses_a_drafter_dtype_without_a_drafter(tmp_path, capsys):
    err = one_line_error(capsys, ["export", "toy-sdar", str(tmp_path / "out"), "--drafter-dtype", "float32"])
    assert "holds none (no drafter/); drop --drafter-dtype" in err and not (tmp_path / "out").exists()


# -- the CLI: user errors in one line, bugs with their traceback ---------------------------------------


def test_an_internal_error_keeps_its_traceback_and_says_it_is_a_bug(monkeypatch, capsys):
    def broken_export(args):  # stands for a bug anywhere below a command
        return {}["missing"]

    monkeypatch.setattr("dlmjax.cli.cmd_export", broken_export)
    assert main(["export", "random-sdar", "out"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "KeyError: 'missing'" in err
    assert err.strip().endswith("this is a bug in dlmjax, not a mistake in your input; please report it with the "
                                "traceback above")


# -- nothing lost ---------------------------------------------------------------------------------------


def test_train_out_refuses_a_directory_holding_a_checkpoint(checkpoint, capsys):
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    err = one_line_error(capsys, ["train", "configs/toy-sdar.yaml", "train.steps=1", "--out", str(checkpoint)])
    assert "which is not a dlmjax run; pass a new or empty directory" in err
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before


def test_train_out_refuses_a_path_orbax_would_read_as_a_pattern(tmp_path, capsys):
    """Under `run[1]/` Orbax saved checkpoints whose metadata never landed: the run could not resume."""
    err = one_line_error(capsys, ["train", "configs/toy-sdar.yaml", "train.steps=1", "--out", str(tmp_path / "run[1]")])
    assert "pass a directory without '['" in err and not (tmp_path / "run[1]").exists()


def test_export_refuses_a_directory_with_a_config(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    err = one_line_error(capsys, ["export", "random-sdar", str(tmp_path / "out")])
    assert "already holds a checkpoint (config.json)" in err
    # part of one: a shard index or a drafter, which the export would keep beside its new weights
    stale_index, stale_drafter = tmp_path / "index", tmp_path / "drafter"
    (stale_index / "model.safetensors.index.json").parent.mkdir()
    (stale_index / "model.safetensors.index.json").write_text("{}")
    (stale_drafter / "drafter").mkdir(parents=True)
    for target, name in ((stale_index, "model.safetensors.index.json"), (stale_drafter, "drafter")):
        err = one_line_error(capsys, ["export", "random-sdar", str(target)])
        assert f"already holds a checkpoint ({name})" in err


KILL_DURING_EXPORT = textwrap.dedent("""
    import os, signal, sys
    import dlmjax
    import dlmjax.io.hf as hf
    from dlmjax.train.loop import export_run

    real_save = hf.save_file

    def save_then_die(*args, **kwargs):  # the process ends between two files of the export
        real_save(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    hf.save_file = save_then_die
    run_dir = sys.argv[1]
    model = dlmjax.load_model(run_dir + "/model")
    export_run(dlmjax.init_model(model.config, seed=7), __import__("pathlib").Path(run_dir))
""")


def test_a_killed_export_leaves_the_previous_checkpoint_loadable(tmp_path):
    from dlmjax.train.loop import export_run

    run_dir = tmp_path / "run"
    ids = save_char_tokenizer(run_dir / "tokenizer")
    original = dlmjax.init_model(tiny_config(ids), seed=0)
    export_run(original, run_dir)
    before = {p.name: p.read_bytes() for p in (run_dir / "model").iterdir()}

    killed = subprocess.run([sys.executable, "-c", KILL_DURING_EXPORT, str(run_dir)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert killed.returncode == -9, killed.stderr  # SIGKILL: after the first file, before the rest
    assert {p.name: p.read_bytes() for p in (run_dir / "model").iterdir()} == before
    reloaded = dlmjax.load_model(run_dir / "model")
    np.testing.assert_array_equal(np.asarray(reloaded.embed[...]), np.asarray(original.embed[...]))
    assert any(".partial-" in p.name for p in run_dir.iterdir())  # the killed staging directory

    export_run(dlmjax.init_model(tiny_config(ids), seed=7), run_dir)  # the next export cleans up after it
    assert sorted(p.name for p in run_dir.iterdir()) == ["model", "tokenizer"]
    assert not np.array_equal(np.asarray(dlmjax.load_model(run_dir / "model").embed[...]),
                              np.asarray(original.embed[...]))
