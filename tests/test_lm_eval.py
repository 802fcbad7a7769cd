"""dlmjax as an lm-evaluation-harness model (`dlmjax.lm_eval`), offline: lm-eval's tasks read a
local jsonl through a task YAML (`dataset_path: json`), never the Hub.

- toy-sdar through `simple_evaluate` and toy-ar through `dlmjax lm-eval` (lm-eval's own CLI):
  every logged response equals `generate` on the same prompt and decoder, cut at the same stop
  string, and each score equals the count of correct answers made by hand;
- log-likelihoods: causal ones equal transformers' (SmolLM2-135M); the diffusion Monte Carlo
  estimate is reproducible and its mean approaches the exactly enumerated bound;
- malformed requests and model_args are refused with errors that name the fix.
"""

import itertools
import json
import math
from functools import partial
import re

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

import dlmjax.lm_eval  # noqa: E402,F401  (registers the model `dlmjax`)
from dlmjax.decoding.api import generate  # noqa: E402
from dlmjax.decoding.spec import decoder_spec, parse_decoder  # noqa: E402
from dlmjax.evaluation.tasks import load_eval_set  # noqa: E402
from dlmjax.decoding.spec import DecoderSpecError  # noqa: E402
from dlmjax.lm_eval import DlmjaxLM, ModelArgsError, RequestError  # noqa: E402
from dlmjax.lm_eval.model import parse_generation_request  # noqa: E402
from dlmjax.lm_eval.likelihood import continuation_groups, masked_diffusion_bound, masked_logprobs  # noqa: E402
from dlmjax.presets import load_checkpoint  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from tiny_models import compiled_forward  # noqa: E402

LIMIT = 8
MAX_GEN = 48
TASKS = ("toy_arith_final", "toy_arith_first_line")

# The task YAMLs a user writes for local data (README: lm-eval with local data).
FINAL_YAML = """task: toy_arith_final
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {max_gen}
filter_list:
  - name: final
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
FIRST_LINE_YAML = """task: toy_arith_first_line
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{first_line}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen}
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def toy_items():
    return load_eval_set("toy-arith", limit=LIMIT).items


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, toy_items):
    """toy-arith's eval prompts as jsonl, and two task YAMLs over it."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    data = root / "toy-arith.jsonl"
    with data.open("w") as f:
        for item in toy_items:
            example = item.reference
            f.write(json.dumps({"prompt": item.prompt, "answer": str(example.meta["answer"]),
                                "first_line": example.target.split("\n")[0]}) + "\n")
    (root / "final.yaml").write_text(FINAL_YAML.format(data=data, max_gen=MAX_GEN))
    (root / "first_line.yaml").write_text(FIRST_LINE_YAML.format(data=data, max_gen=MAX_GEN))
    return root


def hand_counts(texts, toy_items):
    """Correct answers counted by hand: the number after the first '#### ' equals the answer;
    the first line equals the reference's first line."""
    final = sum(bool(m) and m.group(1) == str(item.reference.meta["answer"])
                for m, item in ((re.search(r"#### (-?\d+)", t), item) for t, item in zip(texts, toy_items)))
    first = sum(t.split("\n")[0] == item.reference.target.split("\n")[0] for t, item in zip(texts, toy_items))
    return {"toy_arith_final": final, "toy_arith_first_line": first}


def check_against_generate(model_name, decoder, samples, results, toy_items):
    """Logged responses equal `generate` cut at each task's stop string; scores equal hand counts."""
    _, model, tokenizer, _ = load_checkpoint(model_name)
    prompts = [item.prompt for item in toy_items]
    texts = [row.text for row in generate(model, prompts, tokenizer=tokenizer, decoder=decoder,
                                          max_new_tokens=MAX_GEN).rows]
    stops = {"toy_arith_final": "\n\n", "toy_arith_first_line": "\n"}
    for task in TASKS:
        logged = sorted(samples[task], key=lambda s: s["doc_id"])
        assert [s["doc"]["prompt"] for s in logged] == prompts
        assert [s["resps"][0][0] for s in logged] == [t.split(stops[task])[0] for t in texts]
    counts = hand_counts(texts, toy_items)
    assert counts["toy_arith_first_line"] > 0 and counts["toy_arith_final"] > 0  # the toy models are trained
    for task in TASKS:
        metric = "exact_match,final" if task == "toy_arith_final" else "exact_match,none"
        assert round(results[task][metric] * LIMIT) == counts[task]
    # dlmjax's own toy scorer agrees with lm-eval's regex filter on these generations
    scorer = load_eval_set("toy-arith", limit=LIMIT)
    assert sum(scorer.score(toy_items, texts)) == counts["toy_arith_final"]
    return texts


def test_toy_sdar_simple_evaluate_equals_generate(task_dir, toy_items, monkeypatch):
    import dlmjax.decoding.api as api

    monkeypatch.setattr(api, "STOP_CHECK_FORWARDS", 1)  # the toy rows are short: look at them every forward
    decoder = "threshold:tau=0.9"
    out = lm_eval.simple_evaluate(
        model="dlmjax", model_args=f"pretrained=toy-sdar,decoder={decoder},batch_size=4,mesh_data=1,warmup=False",
        tasks=list(TASKS), limit=LIMIT, log_samples=True,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
    check_against_generate("toy-sdar", decoder, out["samples"], out["results"], toy_items)
    metrics = out["config"]["decoding_metrics"]
    assert set(metrics) == set(TASKS)
    for m in metrics.values():
        assert m["n"] == LIMIT and m["nfe"] > 0 and m["tpf"] > 1.0 and m["forwards"] > 0 and m["tokens_per_s"] > 0
        assert m["mean_accepted_length"] is None  # threshold verifies no drafts
    # the same prompts: the first line's rows stop at a block boundary past their first "\n" (once
    # the cut is settled: `cut_is_settled`)
    assert metrics["toy_arith_first_line"]["nfe"] < metrics["toy_arith_final"]["nfe"]
    assert out["config"]["decoder"] == decoder_spec(parse_decoder(decoder))


def test_toy_ar_through_dlmjax_lm_eval_cli(task_dir, toy_items, tmp_path, capsys):
    from dlmjax.cli import main

    out_dir = tmp_path / "out"
    rc = main(["lm-eval", "--model", "dlmjax", "--model_args", "pretrained=toy-ar,batch_size=4,mesh_data=1,warmup=False",
               "--tasks", ",".join(TASKS), "--include_path", str(task_dir), "--limit", str(LIMIT), "--log_samples",
               "--output_path", str(out_dir)])
    assert rc == 0
    printed = capsys.readouterr().out
    results_file = next(out_dir.rglob("results_*.json"))
    saved = json.loads(results_file.read_text())
    samples = {task: [json.loads(line) for line in next(out_dir.rglob(f"samples_{task}_*.jsonl")).open()]
               for task in TASKS}
    check_against_generate("toy-ar", "ar", samples, saved["results"], toy_items)
    metrics = saved["config"]["decoding_metrics"]
    assert {m["tpf"] for m in metrics.values()} == {1.0}  # one token per forward
    # lm-eval's table, then ours with a row per task
    assert printed.index("exact_match") < printed.index("dlmjax decoding metrics")
    assert all(re.search(rf"^\| {task} \| {LIMIT} \|", printed, re.M) for task in TASKS)


# ---------------------------------------------------------------------------------------- requests


@pytest.fixture(scope="module")
def toy_ar_lm():
    return DlmjaxLM(pretrained="toy-ar", batch_size=4, mesh_data=1, warmup=False)


def request(context, gen_kwargs, kind="generate_until"):
    return Instance(kind, {}, (context, gen_kwargs), 0, ("task_x", 3, 1))


def test_malformed_requests_are_refused(toy_ar_lm):
    with pytest.raises(RequestError, match=r"request 0 \(task task_x, doc 3\): the context is empty"):
        toy_ar_lm.generate_until([request("", {"until": ["\n"]})])
    with pytest.raises(RequestError, match=r"`until` must be a list of stop strings.*got 5"):
        toy_ar_lm.generate_until([request("1+2\n", {"until": 5})])
    with pytest.raises(RequestError, match=r"`until` must be a list"):
        toy_ar_lm.generate_until([request("1+2\n", {"until": ["\n", None]})])
    with pytest.raises(RequestError, match="generation kwargs must be a dict"):
        toy_ar_lm.generate_until([request("1+2\n", "until=\n")])
    with pytest.raises(RequestError, match="max_gen_toks=0 must be a positive integer"):
        toy_ar_lm.generate_until([request("1+2\n", {"max_gen_toks": 0})])
    # lm-eval's own reading of the fields: None is absent, max_completion_tokens is a budget too
    assert parse_generation_request(0, request("1+2\n", {"until": None, "max_gen_toks": None}), 7).until == []
    assert parse_generation_request(0, request("1+2\n", {"until": None}), 7).max_gen_toks == 7
    assert parse_generation_request(0, request("1+2\n", {"max_completion_tokens": 5}), 7).max_gen_toks == 5
    assert parse_generation_request(0, request("1+2\n", {"max_new_tokens": None, "max_tokens": 3}), 7).max_gen_toks == 3
    assert parse_generation_request(0, request("1+2\n", {"max_gen_toks": 5.0}), 7).max_gen_toks == 5  # as int() reads it
    for bad in (True, 2.5):
        with pytest.raises(RequestError, match=f"max_gen_toks={bad!r} must be a positive integer"):
            parse_generation_request(0, request("1+2\n", {"max_gen_toks": bad}), 7)
    # an empty continuation is the log-likelihood of no tokens, as lm-eval's HF model scores it
    assert toy_ar_lm.loglikelihood([request("1+2", "", kind="loglikelihood"),
                                    request("1+2=", "3", kind="loglikelihood")])[0] == (0.0, True)


def test_sampling_requests_read_as_lm_eval_reads_them_and_unmet_ones_are_said_once_per_task(toy_ar_lm, caplog):
    """lm-eval samples where do_sample is set, else where temperature > 0; a greedy decoder given
    such a task (every pass@k repeat alike), or gen_kwargs dlmjax does not apply, is said once per
    task, not once per request (it said nothing for {"temperature": 0.7} or {"do_sample": True})."""
    def sampling(kwargs):
        return parse_generation_request(0, request("1+2\n", kwargs), 7).sampling

    assert sampling({"temperature": 0.7}) and sampling({"do_sample": True})
    assert not sampling({"do_sample": False, "temperature": 0.7}) and not sampling({"temperature": 0.0})
    assert not sampling({})
    with pytest.raises(RequestError, match="temperature='hot' must be a number"):
        sampling({"temperature": "hot"})
    asks = [request("1+2\n", {"until": ["\n"], "max_gen_toks": 4, "temperature": 0.7, "top_k": 5})] * 3
    with caplog.at_level("WARNING", logger="dlmjax.lm_eval.model"):
        toy_ar_lm.generate_until(asks)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [w for w in warnings if "asks for sampling" in w] == [
        "task task_x asks for sampling (do_sample, or temperature > 0); the decoder ar is greedy (dlmjax samples as "
        "its decoder spec says: set temperature=T, top_p=P in model_args decoder=, or 0 for greedy)"]
    assert [w for w in warnings if "not applied" in w] == [
        "task task_x: gen_kwargs top_k are not applied (the decoder spec says how to sample)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="dlmjax.lm_eval.model"):
        toy_ar_lm.generate_until([request("1+2\n", {"until": ["\n"], "max_gen_toks": 4, "do_sample": False})])
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # greedy asked, greedy decoded


def test_progress_false_hides_dlmjaxs_bars(toy_ar_lm, capsys):
    """`dlmjax eval --backend lm-eval --no-progress` passes progress=false: no dlmjax bar."""
    prompt = [request("1+2\n", {"until": ["\n"], "max_gen_toks": 4})]
    toy_ar_lm.generate_until(prompt)
    assert "dlmjax generate_until" in capsys.readouterr().err
    toy_ar_lm.progress = False
    try:
        toy_ar_lm.generate_until(prompt)
    finally:
        toy_ar_lm.progress = True
    assert "dlmjax generate_until" not in capsys.readouterr().err
    assert DlmjaxLM.create_from_arg_string("pretrained=toy-ar,progress=false,mesh_data=1,warmup=false").progress is False


def test_sampled_responses_depend_on_the_request_alone_and_repeats_differ():
    """A sampling decoder's stream per request is keyed by the request (task, document, index,
    repeat), not by its place in lm-eval's combined list: a task's samples are the same whichever
    tasks share the run, and lm-eval's repeats of one request (pass@k) are different samples."""
    lm = DlmjaxLM(pretrained="toy-sdar", decoder="static:temperature=50", batch_size=4, mesh_data=1, warmup=False)

    def requests(task, prompts):
        return [Instance("generate_until", {}, (p, {"until": ["\n\n"], "max_gen_toks": 16}), 0, (task, doc, 1))
                for doc, p in enumerate(prompts)]

    a, b = requests("task_a", ["12+7\n", "3+4\n"]), requests("task_b", ["9-2\n", "5+5\n"])
    alone = lm.generate_until(a)
    assert lm.generate_until(b + a)[2:] == alone
    repeated = lm.generate_until([a[0], a[0]])
    assert repeated[0] == alone[0] and repeated[1] != repeated[0]


def test_requests_without_stop_strings_decode_without_looking_at_the_rows(monkeypatch):
    """A stop makes the stream hand its rows to the host every few forwards; with no stop string
    in a task's requests there is nothing to look for, and the stream runs without one."""
    import dlmjax.lm_eval.model as lm_model

    made = []
    real = lm_model.Stream
    monkeypatch.setattr(lm_model, "Stream", lambda *a, **kw: made.append(kw["stop"]) or real(*a, **kw))
    lm = DlmjaxLM(pretrained="toy-sdar", batch_size=4, mesh_data=1, warmup=False)
    for until, stops in (([], False), (["", ""], False), (["\n"], True)):
        made.clear()
        lm.generate_until([Instance("generate_until", {}, ("12+7\n", {"until": until, "max_gen_toks": 8}), 0,
                                    ("t", 0, 1))])
        assert [stop is not None for stop in made] == [stops], until


def test_unknown_model_args_name_the_accepted_keys():
    with pytest.raises(ModelArgsError, match=r"key 'gen_length' unknown; accepted: pretrained, decoder, max_new_tokens"):
        DlmjaxLM.create_from_arg_string("pretrained=toy-ar,gen_length=256")
    # a decoder's own commas split model_args: the error says to use ';'
    with pytest.raises(ModelArgsError, match=r"separated by ';'"):
        DlmjaxLM.create_from_arg_string("pretrained=toy-sdar,decoder=psd:policy=threshold,tau=0.9")
    with pytest.raises(ModelArgsError, match="needs pretrained="):
        DlmjaxLM.create_from_arg_string("decoder=ar")
    with pytest.raises(ModelArgsError, match=r"decoder='static' does not fit this causal"):
        DlmjaxLM(pretrained="toy-ar", decoder="static", mesh_data=1)
    # what the decoder cannot do on the model is refused as the model is set up, not as a task decodes
    with pytest.raises(DecoderSpecError, match=r"mrp-spec: drafts=9 cannot fit a block of 8"):
        DlmjaxLM(pretrained="toy-sdar", decoder="mrp-spec:drafts=9", mesh_data=1)
    with pytest.raises(DecoderSpecError, match=r"block=4: a block-causal model decodes in its own block size 8"):
        DlmjaxLM(pretrained="toy-sdar", decoder="static:block=4", mesh_data=1)
    # lm-eval's CLI turns "true" into True, which int() would read as 1
    with pytest.raises(ModelArgsError, match=r"batch_size=True must be an integer >= 1"):
        DlmjaxLM.create_from_arg_string("pretrained=toy-ar,batch_size=true")


def test_model_args_typos_are_refused_before_the_weights_load(monkeypatch):
    """Loading a large checkpoint takes minutes: a misspelt decoder, dispatch or head directory is
    refused first."""
    def no_loading(*args, **kwargs):
        raise AssertionError("the weights were loaded before the model_args were checked")

    monkeypatch.setattr("dlmjax.io.hf.load_model", no_loading)
    with pytest.raises(DecoderSpecError, match="unknown decoder 'thresold'"):
        DlmjaxLM(pretrained="toy-sdar", decoder="thresold", mesh_data=1)
    with pytest.raises(ModelArgsError, match="expert_dispatch='all2all': choose one of"):
        DlmjaxLM(pretrained="toy-sdar", expert_dispatch="all2all", mesh_data=1)
    with pytest.raises(FileNotFoundError, match="mrp_head= .no/such/dir. is neither a checkpoint directory"):
        DlmjaxLM(pretrained="toy-sdar", mrp_head="no/such/dir", mesh_data=1)


def test_without_a_decoder_each_model_takes_its_own_default(monkeypatch, tmp_path):
    """As `dlmjax generate` does: ar for a causal model, static for a diffusion model, and
    fast-dllm-v2 for Fast-dLLM v2 (the only decoder its shifted block-causal logits fit), which then
    answers a generate_until request."""
    monkeypatch.setenv("DLMJAX_CACHE", str(tmp_path))  # where the random preset is written
    names = {}
    for pretrained in ("toy-ar", "toy-sdar", "random-fast-dllm-v2"):
        lm = DlmjaxLM(pretrained=pretrained, batch_size=2, mesh_data=1, warmup=False, max_new_tokens=8)
        names[pretrained] = lm.decoder.name
    assert names == {"toy-ar": "ar", "toy-sdar": "static", "random-fast-dllm-v2": "fast-dllm-v2"}
    (text,) = lm.generate_until([request("Hello", {"until": ["\n\n"], "max_gen_toks": 8})])
    assert isinstance(text, str)


def test_semicolons_separate_decoder_options_and_model_args_win_over_cli_batch_size():
    lm = DlmjaxLM.create_from_arg_string("pretrained=toy-sdar,decoder=psd:policy=threshold;tau=0.8;depth=3,"
                                         "batch_size=8,mesh_data=1", {"batch_size": 1, "device": None})
    assert (lm.decoder.name, lm.decoder.tau, lm.decoder.depth, lm.batch_size) == ("psd", 0.8, 3, 8)


@pytest.mark.devices(8)
def test_lm_evals_default_batch_size_leaves_dlmjaxs_and_a_batch_is_spread_over_the_devices():
    """lm-eval's CLI passes --batch_size 1 unless told otherwise: that leaves dlmjax's 16 decoding
    slots (outputs do not depend on them); a batch size that does not divide over the 8 devices
    is rounded up, as `dlmjax eval` rounds it, instead of stopping the run."""
    cli = {"batch_size": 1, "max_batch_size": None, "device": None}
    assert DlmjaxLM.create_from_arg_string("pretrained=toy-ar,warmup=False", cli).batch_size == 16
    assert DlmjaxLM.create_from_arg_string("pretrained=toy-ar", {**cli, "batch_size": 12}).batch_size == 16
    assert DlmjaxLM.create_from_arg_string("pretrained=toy-ar,batch_size=8", cli).batch_size == 8


def test_stop_strings_that_are_special_tokens_cut_the_answer():
    """gsm8k's `until` holds `<|im_end|>`: the cut reads the text with its special tokens (LLaDA's
    evaluation decodes so), so text after the marker never reaches the scorer."""
    from dlmjax.lm_eval.model import finish_text

    _, _, tokenizer, _ = load_checkpoint("toy-ar")
    eos = tokenizer.decode([tokenizer.eos_id], skip_special_tokens=False)
    tokens = tokenizer.encode("x=1") + [tokenizer.eos_id] + tokenizer.encode("y=2")
    assert finish_text(tokens, tokenizer, [eos]) == "x=1"
    assert finish_text(tokens, tokenizer, ["#"]) == "x=1y=2"  # no stop string met: the special token is dropped
    assert finish_text(tokenizer.encode("12+7-3"), tokenizer, ["-"]) == "12+7"
    # a stop string across a special token left out is cut too, as lm-eval's HF model cuts the text without them
    tokens = tokenizer.encode("7\n") + [tokenizer.eos_id] + tokenizer.encode("\n1+2")
    assert finish_text(tokens, tokenizer, ["\n\n"]) == "7"


def test_a_row_stops_only_once_its_cut_cannot_change():
    """`cut_is_settled` (the stop `generate_until` gives its Stream): once it accepts a prefix,
    lm-eval's cut of the whole text equals the prefix's, even where a later stop string cuts
    inside an earlier one's occurrence that runs past the prefix, and where the prefix's last
    characters (an unfinished character, cleaned-up spaces) differ from the whole text's."""
    from hypothesis import given, settings, strategies as st
    from lm_eval.models.utils import postprocess_generated_text

    from dlmjax.lm_eval.model import _UNSETTLED_TAIL, cut_is_settled

    # the reviews' cases: stopped at the prefix, the responses were "so the Answer" and "x = 3";
    # the third's cut moves through three splits in turn (a margin of twice the longest string let it by)
    assert not cut_is_settled("so the Answer:", ["Answer: ", ":"])
    assert not cut_is_settled("x = 3;;", [";Q", ";;"])
    whole, until = ":b:bbb:ba:::abba:", [":a:", ":::", "a::"]
    assert not cut_is_settled(whole[:13] + ":baa", until)
    assert cut_is_settled("so the Answer: 42, as the sum: 40 + 2 is", ["Answer: ", ":"])
    assert cut_is_settled("7\nQuestion: what" + "x" * 20, ["Question:"])
    assert not cut_is_settled("7\nQuestion:", ["Question:"])
    assert not cut_is_settled("anything at all", []) and not cut_is_settled("no stop here" * 5, ["\n"])
    # a byte-fallback tokenizer's unfinished run: one U+FFFD per byte, any number of them may change
    # ("abxy" + the first bytes of "éé😀" is "abxy" + 7 x U+FFFD; the whole text cuts at "xyé")
    assert not cut_is_settled("abxy" + "\ufffd" * 7, ["xyé", "y"])

    @settings(max_examples=3000, deadline=None, derandomize=True)
    @given(st.text("ab:", max_size=40), st.lists(st.text("ab:", min_size=1, max_size=4), min_size=1, max_size=4),
           st.integers(0, 40), st.text("ab:", max_size=_UNSETTLED_TAIL))
    def check(whole, until, n, tail):
        prefix = whole[:n]
        prefix = prefix[: max(0, len(prefix) - len(tail))] + tail  # its last characters may differ
        if cut_is_settled(prefix, until):
            assert postprocess_generated_text(prefix, until, None) == postprocess_generated_text(whole, until, None)

    check()


def test_chat_options_of_lm_evals_hf_model(monkeypatch, tmp_path):
    """enable_thinking reaches the chat template; add_bos_token is taken; a gen_prefix history
    (add_generation_prompt=False) continues the assistant's turn."""
    import shutil

    from dlmjax.presets import resolve_model

    model_dir = tmp_path / "toy-ar"
    shutil.copytree(resolve_model("toy-ar"), model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if messages[0].role == 'system' %}{{ raise_exception('System role not "
                               "supported') }}{% endif %}"
                               "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
                               "{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    lm = DlmjaxLM(pretrained=str(model_dir), mesh_data=1, warmup=False, enable_thinking="false", add_bos_token="true")
    assert lm.add_bos_token is True
    user = [{"role": "user", "content": "Q"}]
    assert lm.apply_chat_template(user) == "<user>Q</user>[no-think]<assistant>"
    # a template that refuses a system turn (Gemma's, Mistral's): rendered without it, as HFLM does
    assert lm.apply_chat_template([{"role": "system", "content": "Be brief."}, *user]) == lm.apply_chat_template(user)
    prefix = [*user, {"role": "assistant", "content": "A: "}]
    assert lm.apply_chat_template(prefix, add_generation_prompt=False) == "<user>Q</user><assistant>A: "
    with pytest.raises(ModelArgsError, match="add_bos_token='maybe' must be true or false"):
        DlmjaxLM(pretrained="toy-ar", mesh_data=1, add_bos_token="maybe")


@pytest.mark.parametrize("bos_token,post_processor", [
    ("<|endoftext|>", None),  # SmolLM2: names a BOS, its special tokens add none
    ("<|endoftext|>", "<|endoftext|> $A"),  # Llama 3: they add BOS
    ("<|unk|>", "<|unk|> $A <|endoftext|>"),  # BOS and a trailing EOS
    (None, None),  # Qwen: no BOS
])
def test_add_bos_token_encodes_as_lm_evals_hf_model_does(tmp_path, bos_token, post_processor):
    """HFLM hands add_bos_token to transformers' tokenizer, which rebuilds its post-processor: true
    makes the special tokens BOS alone (where the tokenizer names one; SmolLM2's add none), false
    none; unset keeps tokenizer.json's. A text that starts with the prefix token gets no special
    tokens, unless add_special_tokens=True is passed."""
    import shutil

    from tokenizers import Tokenizer as Backend, processors

    from dlmjax.presets import resolve_model

    transformers = pytest.importorskip("transformers")
    model_dir = tmp_path / "toy-ar"
    shutil.copytree(resolve_model("toy-ar"), model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": bos_token}))
    if post_processor:
        backend = Backend.from_file(str(model_dir / "tokenizer.json"))
        specials = [(t, backend.token_to_id(t)) for t in ("<|endoftext|>", "<|unk|>") if t in post_processor]
        backend.post_processor = processors.TemplateProcessing(single=post_processor, special_tokens=specials)
        backend.save(str(model_dir / "tokenizer.json"))
    for flag in (None, True, False):
        option = {} if flag is None else {"add_bos_token": flag}
        lm = DlmjaxLM(pretrained=str(model_dir), mesh_data=1, warmup=False,
                      **{k: str(v).lower() for k, v in option.items()})
        theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir), **option)
        prefix = theirs.decode(lm.prefix_token_id)
        for text in ("12+7-3\n", f"{prefix}12+7\n"):
            special = {"add_special_tokens": False} if text.startswith(prefix) else (
                {} if flag is None else {"add_special_tokens": flag})  # HFLM.tok_encode's rule
            assert lm.tok_encode(text) == theirs.encode(text, **special), (flag, text)
            assert lm.tok_encode(text, add_special_tokens=True) == theirs.encode(text, add_special_tokens=True)
        if flag and bos_token and not post_processor:
            assert lm.tok_encode("12+7-3\n")[0] == lm.tokenizer.bos_id  # SmolLM2's case: added by the flag


# ---------------------------------------------------------------------------------- likelihoods


def exact_bound(model, context, continuation, mask_id, suffix=()):
    """The masked-diffusion bound computed exactly: every nonempty masking pattern of every group,
    weighted as the estimator weighs it (each l in 1..T equally likely, each pattern of l equally)."""
    block = model.config.block_size if model.config.attention == "block_causal" else None
    tokens = np.asarray(context + continuation + list(suffix), np.int32)
    groups = continuation_groups(len(context), len(tokens), block, len(suffix))
    total = 0.0
    for group in np.unique(groups[groups >= 0]):
        cols = np.flatnonzero(groups == group)
        size = len(cols)
        patterns = [s for l in range(1, size + 1) for s in itertools.combinations(cols, l)]
        masked = np.zeros((len(patterns), len(tokens)), bool)
        for i, s in enumerate(patterns):
            masked[i, list(s)] = True
        logp = masked_logprobs(model, tokens, masked, mask_id=mask_id)
        for i, s in enumerate(patterns):
            l = len(s)
            total += (1 / size) * (size / l) / math.comb(size, l) * logp[i].sum()
    return total


@pytest.fixture(scope="module")
def toy_sdar():
    return load_checkpoint("toy-sdar")


@pytest.fixture(scope="module")
def tiny_llada():
    from dlmjax.config import ModelConfig
    from dlmjax.models.transformer import init_model

    cfg = ModelConfig(family="llada", attention="bidirectional", vocab_size=32, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16, max_position_embeddings=64,
                      mask_token_id=31, eos_token_ids=(1,), pad_token_id=0)
    return init_model(cfg, seed=3)


def test_diffusion_estimate_is_reproducible_and_batch_independent(toy_sdar):
    _, model, tok, _ = toy_sdar
    ctx, cont = tok.encode("12+7-3\n"), tok.encode("12+7=19\n19-3=16")
    mask_id = model.config.mask_token_id
    a = masked_diffusion_bound(model, ctx, cont, mc_num=16, seed=5, mask_id=mask_id, batch_size=16)
    b = masked_diffusion_bound(model, ctx, cont, mc_num=16, seed=5, mask_id=mask_id, batch_size=5)
    c = masked_diffusion_bound(model, ctx, cont, mc_num=16, seed=6, mask_id=mask_id, batch_size=16)
    assert a == pytest.approx(b, abs=1e-5) and a != c
    assert a < 0
    wrong = masked_diffusion_bound(model, ctx, tok.encode("12+7=18\n18-3=15"), mc_num=16, seed=5, mask_id=mask_id)
    assert wrong < a - 1.0  # the trained model prefers the right chain


@pytest.mark.parametrize("which", ["toy_sdar", "tiny_llada", "tiny_llada+eos"])
def test_diffusion_estimate_approaches_the_enumerated_bound(which, request):
    """Also with an EOS suffix (Dream's evaluation), which is never masked and conditions the
    continuation before it: a different bound."""
    suffix = []
    if which == "toy_sdar":
        _, model, tok, _ = request.getfixturevalue("toy_sdar")
        ctx, cont = tok.encode("3+4-2\n"), tok.encode("3+4=7\n")  # 6 + 6 tokens: blocks of 2 and 4 (block 8)
        mask_id = model.config.mask_token_id
    else:
        model = request.getfixturevalue("tiny_llada")
        ctx, cont, mask_id = [5, 9, 2, 7], [11, 4, 20, 6, 13], 31  # one group of 5: 31 patterns
        suffix = [1] if which.endswith("+eos") else []
    exact = exact_bound(model, ctx, cont, mask_id, suffix)
    samples = masked_diffusion_bound(model, ctx, cont, mc_num=2048, seed=0, mask_id=mask_id, batch_size=512,
                                     suffix=suffix, return_samples=True)
    stderr = samples.std() / math.sqrt(len(samples))
    assert stderr > 0
    assert abs(samples.mean() - exact) < 4 * stderr, (samples.mean(), exact, stderr)
    if suffix:
        assert abs(exact - exact_bound(model, ctx, cont, mask_id)) > 1e-3  # the suffix conditions


def test_an_eos_suffix_is_never_masked_and_reaches_the_lm_eval_model():
    """...but not its rolling windows: a document goes on after each of them."""
    from dlmjax.lm_eval.likelihood import sample_masks

    samples = sample_masks([5, 9], [11, 4, 20], mc_num=64, seed=0, block_size=None, suffix=[1])
    assert samples.tokens.tolist() == [5, 9, 11, 4, 20, 1]
    assert not samples.masked[:, [0, 1, 5]].any() and samples.masked[:, 2:5].any(axis=1).all()
    lm = DlmjaxLM(pretrained="random-llada-moe", mesh_data=1, warmup=False, eos_suffix="true", mc_num=8, mc_batch=8)
    ctx, cont = lm.tok_encode("12+7-3\n"), lm.tok_encode("12+7=19")
    ((value, _),) = lm._loglikelihood_tokens([(None, ctx, cont)], disable_tqdm=True)
    bound = partial(masked_diffusion_bound, lm.model, ctx, cont, mc_num=8, seed=0, mask_id=lm.config.mask_token_id,
                    batch_size=8, pad_id=lm.eot_token_id)
    assert value == bound(suffix=[lm.eot_token_id]) != bound()
    plain = DlmjaxLM(pretrained="random-llada-moe", mesh_data=1, warmup=False, mc_num=8, mc_batch=8)
    # a short document and one of several windows (the windows used to shrink by the suffix's token)
    assert len(lm.tok_encode("12+7=19\n3+4=7\n" * 40)) > lm.max_length
    for text in ("12+7=19\n19-3=16", "12+7=19\n3+4=7\n" * 40):
        document = [Instance("loglikelihood_rolling", {}, (text,), 0, ("t", 0, 1))]
        assert lm.loglikelihood_rolling(document, disable_tqdm=True) == plain.loglikelihood_rolling(
            document, disable_tqdm=True)
    with pytest.raises(ModelArgsError, match="eos_suffix=true.*a causal model.*drop it"):
        DlmjaxLM(pretrained="toy-ar", mesh_data=1, warmup=False, eos_suffix=True)
    # a block-causal model's blocks see no later block: the EOS conditioned only a last block it fell in
    with pytest.raises(ModelArgsError, match="eos_suffix=true is Dream's convention .*block-causal.*drop it"):
        DlmjaxLM(pretrained="toy-sdar", mesh_data=1, warmup=False, eos_suffix=True)


def test_no_wasted_forwards_fewer_samples_than_a_batch_and_no_greedy_check_on_rolling_windows(monkeypatch):
    """mc_num below mc_batch used to pad every forward to mc_batch rows; is_check_greedy ran one
    forward per token of every rolling window and threw the result away."""
    import dlmjax.lm_eval.likelihood as likelihood
    import dlmjax.lm_eval.model as lm_model

    rows, greedy_calls = [], []
    real_logprobs = likelihood.masked_logprobs
    monkeypatch.setattr(likelihood, "masked_logprobs",
                        lambda model, tokens, masked, **kw: rows.append(len(masked)) or real_logprobs(
                            model, tokens, masked, **kw))
    monkeypatch.setattr(lm_model, "greedy_continuation", lambda *a, **kw: greedy_calls.append(1) or False)
    lm = DlmjaxLM(pretrained="toy-sdar", mesh_data=1, warmup=False, mc_num=4, mc_batch=32, is_check_greedy="true")
    document = [Instance("loglikelihood_rolling", {}, ("12+7=19\n19-3=16",), 0, ("t", 0, 1))]
    lm.loglikelihood_rolling(document, disable_tqdm=True)
    assert rows == [4] and greedy_calls == []
    lm._loglikelihood_tokens([(None, lm.tok_encode("12+7-3\n"), lm.tok_encode("12+7=19"))], disable_tqdm=True)
    assert greedy_calls == [1]  # a plain request is still checked


@pytest.mark.parametrize("which", ["toy_sdar", "llada", "dream"])
def test_masked_logprobs_score_the_continuation_window_as_the_whole_rows_would(which, request, monkeypatch):
    """Logits are made for the window of columns the patterns mask (the continuation's) only: no
    vocabulary-wide array of the compiled scorer has more than 5 patterns x 16 rows (the whole
    rows' would have 5 x 48); its log-probs equal those read from the whole rows' logits
    (block-causal [noisy ; clean], bidirectional, and Dream's shifted logits), after a 40-token
    context."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from hlo import first_program, logits_rows
    from test_decoding import peaky_model

    from dlmjax.lm_eval import likelihood

    model = request.getfixturevalue("toy_sdar")[1] if which == "toy_sdar" else peaky_model(which, 2)
    rng = np.random.default_rng(1)
    vocab, mask_id = model.config.vocab_size, model.config.mask_token_id
    clean = rng.integers(2, min(vocab, 30), 46).astype(np.int32)  # context 40, continuation 6
    masked = np.zeros((5, 46), bool)
    masked[:, 40:] = rng.random((5, 6)) < 0.5
    masked[:, 41] = True
    got = []
    with dlmjax.numerics(row_tile=16):  # the invariant mode (on an accelerator) makes whole tiles of rows
        hlo, _, _ = first_program(monkeypatch, likelihood, "_masked_scores",
                                  lambda: got.append(masked_logprobs(model, clean, masked, mask_id=mask_id)))
    got = got[0]
    made = logits_rows(hlo, model.config)
    assert made and max(made) <= 5 * 16, made
    block = model.config.block_size if model.config.attention == "block_causal" else None
    width = likelihood._bucket(46)
    tokens, valid = likelihood._pad_rows([clean.tolist()] * 5, width, 0)
    mask = np.pad(masked, ((0, 0), (0, width - 46)))
    with dlmjax.numerics(row_tile=16):
        if block:  # the whole rows (a window of all 48 columns) through the same scorer
            graphdef, params = nnx.split(model)
            clean_state = likelihood._clean_state(graphdef, params, tokens[:1], valid[0], block_size=block)
            whole = likelihood._masked_scores(graphdef, params, tokens[0], mask, valid[0], np.int32(0),
                                              np.zeros(width, bool), clean_state, span=width, block_size=block,
                                              mask_id=mask_id)
        else:  # the model's own (for Dream, shifted) logits of the whole noisy rows
            logits = model(jnp.where(mask, mask_id, tokens), valid_bl=jnp.asarray(valid)).logits
            logp = jax.nn.log_softmax(logits, axis=-1)
            whole = jnp.take_along_axis(logp, jnp.asarray(tokens)[..., None], axis=-1)[..., 0]
    # fp32: the window's program and the whole rows' differ in widths, so in reduction order (2e-6 relative)
    np.testing.assert_allclose(got, np.where(masked, np.asarray(whole)[:, :46], 0.0), rtol=1e-5, atol=1e-5)
    assert np.count_nonzero(got) == masked.sum()
    nothing = masked_logprobs(model, clean, np.zeros_like(masked), mask_id=mask_id)  # no column to score
    assert nothing.shape == masked.shape and not nothing.any()


@pytest.mark.parametrize("cfg", [0.0, 1.0])
def test_a_block_causal_scorer_forwards_the_clean_row_once_and_per_pattern_only_the_scored_blocks(toy_sdar, cfg,
                                                                                                 monkeypatch):
    """toy-sdar (block 8), a 100-token context and a 6-token continuation (112 columns), 5 patterns
    2 per forward: the clean row goes through the model once for all of them (with cfg, with its
    context masked too: 2 rows), and each pattern only the 16 scored columns' blocks, in
    16 + 2 x 8 - 2 = 30 columns, packed two to a forward row (60 columns, within the 112 of the
    cache) against one copy of the clean row's cache. The training layout would forward 5 rows of
    2 x 112, and a cache per pattern would hold 5 rows."""
    import jax

    from dlmjax.models.transformer import Transformer

    model = toy_sdar[1]
    clean = np.random.default_rng(1).integers(3, 30, 106)
    masked = np.zeros((5, 106), bool)
    masked[:, 100:] = True
    forwarded, real_call = [], Transformer.__call__

    def spy(self, tokens, *a, cache=None, **kw):
        forwarded.append((tuple(tokens.shape), cache.k[0].shape[0] if cache is not None else None))
        return real_call(self, tokens, *a, cache=cache, **kw)

    monkeypatch.setattr(Transformer, "__call__", spy)
    with jax.disable_jit():  # every forward seen, none served from a compiled program of another test
        masked_logprobs(model, clean, masked, mask_id=model.config.mask_token_id, cfg=cfg, context_len=100,
                        batch_size=2)
    rows = 2 if cfg else 1
    assert forwarded == [((rows, 112), rows)] + [((rows, 2 * 30), rows)] * 3


def whole_row_reference(model, clean, masked, *, mask_id, cfg=0.0, context_len=0):
    """[S, L] log-probs of the masked tokens from the model's own whole-row forwards. A
    block-causal model gets one row per (pattern, block): that block as the pattern masks it, the
    blocks before it clean, the blocks after it unseen (a bidirectional model: one block). With
    `cfg`, from LLaDA's guided logits u + (cfg + 1)(c - u): c of the row, u of it with the first
    `context_len` tokens masked too."""
    import jax
    import jax.numpy as jnp

    positions = np.arange(len(clean))
    block = model.config.block_size if model.config.attention == "block_causal" else len(clean)
    pairs = sorted({(i, p // block) for i, p in zip(*np.nonzero(masked))})
    in_block = [positions // block == b for _, b in pairs]
    noisy = np.stack([np.where(masked[i] & cols, mask_id, clean) for (i, _), cols in zip(pairs, in_block)])

    def logits(rows):
        return np.asarray(compiled_forward(model)(jnp.asarray(rows)).logits, np.float64)

    guided = logits(noisy)
    if cfg:
        u = logits(np.where(positions < context_len, mask_id, noisy))
        guided = u + (cfg + 1) * (guided - u)
    logp = np.asarray(jax.nn.log_softmax(guided, axis=-1))
    expected = np.zeros(masked.shape)
    for r, ((i, _), cols) in enumerate(zip(pairs, in_block)):
        expected[i] += np.where(masked[i] & cols, logp[r, positions, clean], 0.0)
    return expected


@pytest.mark.parametrize("which", ["toy_sdar", "fast_dllm_v2"])
@pytest.mark.parametrize("context_blocks", [3, 12])
def test_a_block_causal_masked_position_is_scored_as_its_noisy_block_after_the_clean_ones(which, context_blocks,
                                                                                         request):
    """The reference is the model's plain forward of the clean blocks before a position's block
    and that block as the pattern masks it: the log-prob at the position (for Fast-dLLM
    v2's shifted logits, the column before it, which for a block's first position is the clean
    block's last). The continuation starts mid-block and crosses two block boundaries, whose first
    positions are masked in some patterns and not in others. After a short context each pattern
    has a forward row of its own; after a long one, two patterns share one (`_packed_copies`)."""
    from test_decoding import peaky_model

    from dlmjax.lm_eval import likelihood

    model = request.getfixturevalue("toy_sdar")[1] if which == "toy_sdar" else peaky_model(which, 3)
    block, mask_id = model.config.block_size, model.config.mask_token_id
    rng = np.random.default_rng(2)
    context_len, total = context_blocks * block - 2, (context_blocks + 2) * block + 1
    span = likelihood._bucket(total - context_len)
    width = span + 2 * block - 2
    assert likelihood._packed_copies(4, width, likelihood._bucket(total)) == (1 if context_blocks == 3 else 2)
    clean = rng.integers(2, min(model.config.vocab_size, 30), total).astype(np.int32)
    masked = np.zeros((4, total), bool)
    masked[:, context_len:] = rng.random((4, total - context_len)) < 0.5
    boundaries = [context_blocks * block, (context_blocks + 1) * block]
    masked[:2, boundaries] = True
    masked[2:, boundaries] = False
    got = masked_logprobs(model, clean, masked, mask_id=mask_id)
    np.testing.assert_allclose(got, whole_row_reference(model, clean, masked, mask_id=mask_id), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["toy_sdar", "llada", "dream"])
def test_guided_log_probs_are_llada_cfg_over_the_whole_rows_logits(which, request):
    """cfg > 0 scores from LLaDA's guided logits (block-causal, bidirectional, Dream's shifted
    logits), within 1e-5 of the model's whole-row forwards; cfg 0 is the unguided scorer, and the
    Monte Carlo estimate changes with the scale."""
    from test_decoding import peaky_model

    model = request.getfixturevalue("toy_sdar")[1] if which == "toy_sdar" else peaky_model(which, 4)
    rng = np.random.default_rng(3)
    mask_id, context_len, total = model.config.mask_token_id, 9, 19  # toy-sdar: context ends mid-block
    clean = rng.integers(2, min(model.config.vocab_size, 30), total).astype(np.int32)
    masked = np.zeros((4, total), bool)
    masked[:, context_len:] = rng.random((4, total - context_len)) < 0.5
    masked[:, context_len] = True
    for cfg in (0.0, 1.5):
        got = masked_logprobs(model, clean, masked, mask_id=mask_id, cfg=cfg, context_len=context_len)
        expected = whole_row_reference(model, clean, masked, mask_id=mask_id, cfg=cfg, context_len=context_len)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    ctx, cont = clean[:context_len].tolist(), clean[context_len:].tolist()
    estimates = [masked_diffusion_bound(model, ctx, cont, mc_num=8, seed=0, mask_id=mask_id, batch_size=8, cfg=cfg)
                 for cfg in (0.0, 0.0, 1.0)]
    assert estimates[0] == estimates[1] != estimates[2]


def test_guidance_is_refused_where_it_cannot_apply_and_reaches_the_lm_eval_model():
    from test_decoding import peaky_model

    peaky = peaky_model("llada", 4)
    with pytest.raises(ValueError, match="cfg=-1.0 is negative"):
        masked_logprobs(peaky, np.arange(4), np.ones((1, 4), bool), mask_id=39, cfg=-1.0, context_len=1)
    with pytest.raises(ValueError, match="there is no context here"):
        masked_diffusion_bound(peaky, [], [5, 6], mc_num=2, seed=0, mask_id=39, cfg=1.0)
    for value in ("-0.5", "nan", "strong"):
        with pytest.raises(ModelArgsError, match=f"cfg={value!r} must be a number >= 0"):
            DlmjaxLM(pretrained="toy-sdar", mesh_data=1, warmup=False, cfg=value)
    with pytest.raises(ModelArgsError, match="a causal model has no mask token.*drop cfg"):
        DlmjaxLM(pretrained="toy-ar", mesh_data=1, warmup=False, cfg=1)
    guided = DlmjaxLM(pretrained="toy-sdar", mesh_data=1, warmup=False, cfg="0.5", mc_num=8, mc_batch=8)
    ctx, cont = guided.tok_encode("12+7-3\n"), guided.tok_encode("12+7=19")
    ((value, _),) = guided._loglikelihood_tokens([(None, ctx, cont)], disable_tqdm=True)
    assert value == masked_diffusion_bound(guided.model, ctx, cont, mc_num=8, seed=0, mask_id=guided.config.mask_token_id,
                                           batch_size=8, pad_id=guided.eot_token_id, cfg=0.5)
    with pytest.raises(ModelArgsError, match="guides log-likelihoods only.*drop cfg for generation tasks"):
        guided.generate_until([])


def greedy_reference(model, context, length, mask_id, cfg=0.0):
    """LLaDA's suffix_greedy_prediction as a plain loop over whole-row forwards: `length` masks
    after the context, each step revealing the most confident masked position's argmax (the mask
    id never proposed; a block-causal model's first unfinished block only)."""
    import jax
    import jax.numpy as jnp

    seq = np.asarray(list(context) + [mask_id] * length)
    block = model.config.block_size if model.config.attention == "block_causal" else len(seq)
    forward = compiled_forward(model)
    for _ in range(length):
        logits = np.asarray(forward(jnp.asarray(seq[None])).logits[0], np.float64)
        if cfg:
            guide = np.asarray(forward(jnp.asarray(np.where(np.arange(len(seq)) < len(context), mask_id, seq)[None]))
                               .logits[0], np.float64)
            logits = guide + (cfg + 1) * (logits - guide)
        logits[:, mask_id] = -np.inf
        confidence = np.asarray(jax.nn.softmax(logits, axis=-1)).max(axis=-1)
        masked = np.flatnonzero(seq == mask_id)
        candidates = masked[masked // block == masked[0] // block]
        pick = candidates[np.argmax(confidence[candidates])]
        seq[pick] = np.argmax(logits[pick])
    return seq[len(context):].tolist()


@pytest.mark.parametrize("which", ["toy_sdar", "llada", "dream", "llada+cfg"])
def test_greedy_check_is_llada_suffix_greedy_prediction(which, request):
    """greedy_continuation is True for what LLaDA's one-token-a-forward greedy loop decodes from
    the context (toy-sdar block by block, Dream's shifted logits, guided logits) and False once a
    token of it changes; DlmjaxLM reports it with is_check_greedy=true."""
    from test_decoding import peaky_model

    from dlmjax.lm_eval.likelihood import greedy_continuation

    model = request.getfixturevalue("toy_sdar")[1] if which == "toy_sdar" else peaky_model(which.split("+")[0], 5)
    cfg = 0.5 if which.endswith("+cfg") else 0.0
    mask_id = model.config.mask_token_id
    context = np.random.default_rng(4).integers(3, min(model.config.vocab_size, 30), 9).tolist()
    greedy = greedy_reference(model, context, 11, mask_id, cfg)  # toy-sdar: from mid-block over two boundaries
    assert greedy_continuation(model, context, greedy, mask_id=mask_id, cfg=cfg)
    changed = greedy.copy()
    changed[7] = 3 if changed[7] != 3 else 4
    assert not greedy_continuation(model, context, changed, mask_id=mask_id, cfg=cfg)
    if which == "toy_sdar":
        lm = DlmjaxLM(pretrained="toy-sdar", mesh_data=1, warmup=False, is_check_greedy="true", mc_num=2, mc_batch=2)
        results = lm._loglikelihood_tokens([(None, context, greedy), (None, context, changed)], disable_tqdm=True)
        assert [g for _, g in results] == [True, False]


@pytest.mark.usefixtures("kernel_numerics")
@pytest.mark.parametrize("which", ["toy-ar", "toy-sdar"])
def test_likelihoods_on_the_kernel_path_make_no_logits(which, monkeypatch):
    """Where residual_argmax runs as a kernel (interpret mode here), the causal and the diffusion
    scorers read log p(token) as z_t - z_a + log p_a from its argmax a: the same log-probs (1e-5)
    and greedy flags as from the logits, and compiled programs with no vocabulary-wide array but
    the lm_head."""
    from dlmjax.lm_eval import likelihood
    from hlo import logits_rows, program_under_kernels

    _, model, tokenizer, _ = load_checkpoint(which)
    pairs = [(tokenizer.encode("12+7="), tokenizer.encode("19")), (tokenizer.encode("3*4="), tokenizer.encode("13"))]
    if which == "toy-ar":
        name = "_next_token_scores"
        score = lambda: likelihood.causal_logprobs(model, pairs, batch_size=2)  # noqa: E731
    else:
        name = "_masked_scores"
        clean = np.asarray(pairs[0][0] + pairs[0][1], np.int32)
        masked = np.zeros((3, len(clean)), bool)
        masked[:, len(pairs[0][0]):] = [[True, False], [False, True], [True, True]]
        score = lambda: masked_logprobs(model, clean, masked, mask_id=model.config.mask_token_id)  # noqa: E731
    runs = {}
    for mode in ("off", "interpret"):
        hlo, result = program_under_kernels(mode, likelihood, name, score)
        runs[mode] = (result, logits_rows(hlo, model.config))
    if which == "toy-ar":
        assert [g for _, g in runs["interpret"][0]] == [g for _, g in runs["off"][0]]
        values = [np.asarray([v for v, _ in runs[mode][0]]) for mode in ("interpret", "off")]
    else:
        values = [runs[mode][0] for mode in ("interpret", "off")]
    np.testing.assert_allclose(*values, rtol=1e-5, atol=1e-5)
    assert runs["off"][1], "with the kernels off the program must hold the logits this test looks for"
    assert runs["interpret"][1] == []


# ------------------------------------------------------------------------------ a real causal model


@pytest.mark.slow
def test_causal_loglikelihood_equals_transformers(tmp_path_factory):
    """SmolLM2-135M-Instruct (the GGUF test_smollm2 converts): lm-eval's loglikelihood and
    loglikelihood_rolling requests through dlmjax equal transformers' log-probs on the same
    checkpoint, tokenised by transformers' own tokenizer, within 1e-4; is_greedy agrees."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from dlmjax.io.gguf import convert_gguf
    from test_smollm2 import packaged_gguf

    ckpt = convert_gguf(packaged_gguf(), tmp_path_factory.mktemp("smollm2_lm_eval"))
    hf_tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    lm = DlmjaxLM(pretrained=str(ckpt), batch_size=4, mesh_data=1)

    def encode(text):
        return hf_tok(text, add_special_tokens=False)["input_ids"]

    def hf_score(ctx_ids, cont_ids):
        ids = torch.tensor([ctx_ids + cont_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(ids).logits[0].double(), -1)
        rows = logp[len(ctx_ids) - 1 : -1]
        target = torch.tensor(cont_ids)
        return float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())

    pairs = [("The capital of France is", " Paris"), ("Question: What is 2 + 3?\nAnswer:", " 5"),
             ("Once upon a time", " there was a little dragon who loved to read books."), ("", "Hello world")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i, ("t", i, 1)) for i, pair in enumerate(pairs)])
    for (ctx, cont), (logprob, greedy) in zip(pairs, got):
        if ctx:
            whole, ctx_ids = encode(ctx + cont), encode(ctx)
            want = hf_score(ctx_ids, whole[len(ctx_ids):])
        else:  # an empty context is conditioned on the prefix token (lm-eval's rule)
            want = hf_score([lm.prefix_token_id], encode(cont))
        assert logprob == pytest.approx(want[0], abs=1e-4) and greedy == want[1]
    assert any(g for _, g in got) and not all(g for _, g in got)

    text = "The quick brown fox jumps over the lazy dog. " * 3
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0, ("t", 0, 1))])
    assert rolling == pytest.approx(hf_score([lm.prefix_token_id], encode(text))[0], abs=1e-4)


def test_causal_rolling_windows_of_all_documents_are_scored_together_without_padding_to_the_batch(monkeypatch):
    """Each document used to be one batch of its own, padded with copies of its window to
    batch_size rows (16x the forward for a one-window document); now the windows of every
    document share batches, and a last batch is padded to a power of two only."""
    import dlmjax.lm_eval.likelihood as likelihood

    rows = []
    original = likelihood._next_token_scores

    def counting(graphdef, params, inputs, *args, **kwargs):
        rows.append(inputs.shape[0])
        return original(graphdef, params, inputs, *args, **kwargs)

    monkeypatch.setattr(likelihood, "_next_token_scores", counting)
    texts = ["12+7=19\n19-3=16", "3+4=7\n" * 50, "1+1=2"]  # one window, several windows, one window
    documents = [Instance("loglikelihood_rolling", {}, (text,), i, ("t", i, 1)) for i, text in enumerate(texts)]
    batched = DlmjaxLM(pretrained="toy-ar", batch_size=16, mesh_data=1, warmup=False)
    windows = sum(len(batched.tok_encode(t)) // batched.max_length + 1 for t in texts)
    totals = batched.loglikelihood_rolling(documents, disable_tqdm=True)
    assert rows == [1 << (windows - 1).bit_length()]  # one forward for every window, no batch of 16
    rows.clear()
    alone = DlmjaxLM(pretrained="toy-ar", batch_size=1, mesh_data=1, warmup=False)
    assert totals == pytest.approx([alone.loglikelihood_rolling([d], disable_tqdm=True)[0] for d in documents],
                                   rel=1e-5)


def test_a_context_cut_to_fit_the_model_is_warned_about(caplog):
    """A loglikelihood context longer than the model is left-truncated, as lm-eval's HF model does,
    and a warning says so (generate_until's did; a cut few-shot prompt changes the score); a rolling
    window, cut to fit by design, is not warned about."""
    import logging

    lm = DlmjaxLM(pretrained="toy-ar", mesh_data=1, warmup=False)
    long_context = list(range(3, 13)) * (lm.max_length // 10 + 1)
    with caplog.at_level(logging.WARNING, logger="dlmjax"):
        context, continuation = lm._fit(long_context, [5, 6])
        assert len(context) + len(continuation) == lm.max_length + 1 and context == long_context[-len(context):]
        assert "left-truncated" in caplog.text
        caplog.clear()
        lm._fit(long_context, [5, 6], rolling=True)
        lm._fit([4, 5], [5, 6])
        assert "left-truncated" not in caplog.text
