"""Evaluation harness: sandbox, dataset loading, the data-parallel runner, the report and the CLI."""

import gzip
import json
import os
import time

import jax
import pytest

from dlmjax import arithmetic
from dlmjax.cli import main
from dlmjax.config import ModelConfig
from dlmjax.decoding.api import generate
from dlmjax.evaluation.report import pareto_front, pareto_plot
from dlmjax.evaluation.runner import RunRecord, compare_to, replicate_on, run_eval, token_agreement
from dlmjax.evaluation.sandbox import run_python
from dlmjax.evaluation.tasks import (
    DatasetError, gsm8k_cot_correct, humaneval_program, load_eval_set, read_rows, truncate_completion,
)
from dlmjax.io.hf import export_model, load_model
from dlmjax.io.tokenizer import load_tokenizer
from dlmjax.models.transformer import init_model
from dlmjax.sharding import make_mesh
from dlmjax.toy.tasks import extract_final_number, gsm8k_correct
from dlmjax.toy.tokenizer import save_char_tokenizer
from dlmjax.validation import InputError

# ------------------------------------------------------------------------------------------ sandbox


def test_a_sandboxed_program_run_as_this_user_keeps_its_process_limit(monkeypatch):
    """A user's process limit counts all its processes and threads: run as a non-root user (no
    drop to `nobody`), a limit of 16 left the program none, the evaluation's own threads (JAX's)
    using them up, so any program that started a thread failed. The limit is set only as `nobody`."""
    import threading

    from dlmjax.evaluation import sandbox

    check = ("import resource, threading\nassert resource.getrlimit(resource.RLIMIT_NPROC)[0] != 16\n"
             "t = threading.Thread(target=lambda: None)\nt.start()\nt.join()")
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)  # as a user who is not root
    idle = [threading.Timer(60, lambda: None) for _ in range(20)]  # this process's own threads
    for t in idle:
        t.start()
    try:
        assert run_python(check).passed
    finally:
        for t in idle:
            t.cancel()


def test_sandbox_passes_and_fails_programs():
    assert run_python("assert sum([1, 2]) == 3").passed
    failed = run_python("assert 1 == 2")
    assert failed.status == "failed" and "AssertionError" in failed.output
    local = run_python("open('here.txt', 'w').write('x')\nassert open('here.txt').read() == 'x'")
    assert local.passed  # its own directory is writable
    for early_exit in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"):
        exits = run_python(f"{early_exit}\nassert 1 == 2")  # a program that stops before its tests fails
        assert exits.status == "failed", early_exit
    # a program that captures its output (rebinding sys.stdout or print) has still run to its end
    for capture in ("import io, sys\nsys.stdout = io.StringIO()", "print = lambda *args, **kwargs: None",
                    "import sys\nsys.stdout.close()", "print('no newline at the end', end='')"):
        assert run_python(f"{capture}\nassert sum([1, 2]) == 3").passed, capture


def test_sandbox_kills_an_infinite_loop():
    start = time.perf_counter()
    result = run_python("while True:\n    pass", timeout_s=2)
    assert result.status == "timeout" and time.perf_counter() - start < 6


@pytest.mark.parametrize("program", [
    "import os\nwhile True:\n    os.fork()",
    "import multiprocessing\nwhile True:\n    multiprocessing.Process(target=print).start()",
    "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])",
    "import ctypes\nlibc = ctypes.CDLL(None)\nwhile True:\n    libc.fork()",
])
def test_sandbox_survives_a_fork_bomb(program):
    start = time.perf_counter()
    result = run_python(program, timeout_s=3)
    assert not result.passed and time.perf_counter() - start < 8
    assert run_python("print('still here')").passed  # the machine is still usable


def test_sandbox_runs_code_that_uses_numpy():
    """numpy imports ctypes and sets OPENBLAS_MAIN_FREE as it loads; a correct HumanEval/MBPP answer
    that uses it must pass. The handle to the interpreter's symbols that ctypes opens stays out of
    reach (it leads to libc's system())."""
    assert run_python("import numpy as np\nassert int(np.multiply(4, 3)) == 12", timeout_s=20).passed
    escape = run_python("import ctypes\nctypes.pythonapi.system(b'true')")
    assert not escape.passed and "pythonapi" in escape.output


def test_sandbox_output_flood_is_cut_by_the_file_size_limit():
    """Output goes to a file under the 16 MiB size limit, not into this process's memory."""
    start = time.perf_counter()
    result = run_python("while True:\n    print('x' * 10000)", timeout_s=5)
    assert not result.passed and time.perf_counter() - start < 5 and len(result.output) <= 2000


def test_sandbox_kills_a_program_that_fills_its_directory():
    """The file-size limit bounds one file; a loop writing file after file is killed once the
    directory holds more than DISK_LIMIT_BYTES, long before its timeout."""
    from dlmjax.evaluation.sandbox import DISK_LIMIT_BYTES

    start = time.perf_counter()
    result = run_python("i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(bytes(8 << 20))\n    i += 1", timeout_s=60)
    assert result.status == "failed" and result.output.endswith(f"[killed: wrote more than {DISK_LIMIT_BYTES >> 20} MiB]")
    assert time.perf_counter() - start < 30
    assert run_python("open('small', 'wb').write(bytes(1 << 20))").passed  # a program that writes a little passes


def test_sandbox_blocks_writes_outside_its_directory(tmp_path):
    targets = [tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"]
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    programs = [
        f"open({str(targets[0])!r}, 'w').write('escaped')",
        f"import os\nfd = os.open({str(targets[1])!r}, os.O_CREAT | os.O_WRONLY)\nos.write(fd, b'x')",
        f"import pathlib\npathlib.Path({str(targets[2])!r}).write_text('escaped')",
        f"import os\nos.remove({str(victim)!r})",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
    ]
    for program in programs:
        result = run_python(program)
        assert not result.passed and "sandbox" in result.output, program
    assert not any(t.exists() for t in targets)
    assert victim.read_text() == "keep me"


def test_sandbox_blocks_the_ways_around_its_audit_hook(tmp_path):
    """Calls that raise no audit event or carry a directory descriptor (a review's bypasses): a
    write and a delete through dir_fd, libc's system() through ctypes' default handle, process
    creation through _posixsubprocess (also after importing it anew), a signal to this process by
    pidfd, and a UDP datagram."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    witness = tmp_path / "pwned"
    programs = [
        f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
        f"os.write(os.open('pwned', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), b'x')",
        f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\nos.unlink('victim.txt', dir_fd=fd)",
        f"import ctypes\nassert ctypes.CDLL(None, handle=0).system(b'touch {witness}') == 0",
        "import _posixsubprocess\nassert _posixsubprocess.fork_exec is not None",
        "import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess",
        "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGTERM)",
        "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 9))",
    ]
    for program in programs:
        result = run_python(program)
        assert not result.passed, (program, result)
    assert victim.read_text() == "keep me" and not witness.exists()


def test_sandbox_runs_an_interpreter_nobody_cannot_reach(tmp_path, monkeypatch):
    """A virtualenv under a private directory (root's /root/venv) whose python links to a
    system interpreter: `nobody` cannot reach it by the name it is run by. The sandbox used to
    drop to `nobody` anyway, and scoring crashed with PermissionError after all the decoding."""
    import os
    import sys

    from dlmjax.evaluation import sandbox

    private = tmp_path / "private"
    (private / "bin").mkdir(parents=True)
    (private / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    private.chmod(0o700)
    assert not sandbox._runnable_by_others(str(private / "bin" / "python"))
    monkeypatch.setattr(sys, "executable", str(private / "bin" / "python"))
    monkeypatch.setattr(sandbox, "_runnable_by_others", lambda path: True)  # the old check's answer
    assert run_python("assert sum([1, 2]) == 3").passed


# ------------------------------------------------------------------------------------------ datasets


def test_gsm8k_rows_are_loaded_and_malformed_rows_reported(tmp_path):
    path = tmp_path / "test.jsonl"
    rows = [
        json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}),
        "{not json",
        json.dumps({"question": "no answer"}),
        json.dumps({"question": "q", "answer": "no final line"}),
        json.dumps(["a", "list"]),
        "",
        json.dumps({"question": "2 * 3?", "answer": "#### 6"}),
        # a '####' line without a number: its reference would be the last number of the steps
        json.dumps({"question": "q", "answer": "steps 3 and 4\n#### "}),
        json.dumps("just a string"),
    ]
    path.write_text("\n".join(rows) + "\n")
    for source in (path, tmp_path):  # a file or the directory holding it
        loaded = load_eval_set("gsm8k", data=source)
        assert [item.index for item in loaded.items] == [0, 6]
        assert loaded.items[0].prompt == "Question: 1 + 1?\nAnswer:"
        assert len(loaded.skipped) == 6 and "row 2: invalid JSON" in loaded.skipped[0]
        assert loaded.skipped[4:] == ["row 8: answer has no '#### N' line with a number",
                                      "row 9: not a JSON object (str)"]
    assert loaded.score(loaded.items, ["so #### 2", "#### 7"]) == [True, False]


def test_the_shipped_gsm8k_test_split_loads():
    loaded = load_eval_set("gsm8k")
    assert len(loaded.items) == 1319 and not loaded.skipped
    assert loaded.score(loaded.items[:1], [loaded.items[0].reference]) == [True]
    # a base model goes on with a question of its own: its numbers are not the answer
    answer = extract_final_number(loaded.items[0].reference)
    going_on = f" She makes ${answer} every day.\n\nQuestion: Tom has 3 apples and buys 4 more."
    assert loaded.score(loaded.items[:1], [going_on]) == [True]
    # a chat answer restating the question first is not cut there
    restated = f"**Question:** {loaded.items[0].prompt}\n\n**Answer:** so #### {answer}"
    assert loaded.score(loaded.items[:1], [restated]) == [True]
    # gsm8k-cot: the same rows, OpenCompass's 0-shot chain-of-thought prompt, the boxed answer scored
    cot = load_eval_set("gsm8k-cot", limit=2)
    assert cot.task == "gsm8k-cot" and cot.max_new_tokens == 512 and len(cot.items) == 2
    assert cot.items[0].prompt.startswith(loaded.items[0].reference and "Janet") and cot.items[0].prompt.endswith(
        "\nPlease reason step by step, and put your final answer within \\boxed{}.")
    scored = [f"16 - 3 - 4 = 9, so 9 * 2 = {answer}. \\boxed{{{answer}}}", f"\\boxed{{{answer}}} or maybe 7",
              f"It is \\boxed{{\\${answer}}}.", f"so {answer}", "\\boxed{7}", f"\\boxed{{7}}, not {answer}"]
    assert cot.score(cot.items[:1] * 6, scored) == [True, True, True, True, False, False]
    # a box holding more than one number is no answer (its last number is not what it says)
    assert cot.score(cot.items[:1] * 3, [f"\\boxed{{{answer} - 2}}", f"\\boxed{{20 - {answer}}}",
                                         f"\\boxed{{12 \\text{{ and }} {answer}}}"]) == [False] * 3


def test_gsm8k_numbers_in_latex_and_unicode_forms():
    """LaTeX thousands separators are read as commas, U+2212 as a minus, `.5` as a half."""
    for written in ("\\boxed{1,\\!234}", "\\boxed{1{,}234}", "\\boxed{1\\,234}", "$1,\\!234$", "\\boxed{\\$1,234.00}"):
        assert gsm8k_cot_correct(written, "#### 1234"), written
        assert gsm8k_correct(written, "#### 1,234"), written
    assert not gsm8k_correct("The answer is \u22123", "#### 3") and gsm8k_correct("The answer is \u22123", "#### -3")
    assert not gsm8k_correct("The answer is .5", "#### 5") and gsm8k_correct("It is .5 liters", "#### 0.5")
    assert gsm8k_correct("16-3=13, so 13", "#### 13") and not gsm8k_correct("1\\,2345", "#### 12345")


def test_dataset_errors_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(DatasetError, match="not found"):
        read_rows(tmp_path / "missing.jsonl")
    home = tmp_path / "home"
    home.mkdir()
    (home / "rows.jsonl").write_text('{"a": 1}\n')  # `--data=~/rows.jsonl`: the shell leaves ~ as it is
    monkeypatch.setenv("HOME", str(home))
    assert read_rows("~/rows.jsonl") == [(1, {"a": 1})]
    with pytest.raises(DatasetError, match="no .jsonl"):
        read_rows(tmp_path)
    with pytest.raises(DatasetError, match="--data|datasets"):
        read_rows("some-org/some-dataset")
    with pytest.raises(DatasetError, match="unknown task"):
        load_eval_set("mmlu")
    with pytest.raises(DatasetError, match="takes no --data"):
        load_eval_set("toy-arith", data=tmp_path)


def test_humaneval_canonical_solutions_pass_and_wrong_code_fails(tmp_path):
    loaded = load_eval_set("humaneval")
    assert len(loaded.items) == 164
    items = loaded.items[:4]
    canonical = [item.reference["canonical_solution"] for item in items]
    assert loaded.score(items, canonical) == [True] * 4
    assert loaded.score(items[:2], ["    return None\n", "    while True:\n        pass\n"]) == [False, False]
    assert truncate_completion("    return 1\n\ndef other():\n    pass") == "    return 1\n"
    assert "check(" in humaneval_program(items[0].reference, canonical[0])

    gz = tmp_path / "he.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps(items[0].reference) + "\n" + json.dumps({"task_id": "x"}) + "\n")
    local = load_eval_set("humaneval", data=gz)
    assert len(local.items) == 1 and local.skipped == ["row 2: missing or empty 'prompt'"]


def test_humaneval_scores_chat_answers_that_restate_the_function():
    """Instruct models (the presets run humaneval with a chat template) answer with the whole
    function, usually fenced and with prose around it; base models continue the body. Each of
    these passes with the canonical solution, and the same shapes with a wrong body fail."""
    problem = load_eval_set("humaneval").items[0].reference
    body, prompt = problem["canonical_solution"], problem["prompt"]
    def_line = prompt[prompt.index(f"def {problem['entry_point']}"):].split("\n")[0]

    def answers(body):
        return [
            body,  # a base model's continuation
            f"Here is the completed function:\n```python\n{prompt}{body}```\n\nIt compares every pair.",
            f"```python\n{prompt}{body}```",
            f"{prompt}{body}\n\nprint({problem['entry_point']}([1.0, 2.0], 0.5))\n",  # unfenced, with a demo
            f"```python\n{def_line}\n{body}```",  # no imports: the prompt's stay in front
            f"```python\n{body}```",  # a fenced body
            f"{body}```\n\nThis checks every pair.",  # the chat template opened the fence, the answer closes it
            f"Here is the implementation:\n\n{prompt}{body}",  # unfenced, prose before
            f"Here is the solution:\n\n{prompt}{body}\nThis function checks each pair.",  # prose after too
            # a base model that finishes the body and goes on to write the function again
            f"{body}\n\n\ndef {problem['entry_point']}(",
            f"{body}\n\n{prompt}",
        ]

    loaded = load_eval_set("humaneval")
    right, wrong = answers(body), answers("    return None\n")
    items = [loaded.items[0]] * len(right)
    assert loaded.score(items, right) == [True] * len(right)
    assert loaded.score(items, wrong) == [False] * len(wrong)
    # a word before an unclosed bare fence opens the block: it does not close one (the prompt's own
    # `def` made the word look like code)
    assert loaded.score(items[:2], [f"Sure\n```\n{prompt}{body}", f"Sure!\n```\n{prompt}{body}"]) == [True, True]


def test_humaneval_instruct_puts_opencompass_instruction_before_the_same_problems():
    """humaneval-instruct (the SDAR and MRP authors' OpenCompass prompt): the instruction, then the
    code prompt; the same rows and the same scorer, whose chat answers restate the function."""
    plain, instruct = load_eval_set("humaneval", limit=3), load_eval_set("humaneval-instruct", limit=3)
    assert instruct.task == "humaneval-instruct" and instruct.max_new_tokens == plain.max_new_tokens
    for a, b in zip(plain.items, instruct.items):
        assert b.prompt == "Read the following function signature and docstring, and fully implement the function " \
            "described. Your response should only contain the code for this function.\n" + a.prompt
        assert b.reference == a.reference
    problem = instruct.items[0].reference
    right = f"```python\n{problem['prompt']}{problem['canonical_solution']}```"
    wrong = f"```python\n{problem['prompt']}    return None\n```"
    assert instruct.score(instruct.items[:1] * 2, [right, wrong]) == [True, False]


# -------------------------------------------------------------------------------------------- runner


@pytest.fixture(scope="module")
def random_sdar(tmp_path_factory):
    """An untrained block-4 SDAR-style model with room for HumanEval prompts."""
    path = tmp_path_factory.mktemp("random-sdar")
    ids = save_char_tokenizer(path)
    cfg = ModelConfig(family="sdar", attention="block_causal", block_size=4, vocab_size=ids["vocab_size"],
                      hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=2048, qk_norm=True, mask_token_id=ids["mask"],
                      eos_token_ids=(ids["eos"],), pad_token_id=ids["pad"])
    export_model(init_model(cfg, seed=0), path)
    return path


@pytest.mark.devices(8)
def test_data_parallel_decoding_matches_a_single_device(random_sdar):
    model = load_model(random_sdar)
    tokenizer = load_tokenizer(random_sdar, model.config)
    prompts = [ex.prompt for ex in load_eval_set("toy-arith", limit=8).items]
    mesh = make_mesh(model=1)
    assert mesh.shape["data"] == 8
    for decoder in ("static", "threshold:tau=0.5"):
        single = generate(model, prompts, tokenizer=tokenizer, decoder=decoder, max_new_tokens=16)
        sharded = generate(replicate_on(model, mesh), prompts, tokenizer=tokenizer, decoder=decoder,
                           max_new_tokens=16, mesh=mesh)
        assert [r.tokens for r in single.rows] == [r.tokens for r in sharded.rows]


def test_runner_pads_batches_and_counts_only_real_prompts(random_sdar):
    model = load_model(random_sdar)
    tokenizer = load_tokenizer(random_sdar, model.config)
    eval_set = load_eval_set("toy-constraint", limit=5)
    records, outputs = run_eval(model, tokenizer, [eval_set], ["static", "static:k=4"], model_name="random",
                                batch_size=4, mesh=make_mesh(model=1), progress=False)
    assert [r.n for r in records] == [5, 5] and len(outputs) == 10
    static, whole_block = records
    assert static.tpf == pytest.approx(1.0) and whole_block.tpf > 3.0
    assert sorted(o["index"] for o in outputs if o["decoder"] == "static") == [0, 1, 2, 3, 4]
    # Same prompts, same decoder, any batch size: the same output.
    again, outputs_b8 = run_eval(model, tokenizer, [eval_set], ["static"], model_name="random", batch_size=8,
                                 progress=False)
    assert [o["tokens"] for o in outputs_b8] == [o["tokens"] for o in outputs[:5]]


def test_every_task_and_decoder_is_checked_before_the_first_decodes(random_sdar, monkeypatch):
    """A bad last decoder or a task whose prompts the model cannot hold is refused before any
    decoding, not after the runs before it."""
    import dlmjax.evaluation.runner as runner
    from dlmjax.decoding.spec import DecoderSpecError

    def decoded(*args, **kwargs):
        raise AssertionError("a decoder ran before the checks")

    monkeypatch.setattr(runner, "evaluate_decoder", decoded)
    model = load_model(random_sdar)
    tokenizer = load_tokenizer(random_sdar, model.config)
    arith = load_eval_set("toy-arith", limit=2)
    with pytest.raises(DecoderSpecError, match=r"task toy-arith, decoder threshold:tau=2: .*tau=2.0 must be in"):
        run_eval(model, tokenizer, [arith], ["static", "threshold:tau=2"], model_name="random", progress=False)
    too_long = load_eval_set("toy-arith", limit=2, max_new_tokens=4096)
    with pytest.raises(InputError, match=r"task toy-arith, decoder static: prompt \("):
        run_eval(model, tokenizer, [arith, too_long], ["static"], model_name="random", progress=False)


TIMED_RUN_COMPILES = """
import jax.monitoring
import dlmjax.evaluation.runner as runner
from dlmjax.evaluation.tasks import load_eval_set
from dlmjax.presets import load_checkpoint

compiles, starts = [], []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **_: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
make_stream = runner.task_stream

def counted(*args, **kwargs):  # each call of the stream it returns: the probe, the warm-up, the timed run
    stream = make_stream(*args, **kwargs)
    def call(**limit):
        starts.append(len(compiles))
        return stream(**limit)
    return call

runner.task_stream = counted
for name, decoder, limit in (("toy-sdar", "static", 8), ("toy-ar", "ar", 32)):  # toy-ar: batches of 10-12 tokens
    starts.clear()
    _, model, tokenizer, _ = load_checkpoint(name)
    runner.evaluate_decoder(model, tokenizer, load_eval_set("toy-arith", limit=limit), decoder, model_name=name,
                            batch_size=4)
    print(len(starts), len(compiles) - starts[-1])
"""


def test_the_timed_run_compiles_nothing():
    """`dlmjax eval`'s times exclude compilation: after the warm-up, the timed stream of the first
    decoder in a fresh process compiles nothing (a module imported inside the first trace that
    registers jax config state, as Pallas does on jax 0.12, would recompile it there); nor does
    `ar`'s, whose batches of prompts of different lengths each compiled their own width."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    out = subprocess.run([sys.executable, "-c", TIMED_RUN_COMPILES], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "0", "3", "0"], out.stdout


def test_report_table_and_front():
    assert pareto_front([(1, 90), (2, 80), (1.5, 70), (3, 10)]) == [(1, 90), (2, 80), (3, 10)]


def test_the_plots_legend_stands_beside_the_panels_however_long_its_labels(tmp_path):
    """A long label (a TSPD controller's path) ran over the panels (a fixed margin held the legend):
    the image now widens to hold the legend beside them."""
    import matplotlib.image

    def width(label):
        records = [RunRecord(task="toy-arith", decoder=d, model="m", n=2, accuracy=a, nfe=4.0, tpf=t, useful_tpf=t,
                             tokens_per_s=1.0, wall_s=1.0, mean_accepted_length=None, forwards=2, batch_tpf=1.0)
                   for d, t, a in (("static", 1.0, 0.9), (label, 3.0, 0.8))]
        return matplotlib.image.imread(pareto_plot(records, tmp_path / f"{len(label)}.png")).shape[1]

    short, long = width("tspd"), width("tspd+ce:controller=/home/someone/runs/tspd-sdar-8b/model,depth=4")
    assert long > short + 200  # about 6 px a character at this size


def test_eval_cli_end_to_end(random_sdar, tmp_path, capsys, caplog):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n{broken\n")
    out = tmp_path / "out"
    common = ["--model", str(random_sdar), "--decoder", "static", "--decoder", "threshold:tau=0.5", "--no-progress",
              "--save-outputs", "--max-new-tokens", "8", "--batch-size", "8"]
    assert main(["eval", *common, "--task", "toy-arith", "--task", "toy-constraint", "--task", "humaneval",
                 "--limit", "2", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert {(r["task"], r["decoder"]) for r in results["runs"]} == {
        (t, d) for t in ("toy-arith", "toy-constraint", "humaneval") for d in ("static", "threshold:tau=0.5")}
    settings = results["settings"]  # what the run was: the command and what it resolved to
    assert settings["command"].startswith("dlmjax eval --model ") and "--limit 2" in settings["command"]
    assert settings["checkpoint"] == str(random_sdar) and settings["decoders"] == ["static", "threshold:tau=0.5"]
    assert settings["tasks"]["toy-arith"] == {"rows": 2, "max_new_tokens": 8} and settings["batch_size"] == 8
    assert settings["mesh"]["data"] >= 1  # the numerics in force: fast here, invariant on an accelerator's suite
    assert settings["numerics"]["invariant"] is arithmetic.current().invariant
    assert settings["devices"]["platform"] == jax.devices()[0].platform and settings["versions"]["jax"] == jax.__version__
    run = results["runs"][0]
    assert set(run) >= {"task", "decoder", "model", "n", "accuracy", "nfe", "tpf", "tokens_per_s", "wall_s",
                        "forwards", "batch_tpf"}
    assert run["n"] == 2 and 0 <= run["accuracy"] <= 1 and run["nfe"] > 0
    assert run["forwards"] >= run["nfe"] and 0 < run["batch_tpf"] <= run["tpf"]
    lines = (out / "outputs.jsonl").read_text().splitlines()
    assert len(lines) == 3 * 2 * 2
    assert set(json.loads(lines[0])) >= {"decoder", "index", "tokens", "text"}
    assert (out / "pareto.png").stat().st_size > 1000
    table = capsys.readouterr().out
    assert "| toy-arith | `static` |" in table and (out / "results.md").read_text().count("\n") >= 8
    # a rerun into the same --out without --save-outputs leaves no earlier outputs beside its results,
    # and loses nothing: the earlier run's files move to out/earlier/<time>/
    earlier_results = (out / "results.json").read_text()
    assert main(["eval", "--model", str(random_sdar), "--decoder", "static", "--no-progress", "--task", "toy-arith",
                 "--limit", "1", "--max-new-tokens", "8", "--out", str(out)]) == 0
    assert not (out / "outputs.jsonl").exists() and len(json.loads((out / "results.json").read_text())["runs"]) == 1
    (moved,) = (out / "earlier").iterdir()
    assert f"moved to {moved}" in caplog.text  # the user is told where
    assert (moved / "results.json").read_text() == earlier_results and len(
        (moved / "outputs.jsonl").read_text().splitlines()) == 3 * 2 * 2
    assert sorted(p.name for p in moved.iterdir()) == ["outputs.jsonl", "pareto.png", "results.json", "results.md"]
    # where they would move is checked before decoding, not after
    (tmp_path / "filed").mkdir()
    (tmp_path / "filed" / "earlier").write_text("")
    assert main(["eval", "--model", str(random_sdar), "--decoder", "static", "--no-progress", "--task", "toy-arith",
                 "--limit", "1", "--max-new-tokens", "8", "--out", str(tmp_path / "filed")]) == 2
    assert "earlier is a file" in capsys.readouterr().err
    # a budget the model cannot hold names the task and decoder
    assert main(["eval", "--model", str(random_sdar), "--decoder", "static", "--no-progress", "--task", "toy-arith",
                 "--limit", "1", "--max-new-tokens", "4096", "--out", str(out)]) == 2
    assert "task toy-arith, decoder static: prompt (" in capsys.readouterr().err

    out2 = tmp_path / "gsm-out"
    assert main(["eval", *common, "--task", "gsm8k", "--data", str(gsm), "--out", str(out2)]) == 0
    err = capsys.readouterr().err
    assert "skipped row 2: invalid JSON" in err
    assert json.loads((out2 / "results.json").read_text())["skipped_rows"] == {"gsm8k": ["row 2: invalid JSON (Expecting property name enclosed in double quotes)"]}
    assert "gsm8k: 1 dataset row skipped (results.json's skipped_rows says which and why)" in (
        out2 / "results.md").read_text()
    assert main(["eval", "--model", str(random_sdar), "--task", "gsm8k", "--data", str(tmp_path / "nope.jsonl"),
                 "--out", str(out2)]) == 2


def test_a_dataset_without_usable_rows_is_a_clear_error(random_sdar, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{broken\n")
    assert main(["eval", "--model", str(random_sdar), "--task", "gsm8k", "--data", str(bad), "--no-progress",
                 "--out", str(tmp_path / "out")]) == 2


def test_eval_compare_to_reports_token_agreement(tmp_path, capsys):
    """`--compare-to`: PSD against its own policy agrees on every token (lossless); the whole
    block at once does not agree with one token per step."""
    out = tmp_path / "out"
    assert main(["eval", "--model", "toy-sdar", "--task", "toy-arith", "--limit", "8", "--no-progress",
                 "--batch-size", "8", "--out", str(out), "--decoder", "static:k=4",
                 "--decoder", "psd:policy=topk,k=1,depth=3", "--compare-to", "static"]) == 0
    runs = {r["decoder"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert list(runs) == ["static", "static:k=4", "psd:policy=topk,k=1,depth=3"]  # the reference runs first
    assert all(r["compared_to"] == "static" for r in runs.values())
    assert runs["static"]["identical_rows"] == runs["static"]["token_agreement"] == 1.0
    assert runs["psd:policy=topk,k=1,depth=3"]["identical_rows"] == 1.0
    assert runs["static:k=4"]["token_agreement"] < 1.0
    assert "same as `static`" in capsys.readouterr().out
    # results.md shows the accepted length where a decoder verifies drafts (it was in results.json alone)
    psd_row = next(line for line in (out / "results.md").read_text().splitlines() if "`psd:" in line)
    assert "accepted length |" in (out / "results.md").read_text()
    assert f"| {runs['psd:policy=topk,k=1,depth=3']['mean_accepted_length']:.2f} |" in psd_row
    # a decoder or task named twice runs once, and --compare-to spelt otherwise is the run it names
    assert main(["eval", "--model", "toy-sdar", "--task", "toy-arith", "--task", "toy-arith", "--limit", "2",
                 "--no-progress", "--out", str(out), "--decoder", "threshold:tau=0.9", "--decoder", "threshold",
                 "--decoder", "static", "--compare-to", "threshold:tau=0.90"]) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["decoder"] for r in runs] == ["threshold:tau=0.9", "static"]
    assert all(r["compared_to"] == "threshold:tau=0.9" for r in runs) and runs[0]["identical_rows"] == 1.0


def test_token_agreement_counts_positions_over_the_longer_generation():
    assert token_agreement([([1, 2, 3], [1, 2, 3])]) == 1.0
    assert token_agreement([([1, 2, 3, 4], [1, 9, 3])]) == 0.5
    assert token_agreement([([], [])]) == 1.0
    # over positions, not a mean of rows' shares: one differing token beside 99 agreeing is 99%, not 50%
    assert token_agreement([([1], [2]), ([1] * 99, [1] * 99)]) == 0.99


def test_compare_to_a_decoder_that_was_not_run_names_the_ones_that_were():
    outputs = [{"task": "t", "decoder": "static", "index": 0, "tokens": [1]}]
    with pytest.raises(InputError, match="was not run; name one of the decoders: \\['static'\\]"):
        compare_to([], outputs, "threshold:tau=0.9")
