"""The `dlmjax` command line: generate (--json contract) and export."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dlmjax
import dlmjax.presets
from dlmjax.cli import main, parse_args


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
        assert {"text", "tokens", "nfe", "tpf", "batch_forwards", "batch_tpf"} <= set(row)
        assert 0 < len(row["tokens"]) <= 8 and row["nfe"] >= 1 and row["tpf"] >= 1.0
        assert row["batch_forwards"] >= row["nfe"] and 0 < row["batch_tpf"] <= row["tpf"] * 2


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


def test_unknown_inputs_are_named_as_the_user_gave_them(capsys):
    assert main(["export", "no/such/dir", "out"]) == 2
    assert "export SRC 'no/such/dir' is neither a checkpoint directory nor a preset" in capsys.readouterr().err
    assert main(["lm-eval", "--model", "dlmjax", "--model_args", "pretrained=no/such/dir", "--tasks", "gsm8k"]) == 2
    assert "model_args pretrained= 'no/such/dir' is neither" in capsys.readouterr().err


def test_lm_evals_own_argument_errors_are_one_line_errors(capsys):
    """A task name lm-eval does not know is the user's mistake (exit 2), not a dlmjax bug (exit 1)."""
    assert main(["lm-eval", "--model", "dlmjax", "--model_args", "pretrained=toy-ar", "--tasks", "gsm8k_locl"]) == 2
    err = capsys.readouterr().err
    assert "lm-eval refused its arguments: Tasks not found: gsm8k_locl" in err and "internal error" not in err


@pytest.mark.parametrize("argv", [
    ["eval", "--task", "toy-arith", "--limit", "2", "--out", "{file}"],
    ["eval", "--task", "toy-arith", "--limit", "2", "--out", "{file}/sub"],
    ["export", "random-qwen3", "{file}/sub"],
    ["traces", "--per-task", "2", "--out", "{file}"],
])
def test_an_output_directory_that_is_a_file_is_refused_before_any_work(argv, tmp_path, capsys):
    file = tmp_path / "a.txt"
    file.write_text("keep me")
    assert main([a.format(file=file) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "is a file; choose a directory" in err or "which is a file; choose a directory" in err
    assert file.read_text() == "keep me"


@pytest.mark.parametrize("argv", [
    ["eval", "--task", "toy-arith", "--limit", "2", "--out", "{link}"],
    ["train", "configs/toy-ar.yaml", "--out", "{link}/run"],
    ["traces", "--per-task", "2", "--out", "{link}"],
])
def test_an_output_path_through_a_link_to_nothing_or_too_long_is_one_line(argv, tmp_path, capsys):
    """A dangling link passed the check (exists() follows it) and failed on mkdir as an internal
    error; so did a name too long for the filesystem."""
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "gone")
    root = str(Path(__file__).parents[1])
    argv = [f"{root}/{a}" if a.endswith(".yaml") else a.format(link=link) for a in argv]
    assert main(argv) == 2
    assert f"{link} is a link to nothing" in capsys.readouterr().err
    too_long = [a.replace(str(link), str(tmp_path / ("x" * 300))) for a in argv]
    assert main(too_long) == 2
    err = capsys.readouterr().err
    assert "File name too long" in err and "internal error" not in err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "toy-ar", "--prompt", "1+1\n", "--decoder", "ar", "--drafter", "toy-ar"],
     "--drafter toy-ar is for the drafter decoder, which none of the decoders named is"),
    (["eval", "--model", "toy-ar", "--task", "toy-arith", "--limit", "1", "--decoder", "ar", "--drafter", "toy-ar",
      "--out", "{tmp}/e"], "--drafter toy-ar is for the drafter decoder"),
    (["generate", "--model", "toy-sdar", "--prompt", "1+1\n", "--decoder", "static", "--tspd-controller", "toy-sdar"],
     "--tspd-controller toy-sdar is for the tspd and tspd+ce decoders, which none of the decoders is"),
    (["eval", "--task", "toy-arith", "--limit", "1", "--decoder", "static", "--tspd-controller", "toy-sdar", "--out",
      "{tmp}/e"], "--tspd-controller toy-sdar is for the tspd and tspd+ce decoders"),
    (["eval", "--backend", "lm-eval", "--task", "gsm8k", "--num-fewshot", "-1", "--out", "{tmp}/e"], "-1 must be >= 0"),
])
def test_a_flag_that_would_be_ignored_is_refused(argv, message, tmp_path, capsys):
    """They were accepted and ignored (a path that did not exist too), so the run was not the one asked for."""
    try:
        code = main([a.format(tmp=tmp_path) for a in argv])
    except SystemExit as exit_:  # argparse's refusal
        code = exit_.code
    assert code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("command", [["eval", "--task", "toy-arith", "--limit", "2"], ["export", "random-qwen3"],
                                     ["traces", "--per-task", "2"], ["train", "configs/toy-ar.yaml"]])
def test_an_output_url_is_refused_before_any_work(command, tmp_path, monkeypatch, capsys):
    """`--out gs://bucket/run` used to write a local ./gs:/bucket/run tree and report the URL (and
    `train` died in the TensorBoard writer, leaving a half-made run)."""
    monkeypatch.chdir(tmp_path)
    config = [str(Path(__file__).parents[1] / a) if a.endswith(".yaml") else a for a in command]
    argv = config + (["gs://bucket/run"] if command[0] == "export" else ["--out", "gs://bucket/run"])
    assert main(argv) == 2
    assert "gs://bucket/run is a URL, which dlmjax does not write to; mount the bucket" in capsys.readouterr().err
    assert not (tmp_path / "gs:").exists()


@pytest.mark.skipif(os.access("/proc/sys", os.W_OK), reason="no read-only directory here to write into")
def test_an_output_directory_that_cannot_be_written_is_refused_before_any_work(capsys):
    """A read-only filesystem: eval decoded everything, then failed as an "internal error"."""
    assert main(["eval", "--task", "toy-arith", "--limit", "2", "--out", "/proc/sys/dlmjax-results"]) == 2
    assert "output directory /proc/sys/dlmjax-results cannot be written: /proc/sys above it" in capsys.readouterr().err


def test_a_reader_that_stops_early_is_not_an_internal_error(tmp_path):
    """`dlmjax eval ... | head -1`: the pipe closes before the table is printed."""
    code = ("import sys; sys.argv = ['dlmjax', 'eval', '--task', 'toy-arith', '--limit', '2', '--decoder', 'static', "
            f"'--no-progress', '--out', {str(tmp_path / 'out')!r}]; from dlmjax.cli import main; sys.exit(main())")
    reader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              cwd=Path(__file__).parent.parent)
    reader.stdout.close()  # the reader is gone before the first line
    assert reader.wait(timeout=600) == 0
    err = reader.stderr.read().decode()
    assert "internal error" not in err and "Traceback" not in err, err


def test_ctrl_c_is_one_line_that_says_how_to_resume(capsys):
    from dlmjax.cli import _run

    def interrupted():
        raise KeyboardInterrupt

    assert _run("train", interrupted) == 130
    assert capsys.readouterr().err == ("dlmjax train: interrupted; rerun the same command to resume from the last "
                                       "finished step\n")


def test_an_interrupted_eval_keeps_its_finished_runs(capsys, tmp_path, monkeypatch):
    """Ctrl-C during the second (task, decoder) run: the first run's results are written, marked
    incomplete, and the earlier results moved aside as a finished run's would be (nothing was
    written before)."""
    from dlmjax.evaluation import runner

    out, decoders = tmp_path / "eval", ["--decoder", "static", "--decoder", "threshold:tau=0.9"]
    argv = ["eval", "--model", "toy-sdar", "--task", "toy-arith", "--limit", "2", "--no-progress", "--out", str(out)]
    assert main(argv + decoders) == 0
    finished = runner.evaluate_decoder

    def interrupted_second(*args, **kwargs):
        if interrupted_second.calls:
            raise KeyboardInterrupt
        interrupted_second.calls += 1
        return finished(*args, **kwargs)

    interrupted_second.calls = 0
    monkeypatch.setattr(runner, "evaluate_decoder", interrupted_second)
    assert main(argv + ["--decoder", "entropy", "--decoder", "static"]) == 130
    assert "any (task, decoder) runs that finished are in the --out directory" in capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert [r["decoder"] for r in results["runs"]] == ["entropy"] and results["settings"]["complete"] is False
    assert "partial, 1 of 2 runs" in (out / "results.md").read_text()
    (earlier,) = (out / "earlier").iterdir()  # the first, complete run, moved aside once
    assert json.loads((earlier / "results.json").read_text())["settings"]["complete"] is True


def test_a_seed_jax_would_truncate_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "random-sdar", "--prompt", "Hi", "--seed", str(2**32)])
    assert exit_info.value.code == 2 and "must be in [0, 4294967295]" in capsys.readouterr().err


def test_export_cli_roundtrip(tmp_path, capsys):
    src = dlmjax.presets.resolve_model("random-qwen3")
    assert main(["export", str(src), str(tmp_path / "out"), "--format", "torch"]) == 0
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    original, exported = dlmjax.load_model(src), dlmjax.load_model(tmp_path / "out")
    assert original.config == exported.config
    assert (original.embed[...] == exported.embed[...]).all()


def test_train_overrides_go_before_or_after_options(capsys):
    before = parse_args(["train", "configs/toy-sdar.yaml", "train.steps=3", "--out", "run", "train.lr=1e-3"])
    assert before.overrides == ["train.steps=3", "train.lr=1e-3"] and before.out == "run"
    with pytest.raises(SystemExit):
        parse_args(["train", "configs/toy-sdar.yaml", "--out", "run", "--stesp", "3"])
    assert "unrecognized arguments: --stesp 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["generate", "--model", "toy-sdar", "--prompt", "x", "a=b"])


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "dlmjax.cli", "--help"], capture_output=True, text=True, check=True)
    assert "generate" in out.stdout and "export" in out.stdout


def test_main_script_runs_on_a_given_interpreter(tmp_path):
    """`DLMJAX_PYTHON=python3 scripts/main.sh ...` (an accelerator machine's preinstalled python, no
    virtualenv) runs the command with that interpreter, where it is called: relative paths are the
    caller's."""
    root = Path(__file__).parents[1]
    env = {**os.environ, "DLMJAX_PYTHON": sys.executable}
    out = subprocess.run(["bash", str(root / "scripts" / "main.sh"), "--help"], capture_output=True, text=True,
                         env=env, cwd=root)
    assert out.returncode == 0, out.stderr
    assert "generate" in out.stdout and "export" in out.stdout
    out = subprocess.run(["bash", str(root / "scripts" / "main.sh"), "export", "toy-ar", "exported"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "exported" / "config.json").is_file() and not (root / "exported").exists()


def test_mrp_decoders_and_export_carry_the_head(tmp_path, capsys):
    """A head saved inside a checkpoint dir is picked up by `generate`; `export` writes it too
    (reference names, PyTorch format); without a head the mrp decoders name the fix."""
    from dlmjax.heads.mrp import init_head, load_head, save_head

    src = dlmjax.presets.resolve_model("random-sdar")
    assert main(["generate", "--model", str(src), "--prompt", "Hi", "--decoder", "mrp-spec"]) == 2
    assert "needs an MRP head" in capsys.readouterr().err
    ckpt = tmp_path / "with-head"
    assert main(["export", str(src), str(ckpt)]) == 0
    capsys.readouterr()
    model = dlmjax.load_model(ckpt)
    save_head(init_head(model.config, num_layers=1, seed=4), ckpt)
    static = main(["generate", "--model", str(ckpt), "--prompt", "Hi", "--max-new-tokens", "8", "--json"])
    static_row = json.loads(capsys.readouterr().out)
    assert static == 0
    for decoder in ("mrp-spec:drafts=2", "mrp-direct", "mrp-remask:tau=0.5"):
        assert main(["generate", "--model", str(ckpt), "--prompt", "Hi", "--decoder", decoder,
                     "--max-new-tokens", "8", "--json"]) == 0
        row = json.loads(capsys.readouterr().out)
        if decoder.startswith("mrp-spec"):
            assert row["tokens"] == static_row["tokens"]
    # --mrp-head takes the head from another directory than the model's
    assert main(["generate", "--model", str(src), "--mrp-head", str(ckpt), "--prompt", "Hi", "--decoder",
                 "mrp-spec:drafts=2", "--max-new-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == static_row["tokens"]
    assert main(["export", str(ckpt), str(tmp_path / "again")]) == 0
    assert "with its MRP head" in capsys.readouterr().out
    head, again = load_head(ckpt), load_head(tmp_path / "again", model.config)
    assert (head.mrp_modules[0].eh_proj.kernel[...] == again.mrp_modules[0].eh_proj.kernel[...]).all()
    # a float32 head beside a bf16 backbone (what training a head on it writes) is exported as it is
    # stored (it was rounded to bf16)
    from dlmjax.io.safetensors import SafetensorsFile

    bf16 = tmp_path / "bf16"
    dlmjax.export_model(dlmjax.load_model(src, dtype="bfloat16"), bf16, files_from=src)
    save_head(init_head(model.config, num_layers=1, seed=5), bf16)
    assert main(["export", str(bf16), str(tmp_path / "bf16-out")]) == 0
    stored, exported = (SafetensorsFile(d / "mrp_head.safetensors") for d in (bf16, tmp_path / "bf16-out"))
    assert stored.keys() == exported.keys()
    for name in stored.keys():
        assert exported.get(name).dtype == np.float32 and np.array_equal(exported.get(name), stored.get(name)), name


def test_causal_model_defaults_to_ar_and_decodes_with_its_drafter(capsys, tmp_path):
    """toy-ar ships a DFlash drafter in drafter/: `--decoder drafter` uses it and gives ar's tokens;
    no --decoder means ar (drafter with --drafter DIR); export carries the drafter; results carry the
    accepted length."""
    prompts = ["--prompt", "12+7-3\n", "--prompt", "4 distinct digits, sum 17\n"]
    assert main(["generate", "--model", "toy-ar", *prompts, "--max-new-tokens", "24", "--json"]) == 0
    ar = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(row["mean_accepted_length"] is None for row in ar)
    assert main(["generate", "--model", "toy-ar", *prompts, "--decoder", "drafter", "--max-new-tokens", "24",
                 "--json"]) == 0
    spec = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in ar]
    assert all(r["mean_accepted_length"] > 1.0 and r["nfe"] < a["nfe"] for r, a in zip(spec, ar))

    assert main(["export", "toy-ar", str(tmp_path / "out")]) == 0
    assert "DFlash drafter in drafter/ (bfloat16)" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "drafter" / "config.json").read_text())["dtype"] == "bfloat16"
    assert main(["generate", "--model", str(tmp_path / "out"), *prompts, "--decoder", "drafter",
                 "--max-new-tokens", "24", "--json"]) == 0
    assert [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()] == [r["tokens"] for r in ar]
    # --drafter DIR without --decoder decodes with that drafter (it was loaded by nothing: ar ran)
    assert main(["generate", "--model", "toy-ar", *prompts, "--drafter", str(tmp_path / "out" / "drafter"),
                 "--max-new-tokens", "24", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in ar] and all(r["mean_accepted_length"] > 1.0 for r in rows)

    out = tmp_path / "eval"
    assert main(["eval", "--model", "toy-ar", "--task", "toy-arith", "--limit", "4", "--no-progress",
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    runs = {r["decoder"]: r for r in results["runs"]}
    assert set(runs) == {"ar", "drafter"} and runs["drafter"]["accuracy"] == runs["ar"]["accuracy"]
    # the drafter found in the model's directory is recorded (it was null), by its absolute path
    assert results["settings"]["drafter"] == str(dlmjax.presets.resolve_model("toy-ar") / "drafter")
    assert results["settings"]["mrp_head"] is None and results["settings"]["working_directory"] == os.getcwd()
    assert runs["drafter"]["mean_accepted_length"] > 1.0 and runs["ar"]["mean_accepted_length"] is None
    # --compare-to names the drafter decoder: its drafter is loaded as for --decoder (it was not)
    assert main(["eval", "--model", "toy-ar", "--task", "toy-arith", "--limit", "2", "--no-progress",
                 "--decoder", "ar", "--compare-to", "drafter", "--out", str(out)]) == 0


def test_drafter_errors_name_the_fix(capsys, tmp_path):
    assert main(["generate", "--model", "random-qwen3", "--prompt", "Hi", "--decoder", "drafter"]) == 2
    assert "--drafter DIR" in capsys.readouterr().err
    assert main(["generate", "--model", "toy-sdar", "--prompt", "Hi", "--drafter", str(tmp_path)]) == 2
    assert "--drafter serves causal" in capsys.readouterr().err
    # a decoder of the other kind is named as such, not sent for a drafter or a controller it would need
    assert main(["generate", "--model", "toy-sdar", "--prompt", "Hi", "--decoder", "drafter"]) == 2
    assert "decoder 'drafter' does not fit a block_causal sdar model; use a diffusion decoder" in capsys.readouterr().err
    assert main(["generate", "--model", "toy-ar", "--prompt", "Hi", "--decoder", "tspd"]) == 2
    assert "decoder 'tspd' does not fit a causal qwen3 model; use --decoder ar" in capsys.readouterr().err


def test_tspd_decoders_use_the_models_controller_and_traces_run(capsys, tmp_path):
    """toy-sdar ships a TSPD controller: `--decoder tspd` finds it; export carries it; `dlmjax
    traces` writes its files."""
    args = ["generate", "--model", "toy-sdar", "--prompt", "12+7-3\n", "--max-new-tokens", "16", "--json"]
    assert main([*args, "--decoder", "tspd+ce"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["tpf"] > 1.0 and row["tokens"]
    # `tspd` and `tspd:controller=toy-sdar` are one decoder (it ran twice), for --compare-to too
    assert main(["eval", "--model", "toy-sdar", "--task", "toy-arith", "--limit", "1", "--no-progress",
                 "--decoder", "tspd", "--decoder", "tspd:controller=toy-sdar", "--compare-to",
                 "tspd:controller=toy-sdar", "--out", str(tmp_path / "eval")]) == 0
    runs = json.loads((tmp_path / "eval" / "results.json").read_text())["runs"]
    assert [r["decoder"] for r in runs] == ["tspd:controller=toy-sdar"]  # the label names it as the user did
    # a comma in the controller's path would split the decoder's options: named, not misread
    assert main([*args, "--decoder", "tspd", "--tspd-controller", str(tmp_path / "a,b")]) == 2
    assert "holds a ',', which separates a decoder's options" in capsys.readouterr().err
    assert main(["export", "toy-sdar", str(tmp_path / "out")]) == 0
    assert "TSPD controller" in capsys.readouterr().out
    assert (tmp_path / "out" / "tspd_controller.safetensors").is_file()
    alone = tmp_path / "run-model"  # a TSPD run's model/: the controller without a model
    alone.mkdir()
    (alone / "tspd_controller.safetensors").write_bytes((tmp_path / "out" / "tspd_controller.safetensors").read_bytes())
    assert main(["export", str(alone), str(tmp_path / "out2")]) == 2
    assert f"holds a TSPD controller alone (a TSPD training run's model/): decode with --tspd-controller {alone}" in \
        capsys.readouterr().err
    assert main(["traces", "--model", "toy-sdar", "--tasks", "toy-arith", "--per-task", "2", "--out",
                 str(tmp_path / "traces")]) == 0
    assert {"traces.npz", "meta.json"} <= {p.name for p in (tmp_path / "traces").iterdir()}
    assert main(["traces", "--seed", "1234", "--out", str(tmp_path / "t2")]) == 2
    assert "evaluation prompts" in capsys.readouterr().err
    # toy-sdar is block-causal: its own exact cache, as the decoders refuse another (it was ignored)
    assert main(["traces", "--model", "toy-sdar", "--cache", "dual", "--per-task", "2",
                 "--out", str(tmp_path / "t4")]) == 2
    assert "--cache dual: a block-causal model decodes with its own exact cache" in capsys.readouterr().err
    # over 8 devices a batch of 6 is rounded up, as eval's (it was refused)
    assert main(["traces", "--model", "toy-sdar", "--tasks", "toy-arith", "--per-task", "2", "--data-parallel",
                 "--batch-size", "6", "--out", str(tmp_path / "t3")]) == 0
    assert "--batch-size 6 rounded up to 8, a multiple of the 8 data-parallel devices" in capsys.readouterr().err


def test_traces_from_a_prompt_file(capsys, tmp_path):
    """A real model's controller needs traces of prompts like the ones it will decode: `--prompts`
    reads a JSONL field (or text lines) at a given length, the chat template optional. The traces
    equal those of the same prompts collected in Python."""
    import numpy as np

    from dlmjax.presets import load_checkpoint
    from dlmjax.traces import collect_traces, load_traces

    questions = ["12+7-3", "4 distinct digits, sum 11", "3+0+0+5"]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"question": q + "\n", "answer": "x"}) + "\n"
                                                  for q in questions[:1] + questions))  # the first twice
    out = tmp_path / "traces"
    assert main(["traces", "--model", "toy-sdar", "--prompts", str(tmp_path / "train.jsonl"), "--field", "question",
                 "--per-task", "2", "--max-new-tokens", "16", "--seed", "1234", "--out", str(out)]) == 0
    # the repeat is traced once, and --per-task 2 counts distinct prompts
    assert "1 prompt(s) encode to the token ids of an earlier one" in capsys.readouterr().out
    arrays, meta = load_traces(out)  # (--seed 1234 draws the toy tasks' eval prompts; with --prompts, nothing)
    assert meta["tasks"] == ["train"] and meta["num_prompts"] == 2 and meta["max_new_tokens"] == {"train": 16}
    _, model, tokenizer, _ = load_checkpoint("toy-sdar")
    direct = collect_traces(model, [tokenizer.encode(q + "\n") for q in questions[:2]], max_new_tokens=16)
    np.testing.assert_array_equal(arrays["label"], direct["label"])
    np.testing.assert_array_equal(arrays["features"], direct["features"])
    # without --per-task a prompt file is read whole (it used to stop at the tasks' default, 256)
    assert parse_args(["traces", "--prompts", "p.jsonl", "--out", "x"]).per_task is None
    (tmp_path / "bad.jsonl").write_text('{"question": "1+1"}\nnot json\n')
    (tmp_path / "bad.NDJSON").write_text('{"question": "1+1"}\nnot json\n')  # JSON lines too, not text
    (tmp_path / "list.json").write_text(json.dumps([{"question": "1+1"}, {"answer": "2"}], indent=1))  # as eval reads
    (tmp_path / "train.txt").write_text("".join(q + "\n" for q in questions))
    for argv, message in [
        (["--prompts", str(tmp_path / "train.jsonl")], "needs --max-new-tokens"),
        (["--prompts", str(tmp_path / "train.jsonl"), "--max-new-tokens", "8"], "without a text field 'prompt'"),
        (["--prompts", str(tmp_path / "bad.jsonl"), "--field", "question", "--max-new-tokens", "8"],
         "bad.jsonl: 1 row without a text field 'question' (row 2: invalid JSON"),
        (["--prompts", str(tmp_path / "bad.NDJSON"), "--field", "question", "--max-new-tokens", "8"],
         "bad.NDJSON: 1 row without a text field 'question' (row 2: invalid JSON"),
        (["--prompts", str(tmp_path / "list.json"), "--field", "question", "--max-new-tokens", "8"],
         "list.json: 1 row without a text field 'question' (row 2: missing or empty 'question')"),
        (["--prompts", str(tmp_path / "train.txt"), "--field", "question", "--max-new-tokens", "8"],
         "is read as text"),
        (["--prompts", str(tmp_path / "train.jsonl"), "--tasks", "toy-arith", "--max-new-tokens", "8"], "give one"),
        (["--chat"], "go with --prompts"),
        (["--tasks", ","], "names no task"),
    ]:
        assert main(["traces", "--model", "toy-sdar", *argv, "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err
    # prompt files are read as `dlmjax eval --data` reads them: gzipped, with a byte-order mark
    import gzip

    from dlmjax.traces import prompts_from_file

    (tmp_path / "bom.jsonl.gz").write_bytes(gzip.compress(b"\xef\xbb\xbf" + (tmp_path / "train.jsonl").read_bytes()))
    read = prompts_from_file(tmp_path / "bom.jsonl.gz", field="question")
    assert read == [q + "\n" for q in questions[:1] + questions]
    splits = {"train": [{"prompt": "train q"}], "test": [{"prompt": "test q"}]}
    (tmp_path / "splits.json").write_text(json.dumps(splits))
    assert prompts_from_file(tmp_path / "splits.json") == ["train q"]  # never a test split's
