"""`dlmjax eval --backend lm-eval`: lm-eval's task definitions (dlmjax.lm_eval.tasks, lm-eval's own
tasks over the data dlmjax ships) through the dlmjax lm-eval model, offline.

- gsm8k on toy-sdar (a diffusion model not trained on GSM8K: the test checks plumbing): the
  5-shot prompts are lm-eval's (shots from the shipped train split), each logged response equals
  what the native backend decodes for the same prompt, and the score equals lm-eval's
  exact_match (strict-match) computed by hand on the logged responses;
- the packaged task YAMLs load from any working directory and build lm-eval's prompts; the code
  tasks' sandboxed pass@k passes a canonical solution and fails a wrong one;
- with --chat the few-shot examples are chat turns, or one user message with
  --fewshot-as-multiturn false;
- refusals name the fix: toy tasks, code tasks without --confirm-run-unsafe-code, lm-eval-only
  flags on the native backend;
- an empty log-likelihood context is conditioned on the prefix token, as transformers scores it.
"""

import json
import re

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

import dlmjax.lm_eval  # noqa: E402,F401
from dlmjax.cli import main  # noqa: E402
from dlmjax.evaluation.runner import evaluate_decoder  # noqa: E402
from dlmjax.evaluation.tasks import EvalItem, EvalSet, load_eval_set  # noqa: E402
from dlmjax.lm_eval.tasks import DATA, TASKS, write_tasks  # noqa: E402
from dlmjax.presets import load_checkpoint, resolve_model  # noqa: E402

LIMIT = 4
MAX_GEN = 32
DECODER = "threshold:tau=0.9"
GSM8K_STOPS = ["Question:", "</s>", "<|im_end|>"]  # lm-eval's gsm8k `until`
IGNORE = [",", r"\$", r"(?s).*#### ", r"\.$"]  # its exact_match regexes_to_ignore (and ignore_case)


def exact_match_strict(response: str, target: str) -> bool:
    """lm-eval's gsm8k strict-match by hand: the first '#### N' (else '[invalid]'), then exact_match."""
    found = re.findall(r"#### (\-?[0-9\.\,]+)", response)
    pred = found[0] if found else "[invalid]"

    def norm(text):
        for pattern in IGNORE:
            text = re.sub(pattern, "", text)
        return text.lower()

    return norm(pred) == norm(target)


@pytest.fixture(scope="module")
def gsm8k_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm_eval_backend")
    rc = main(["eval", "--backend", "lm-eval", "--task", "gsm8k", "--limit", str(LIMIT), "--model", "toy-sdar",
               "--decoder", DECODER, "--decoder", DECODER + "0",  # one decoder spelled twice: it runs once
               "--max-new-tokens", str(MAX_GEN), "--batch-size", "4", "--mesh", "data=1", "--out", str(out),
               "--save-outputs", "--no-progress"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").open()]
    return out, results, outputs


def test_gsm8k_prompts_are_lm_evals_five_shot_over_the_shipped_splits(gsm8k_run):
    _, results, outputs = gsm8k_run
    assert [o["index"] for o in outputs] == list(range(LIMIT))
    assert results["backend"] == "lm-eval"
    settings = results["settings"]
    assert settings["backend"] == "lm-eval" and settings["command"].startswith("dlmjax eval --backend lm-eval")
    assert settings["decoders"] == [DECODER] and settings["tasks"] == ["gsm8k"] and settings["batch_size"] == 4
    assert results["lm_eval"][DECODER]["gsm8k"]["n_shot"] == 5
    train = {json.loads(line)["question"] for line in (DATA / "gsm8k" / "train.jsonl").open()}
    native = load_eval_set("gsm8k", limit=LIMIT).items
    for out, item in zip(outputs, native):
        blocks = re.split(r"\n\n(?=Question: )", out["prompt"])
        assert len(blocks) == 6  # 5 shots, then the problem, in lm-eval's "Question: ...\nAnswer:" form
        assert blocks[-1] == item.prompt  # the native backend's prompt for the same problem
        shots = [re.match(r"Question: (.*)\nAnswer: ", b, re.S).group(1) for b in blocks[:5]]
        assert all(q in train for q in shots)  # drawn from the shipped train split
        assert out["target"] == item.reference


def test_gsm8k_responses_equal_the_native_backend_and_the_score_is_exact_match(gsm8k_run):
    _, results, outputs = gsm8k_run
    path, model, tokenizer, _ = load_checkpoint("toy-sdar")
    room = model.config.max_position_embeddings - MAX_GEN  # the lm-eval model left-truncates as lm-eval's HF model
    items = [EvalItem(o["index"], tokenizer.encode(o["prompt"])[-room:], o["target"]) for o in outputs]
    eval_set = EvalSet("gsm8k", items, MAX_GEN, lambda batch, texts: [False] * len(texts))
    _, native = evaluate_decoder(model, tokenizer, eval_set, DECODER, model_name="toy-sdar", batch_size=4,
                                 warmup=False)
    for out, row in zip(outputs, native):
        expected = row["text"]
        for stop in GSM8K_STOPS:
            expected = expected.split(stop)[0]
        assert out["text"] == expected
    (run,) = results["runs"]
    by_hand = [exact_match_strict(o["text"], o["target"]) for o in outputs]
    assert [o["correct"] for o in outputs] == by_hand
    assert run["accuracy"] == pytest.approx(sum(by_hand) / LIMIT)
    assert run["accuracy"] == results["lm_eval"][DECODER]["gsm8k"]["results"]["exact_match,strict-match"]
    assert run["n"] == LIMIT and run["nfe"] > 0 and run["forwards"] > 0 and run["tokens_per_s"] > 0


def test_results_md_has_dlmjax_table_then_lm_evals(gsm8k_run):
    out, _, _ = gsm8k_run
    text = (out / "results.md").read_text()
    assert text.index("| gsm8k | `threshold:tau=0.9` | 4 |") < text.index("gsm8k_local")
    assert "flexible-extract" in text and (out / "pareto.png").is_file()


@pytest.mark.parametrize("multiturn, user_turns", [(None, 6), ("false", 1)])
def test_chat_few_shot_examples_are_turns_unless_turned_off(multiturn, user_turns, tmp_path):
    """--chat lays the 5 shots out as lm-eval does by default, a user and an assistant turn each;
    --fewshot-as-multiturn false puts them all in the one user message."""
    import shutil

    from dlmjax.presets import resolve_model

    model_dir = tmp_path / "toy-sdar-chat"
    shutil.copytree(resolve_model("toy-sdar"), model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    flag = ["--fewshot-as-multiturn", multiturn] if multiturn else []
    out = tmp_path / "out"
    assert main(["eval", "--backend", "lm-eval", "--task", "gsm8k", "--limit", "1", "--model", str(model_dir), "--chat",
                 *flag, "--decoder", DECODER, "--max-new-tokens", str(MAX_GEN), "--batch-size", "4", "--mesh", "data=1",
                 "--out", str(out), "--save-outputs", "--no-progress"]) == 0
    (row,) = [json.loads(line) for line in (out / "outputs.jsonl").open()]
    assert row["prompt"].count("<user>") == user_turns
    assert row["prompt"].count("</assistant>") == user_turns - 1  # the shots' answers as assistant turns
    assert row["prompt"].count("Question: ") == 6 and row["prompt"].endswith("<assistant>")


# ------------------------------------------------------------------------------ the task YAMLs


def test_packaged_tasks_load_from_any_directory_and_build_lm_evals_prompts(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(tmp_path)  # data paths are absolute: the working directory does not matter
    wanted = ["gsm8k", "humaneval", "mbpp"]
    try:
        import lm_eval.tasks.minerva_math.utils  # noqa: F401
        wanted.append("math500")
    except ImportError:
        pass
    include = write_tasks(tmp_path / "tasks", wanted)
    gsm8k_lines = (include / TASKS["gsm8k"][1]).read_text().splitlines()
    assert any(line.startswith("# @DATA@ is replaced") for line in gsm8k_lines)  # the comment says what it was
    assert not any("@" in line for line in gsm8k_lines if not line.startswith("#"))
    manager = TaskManager(include_path=str(include), include_defaults=False)
    loaded = manager.load([TASKS[t][0] for t in wanted])["tasks"]
    prompts = {}
    for task in wanted:
        obj = loaded[TASKS[task][0]]
        obj.build_all_requests(limit=1, rank=0, world_size=1)
        prompts[task] = obj.instances[0].args[0]
    assert prompts["gsm8k"].endswith(load_eval_set("gsm8k", limit=1).items[0].prompt)
    assert prompts["gsm8k"].count("Question:") == 6
    assert prompts["humaneval"] == load_eval_set("humaneval", limit=1).items[0].prompt  # 0-shot: the header
    mbpp = prompts["mbpp"]
    assert mbpp.count("[BEGIN]\n") == 4 and mbpp.count("[DONE]") == 3 and mbpp.endswith("[BEGIN]\n")
    assert "similar_elements" in mbpp and "is_not_prime" in mbpp and "heap_queue_largest" in mbpp  # ids 2, 3, 4
    if "math500" in prompts:
        assert prompts["math500"].startswith("Problem:\n") and prompts["math500"].endswith("\n\nSolution:")
        assert prompts["math500"].count("Problem:") == 5  # 4 Minerva shots


# the packaged functions that stand for lm-eval's own (same name in lm-eval's utils.py)
SAME_FUNCTION = {"minerva_doc_to_text": "doc_to_text", "minerva_process_docs": "process_docs",
                 "minerva_process_results": "process_results", "minerva_fewshot_samples": "list_fewshot_samples",
                 "mbpp_fewshot_samples": "list_fewshot_samples"}
DATA_KEYS = {"task", "tag", "dataset_path", "dataset_name", "dataset_kwargs"}


@pytest.mark.parametrize("task, theirs", [("gsm8k", "gsm8k/gsm8k.yaml"), ("humaneval", "humaneval/humaneval.yaml"),
                                          ("mbpp", "mbpp/mbpp.yaml"),
                                          ("math500", "minerva_math/minerva_math500.yaml")])
def test_packaged_yaml_is_lm_evals_task_but_for_the_data(task, theirs):
    """Every key of the packaged YAML equals the one of lm-eval's installed task (includes
    resolved), functions compared by name, except the task name, its tag and the data source."""
    from pathlib import Path

    from lm_eval.tasks._yaml_loader import load_yaml

    def named(value):
        if isinstance(value, dict):
            return {k: named(v) for k, v in value.items()}
        if isinstance(value, list):
            return [named(v) for v in value]
        if isinstance(value, str) and "utils." in value:  # an unresolved `!function utils.NAME`
            name = value.rsplit(".", 1)[-1]
            return "function " + SAME_FUNCTION.get(name, name)
        return value

    ours = named(load_yaml(Path(dlmjax.lm_eval.__file__).parent / "tasks" / TASKS[task][1], resolve_func=False))
    lm = named(load_yaml(Path(lm_eval.__file__).parent / "tasks" / theirs, resolve_func=False))
    for key in sorted((set(ours) | set(lm)) - DATA_KEYS):
        assert ours.get(key) == lm.get(key), key
    assert ours["dataset_path"] == "json" and ours["task"] == TASKS[task][0]


def test_checkout_yaml_is_the_packaged_gsm8k_task(tmp_path, monkeypatch):
    """eval/lm_eval_tasks/gsm8k_local.yaml (paths relative to the checkout's root) builds the same
    5-shot prompts as the packaged task written with absolute paths."""
    from pathlib import Path

    from lm_eval.tasks import TaskManager

    def first_prompts(include):
        task = TaskManager(include_path=str(include), include_defaults=False).load(["gsm8k_local"])["tasks"]
        task = task["gsm8k_local"]
        task.set_fewshot_seed(1234)  # what simple_evaluate does (its fewshot_random_seed)
        task.build_all_requests(limit=2, rank=0, world_size=1)
        return [inst.args[0] for inst in task.instances]

    packaged = first_prompts(write_tasks(tmp_path / "tasks", ["gsm8k"]))
    monkeypatch.chdir(Path(__file__).parent.parent)
    assert first_prompts("eval/lm_eval_tasks") == packaged


def test_code_pass_at_k_runs_in_the_sandbox():
    from dlmjax.lm_eval.tasks import utils

    problem = load_eval_set("humaneval", limit=1).items[0].reference
    reference = f"{problem['test']}\ncheck({problem['entry_point']})"
    right = utils.build_predictions([[problem["canonical_solution"]]], [problem])
    wrong = utils.build_predictions([["    return not True\n"]], [problem])
    assert utils.pass_at_k([reference], right, [1]) == {"pass@1": 1.0}
    assert utils.pass_at_k([reference], wrong, [1]) == {"pass@1": 0.0}
    both = [right[0] + wrong[0]]
    assert utils.pass_at_k([reference], both, [1, 2]) == {"pass@1": 0.5, "pass@2": 1.0}
    # a problem with fewer samples than K counted as failed (HF code_eval reports no pass@K then)
    with pytest.raises(ValueError, match=r"pass@2 needs at least 2 samples of every problem, and one has 1: raise "):
        utils.pass_at_k([reference, reference], [both[0], right[0]], [1, 2])
    mbpp = load_eval_set("mbpp", limit=1).items[0].reference
    assert utils.pass_at_1("\n".join(mbpp["test_list"]), mbpp["code"]) == 1.0
    assert [s["task_id"] for s in utils.mbpp_fewshot_samples()] == [2, 3, 4]


def test_code_tasks_run_with_the_flag_and_score_pass_at_1_by_hand(tmp_path):
    """humaneval and mbpp on toy-ar (plumbing: the toy model writes no Python): with
    --confirm-run-unsafe-code they run, the humaneval program is prompt + response (lm-eval's
    create_test filter), and each score equals the sandboxed pass@1 of the logged program."""
    from dlmjax.lm_eval.tasks import utils

    rc = main(["eval", "--backend", "lm-eval", "--model", "toy-ar", "--decoder", "ar", "--task", "humaneval", "--task",
               "mbpp", "--confirm-run-unsafe-code", "--limit", "2", "--max-new-tokens", "8", "--mesh", "data=1",
               "--batch-size", "2", "--out", str(tmp_path), "--save-outputs", "--no-progress"])
    assert rc == 0
    outputs = [json.loads(line) for line in (tmp_path / "outputs.jsonl").open()]
    assert [(o["task"], o["index"]) for o in outputs] == [("humaneval", 0), ("humaneval", 1), ("mbpp", 0), ("mbpp", 1)]
    problems = load_eval_set("humaneval", limit=2).items
    for out in outputs:
        if out["task"] == "humaneval":
            program = problems[out["index"]].reference["prompt"] + out["text"]
            assert out["filtered"] == [[program]]  # one doc, one sample
            assert out["score"] == utils.pass_at_k([out["target"]], [[program]], [1])["pass@1"]
        else:
            assert out["score"] == utils.pass_at_1(out["target"], out["text"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert {r["task"]: r["n"] for r in results["runs"]} == {"humaneval": 2, "mbpp": 2}


# ---------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("argv, message", [
    ([], r"--backend lm-eval runs the tasks named with --task: gsm8k, humaneval, mbpp, math500"),
    (["--task", "toy-arith"], r"toy-arith is dlmjax's own generated task.*drop --backend lm-eval.*gsm8k"),
    (["--task", "humaneval"], r"humaneval runs the generated code.*--confirm-run-unsafe-code"),
    (["--task", "gsm8k", "--task", "mbpp"], r"mbpp runs the generated code.*--confirm-run-unsafe-code"),
    (["--task", "gsm8k", "--data", "x.jsonl"], r"--data feeds the native backend"),
    (["--task", "gsm8k", "--strict-data"], r"--strict-data feeds the native backend"),
    (["--task", "nope"], r"unknown task 'nope' for --backend lm-eval; tasks: gsm8k, humaneval, mbpp, math500"),
    (["--task", "gsm8k", "--compare-to", "static"], r"--compare-to.*drop --backend lm-eval"),
    (["--task", "gsm8k", "--fewshot-as-multiturn", "false"], r"--fewshot-as-multiturn.*add --chat"),
    # every decoder is checked before the first one's run (a typo in the second used to cost the first's run)
    (["--task", "gsm8k", "--limit", "1", "--decoder", "static", "--decoder", "treshold"], r"unknown decoder 'treshold'"),
    # and what the decoder cannot do on the model (the block's fit): the first decoder ran every task before
    (["--task", "gsm8k", "--limit", "1", "--decoder", "static", "--decoder", "psd:policy=threshold,tau=0.9,depth=40"],
     r"psd: depth=40 cannot fit a block of 8 tokens"),
])
def test_lm_eval_backend_refusals_name_the_fix(argv, message, capsys, tmp_path):
    assert main(["eval", "--backend", "lm-eval", "--out", str(tmp_path), *argv]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_settings_name_the_head_the_decoders_read_also_the_models_own(tmp_path):
    """As the native backend: the MRP head a decoder read is recorded where it was found (toy-sdar
    holds its own), and none where no decoder reads it."""
    settings = {}
    for decoder in ("mrp-direct", "static"):
        out = tmp_path / decoder
        assert main(["eval", "--backend", "lm-eval", "--task", "gsm8k", "--limit", "1", "--model", "toy-sdar",
                     "--decoder", decoder, "--max-new-tokens", "8", "--out", str(out), "--no-progress"]) == 0
        settings[decoder] = json.loads((out / "results.json").read_text())["settings"]
    assert settings["mrp-direct"]["mrp_head"] == str(resolve_model("toy-sdar"))
    assert settings["static"]["mrp_head"] is None and settings["static"]["drafter"] is None


def test_the_backend_without_lm_eval_installed_is_one_line_naming_the_install(tmp_path):
    """As `dlmjax lm-eval` says it: not a traceback calling itself a dlmjax bug."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import sys; sys.modules['lm_eval'] = None\n"  # as if lm-eval were not installed
              "from dlmjax.cli import main\n"
              f"sys.exit(main(['eval', '--backend', 'lm-eval', '--task', 'gsm8k', '--out', {str(tmp_path)!r}]))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parents[1])
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("dlmjax eval: error:") and "pip install 'dlmjax[lm-eval]'" in run.stderr
    assert "Traceback" not in run.stderr


def test_code_tasks_with_chat_warn_that_lm_eval_runs_the_raw_response(capsys):
    from argparse import Namespace

    from dlmjax.lm_eval.backend import check_backend_args

    args = Namespace(data=None, strict_data=False, fewshot_as_multiturn=None, compare_to=None,
                     confirm_run_unsafe_code=True, chat=True)
    check_backend_args(args, ["gsm8k", "mbpp"])
    assert "lm-eval's mbpp runs the raw response as code" in capsys.readouterr().err
    check_backend_args(Namespace(**{**vars(args), "chat": False}), ["gsm8k", "mbpp"])
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--num-fewshot", "5"], ["--fewshot-as-multiturn", "false"],
                                  ["--confirm-run-unsafe-code"]])
def test_lm_eval_flags_on_the_native_backend_are_refused(flag, capsys, tmp_path):
    assert main(["eval", "--task", "toy-arith", "--out", str(tmp_path), *flag]) == 2
    assert f"{flag[0]} applies to --backend lm-eval" in capsys.readouterr().err


# ------------------------------------------------------------------ empty log-likelihood context


def test_empty_context_is_conditioned_on_the_prefix_token_as_transformers(tmp_path):
    """A tiny random Llama: causal_logprobs of ([], continuation) with prefix P equals transformers'
    log-probs of the continuation after [P]; without a prefix it is refused."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_models import torch_model

    import dlmjax
    from dlmjax.lm_eval.likelihood import causal_logprobs

    hf = torch_model("llama", seed=4)
    hf.save_pretrained(tmp_path)
    model = dlmjax.load_model(tmp_path)
    prefix, cont = 1, [17, 5, 60, 33, 8]
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([[prefix] + cont])).logits[0].double(), -1)
    rows = logp[:-1]
    want = float(rows.gather(1, torch.tensor(cont)[:, None]).sum())
    greedy = bool((rows.argmax(-1) == torch.tensor(cont)).all())
    (got,) = causal_logprobs(model, [([], cont)], prefix_id=prefix, batch_size=2)
    (same,) = causal_logprobs(model, [([prefix], cont)], batch_size=2)
    assert got == same
    assert got[0] == pytest.approx(want, abs=1e-4) and got[1] == greedy
    with pytest.raises(ValueError, match="pass prefix_id"):
        causal_logprobs(model, [([], cont)])


def test_causal_logprobs_make_logits_for_the_continuations_only(tmp_path, monkeypatch):
    """A long context with a short continuation beside a short context with a long one (its
    window reaches back before the context's end): each sum and is_greedy equals transformers',
    and the compiled scorer holds no vocabulary-wide array with more rows than batch x the
    continuations' window (16), where the whole rows' logits would have batch x 64."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hlo import first_program, logits_rows
    from tiny_models import torch_model

    import dlmjax
    from dlmjax.lm_eval import likelihood

    hf = torch_model("llama", seed=4)
    hf.save_pretrained(tmp_path)
    model = dlmjax.load_model(tmp_path)
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(1, 90, 60).tolist(), [17, 5]),
             (rng.integers(1, 90, 3).tolist(), rng.integers(1, 90, 12).tolist())]
    got = []
    with dlmjax.numerics(row_tile=16):  # the invariant mode (on an accelerator) makes whole tiles of rows
        hlo, _, _ = first_program(monkeypatch, likelihood, "_next_token_scores",
                                  lambda: got.extend(likelihood.causal_logprobs(model, pairs, batch_size=2)))
    for (ctx, cont), (logprob, greedy) in zip(pairs, got):
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ctx + cont])).logits[0].double(), -1)[len(ctx) - 1 : -1]
        assert logprob == pytest.approx(float(logp.gather(1, torch.tensor(cont)[:, None]).sum()), abs=1e-4)
        assert greedy == bool((logp.argmax(-1) == torch.tensor(cont)).all())
    made = logits_rows(hlo, model.config)
    assert made and max(made) <= 2 * 16, made


def test_lm_model_scores_an_empty_context_after_its_prefix_token():
    from dlmjax.lm_eval import DlmjaxLM

    lm = DlmjaxLM(pretrained="toy-ar", batch_size=2, mesh_data=1, warmup=False)
    cont = lm.tok_encode("3+4=7")
    empty, prefixed = lm._loglikelihood_tokens([(None, [], cont), (None, [lm.prefix_token_id], cont)])
    assert np.isfinite(empty[0]) and empty == prefixed


def test_drafter_prompts_leave_room_for_the_drafter_block():
    """A drafter decodes a block beyond prompt + budget: a long context is cut to leave it room
    (toy-ar and its shipped DFlash drafter, model length 256, block 8)."""
    from dlmjax.lm_eval import DlmjaxLM

    lm = DlmjaxLM(pretrained="toy-ar", decoder="drafter", batch_size=2, mesh_data=1, warmup=False)
    block = lm.drafter.config.block_size
    ids = lm._prompt_ids("1+2\n" * 200, 8)
    assert len(ids) == lm.max_length - 8 - block
    lm.use_decoder("ar")
    assert len(lm._prompt_ids("1+2\n" * 200, 8)) == lm.max_length - 8


def test_bidirectional_prompts_leave_room_for_whole_blocks():
    """A bidirectional model decodes whole blocks after the prompt: a long context is cut so that
    they fit (a budget of 20 in blocks of 32 takes 32 positions), and the request decodes rather
    than being refused as reaching past the model's length."""
    from lm_eval.api.instance import Instance

    from dlmjax.lm_eval import DlmjaxLM, RequestError

    lm = DlmjaxLM(pretrained="random-llada-moe", batch_size=1, mesh_data=1, warmup=False)
    assert len(lm._prompt_ids("1+2=3\n" * 200, 20)) == lm.max_length - 32
    with pytest.raises(RequestError, match=f"max_gen_toks needs {lm.max_length - 1} tokens \\(\\+ 1 for whole blocks\\)"):
        lm._prompt_ids("1+2=3", lm.max_length - 1)
    request = Instance("generate_until", {}, ("1+2=3\n" * 200, {"until": ["\n\n"], "max_gen_toks": 20}), 0,
                       ("task_x", 3, 1))
    assert isinstance(lm.generate_until([request])[0], str)


@pytest.mark.devices(8)
def test_lm_model_on_an_expert_mesh_equals_one_device(tmp_path, monkeypatch):
    """mesh_expert / mesh_fsdp / expert_dispatch (what `--mesh` and `--expert-dispatch` pass from
    `dlmjax eval --backend lm-eval`): an MoE model's experts split over 'expert' and its params over
    'fsdp' generate one device's responses."""
    from lm_eval.api.instance import Instance

    from dlmjax.lm_eval import DlmjaxLM
    from dlmjax.lm_eval.model import ModelArgsError

    monkeypatch.setenv("DLMJAX_CACHE", str(tmp_path))
    requests = [Instance("generate_until", {}, (context, {"until": ["\n\n"], "max_gen_toks": 8}), i, ("t", i, 1))
                for i, context in enumerate(["ab", "cd"])]

    def responses(**mesh):
        lm = DlmjaxLM(pretrained="random-sdar-moe", decoder="threshold:tau=0.9", batch_size=2, warmup=False, **mesh)
        return lm.generate_until(requests), lm

    single, _ = responses(mesh_data=1)
    split, lm = responses(mesh_data=2, mesh_expert=4, expert_dispatch="all_to_all")
    assert split == single and lm.mesh.shape["expert"] == 4
    assert responses(mesh_data=2, mesh_fsdp=2, mesh_model=2)[0] == single
    with pytest.raises(ModelArgsError, match="expert_dispatch='ragged': choose one of auto, all_to_all"):
        DlmjaxLM(pretrained="random-sdar-moe", mesh_data=1, expert_dispatch="ragged")
    with pytest.raises(ModelArgsError, match="expert_dispatch=gather would be ignored: without an expert axis every "
                                             "device holds all 8 experts .* split them with mesh_expert=N"):
        DlmjaxLM(pretrained="random-sdar-moe", mesh_data=1, expert_dispatch="gather")
