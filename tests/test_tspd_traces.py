"""TSPD traces: features, labels and targets against a plain full-forward loop written here;
sharded over the data axis equals single-device; the on-disk format and its model check."""

import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax.heads.controller import FEATURES, model_fingerprint
from dlmjax.sharding import make_mesh
from dlmjax.traces import TraceError, collect_traces, load_traces, save_traces
from test_decoding import MASK, peaky_model
from tiny_models import compiled_forward

MAX_NEW = 8
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [3], [5, 9, 14, 2, 2, 7, 30], [20, 21], [4, 4, 4, 4], [11, 12], [33, 1, 2]]


@pytest.fixture(scope="module")
def sdar():
    # less peaked than the decoding tests' model, so that tokens change and take several rounds
    model = peaky_model("sdar", seed=3)
    head = model.embed if model.lm_head is None else model.lm_head.kernel
    head[...] = head[...] * 0.08
    return model


def scores_np(model, seq, start, k):
    logits = np.asarray(compiled_forward(model)(jnp.asarray([seq], jnp.int32)).logits[0, start : start + k], np.float64)
    logits[:, MASK] = -np.inf
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    probs = np.exp(logp)
    tokens = probs.argmax(-1)
    with np.errstate(invalid="ignore"):  # 0 * -inf at the mask token
        entropy = -np.sum(np.where(probs > 0, probs * logp, 0), -1)
    return tokens, probs[np.arange(k), tokens], entropy


def plain_traces(model, prompt, block, rollout="egp"):
    """Static (1 per step) for y*, then EGP (or the static run again), one full forward per step,
    features by hand."""
    start0 = (len(prompt) // block) * block
    num_blocks = -(-(len(prompt) - start0 + MAX_NEW) // block)
    base = list(prompt) + [MASK] * (num_blocks * block - (len(prompt) - start0))
    ystar = list(base)
    for b in range(num_blocks):
        s = start0 + b * block
        while MASK in ystar[s : s + block]:
            tok, conf, _ = scores_np(model, ystar, s, block)
            masked = np.array(ystar[s : s + block]) == MASK
            i = int(np.argmax(np.where(masked, conf, -1)))
            ystar[s + i] = int(tok[i])
    seq, records, rnd = list(base), [], 0
    for b in range(num_blocks):
        s = start0 + b * block
        prev_conf, prev_tok, stable, seen = np.zeros(block), np.full(block, -1), np.zeros(block), False
        while MASK in seq[s : s + block]:
            tok, conf, ent = scores_np(model, seq, s, block)
            masked = np.array(seq[s : s + block]) == MASK
            same = seen & (tok == prev_tok)
            stable = np.where(same, stable + 1, 0)
            momentum = conf - prev_conf if seen else np.zeros(block)
            label = masked & (tok == np.array(ystar[s : s + block]))
            for i in np.nonzero(masked)[0]:
                records.append((rnd, b, i, conf[i], ent[i], momentum[i], stable[i], s + i, bool(label[i]), tok[i],
                                ystar[s + i]))
            top1 = np.arange(block) == np.argmax(np.where(masked, conf, -1))
            commit = label if rollout == "egp" and label.any() else top1
            for i in np.nonzero(commit)[0]:
                seq[s + i] = ystar[s + i]
            prev_conf, prev_tok, seen, rnd = conf, tok, True, rnd + 1
    return records, ystar


@pytest.mark.parametrize("rollout", ["egp", "static"])
def test_features_labels_and_targets_match_a_plain_loop(sdar, rollout):
    prompt = PROMPTS[0]
    traces = collect_traces(sdar, [prompt], max_new_tokens=MAX_NEW, batch_size=1, rollout=rollout)
    records, ystar = plain_traces(sdar, prompt, 4, rollout)
    n = min(len(records), len(traces["label"]))
    assert n >= 6 and len(set(r[0] for r in records[:n])) >= 3, "too short a trajectory to check momentum/stable"
    f = traces["features"]
    col = {name: i for i, name in enumerate(FEATURES)}
    for j, (rnd, b, i, conf, ent, mom, stable, pos, label, tok, target) in enumerate(records[:n]):
        assert (traces["round"][j], traces["block"][j], int(f[j, col["block_pos"]])) == (rnd, b, i)
        np.testing.assert_allclose(f[j, col["confidence"]], conf, atol=2e-4)
        np.testing.assert_allclose(f[j, col["entropy"]], ent, atol=2e-3)
        np.testing.assert_allclose(f[j, col["momentum"]], mom, atol=3e-4)
        assert f[j, col["stable"]] == stable and f[j, col["abs_pos"]] == pos
        assert traces["label"][j] == label and traces["token"][j] == tok and traces["target"][j] == target
    # labels are exactly "argmax equals the reference output"
    np.testing.assert_array_equal(traces["label"], traces["token"] == traces["target"])
    assert 0 < traces["label"].mean() < 1
    stable = f[:, col["stable"]] >= 1
    if rollout == "egp":  # a token is committed the round its argmax is right: a stable one never is
        assert not traces["label"][stable].any()
    else:  # the reference run: a final token can wait, and its stable rounds are labelled 1
        assert traces["label"][stable].any() and len(traces["label"]) > len(plain_traces(sdar, prompt, 4)[0])


def test_traces_score_as_generate_does_where_the_argmax_kernel_runs(sdar, monkeypatch):
    """Where `residual_argmax` runs (a GPU or TPU; here interpret mode), greedy decoders score
    hidden states through it; traces do too, so the controller trains on the confidences it will
    decode with. The kernel's traces equal the reference path's."""
    from dlmjax import kernels
    import dlmjax.traces as traces_module

    made = []
    real = traces_module.BlockForwards
    monkeypatch.setattr(traces_module, "BlockForwards", lambda *a, **kw: made.append(kw) or real(*a, **kw))
    reference = collect_traces(sdar, PROMPTS[:2], max_new_tokens=MAX_NEW, batch_size=2)
    with kernels.use("interpret"):
        kernel = collect_traces(sdar, PROMPTS[:2], max_new_tokens=MAX_NEW, batch_size=2)
    assert [kw["scores_from_hidden"] for kw in made] == [False, True]
    for name in ("label", "token", "target", "round", "block"):
        np.testing.assert_array_equal(kernel[name], reference[name])
    np.testing.assert_allclose(kernel["features"], reference["features"], atol=1e-5)


@pytest.mark.devices(8)
def test_sharded_traces_equal_single_device(sdar, tmp_path):
    mesh = make_mesh(model=1)
    assert mesh.shape["data"] == 8
    single = collect_traces(sdar, PROMPTS[:6], max_new_tokens=MAX_NEW, batch_size=8)
    sharded = collect_traces(sdar, PROMPTS[:6], max_new_tokens=MAX_NEW, batch_size=8, mesh=mesh)
    assert set(single) == set(sharded)
    for name in single:
        np.testing.assert_allclose(single[name], sharded[name], atol=1e-5, err_msg=name)
    assert set(single["prompt"].tolist()) == set(range(6))

    out = save_traces(single, tmp_path / "tr", {"model": model_fingerprint(sdar.config), "num_prompts": 6})
    arrays, meta = load_traces(out, expect_model=model_fingerprint(sdar.config))
    np.testing.assert_array_equal(arrays["label"], single["label"])
    assert meta["features"] == list(FEATURES) and meta["count"] == len(single["label"])
    other = dict(model_fingerprint(sdar.config), hidden_size=64)
    with pytest.raises(TraceError, match="another model"):
        load_traces(out, expect_model=other)
    named = save_traces(single, tmp_path / "named", {"model": model_fingerprint(sdar.config), "num_prompts": 6,
                                                     "model_source": "random-sdar"})
    with pytest.raises(TraceError, match=r"holds traces of random-sdar .*train on the model they are of "
                                         r"\(backbone=random-sdar\)"):  # the fix `dlmjax train` takes
        load_traces(named, expect_model=other)
    with pytest.raises(TraceError, match="dlmjax traces"):
        load_traces(tmp_path)
    (named / "traces.npz").write_bytes((named / "traces.npz").read_bytes()[:100])  # a truncated copy
    with pytest.raises(TraceError, match=r"traces.npz cannot be read .*collect the traces again"):
        load_traces(named)


def test_prompt_traces_stop_where_the_checkpoint_stops(tmp_path):
    """A chat model's turn ends at a stop id of generation_config.json (SDAR-Chat: <|im_end|>),
    not only config.json's: traces of its prompts end there too, as its decoding does. Here the
    toy model's newline plays that token: every toy-arith answer holds one early."""
    import json
    import shutil

    import dlmjax
    from dlmjax.io.tokenizer import load_tokenizer
    from dlmjax.presets import resolve_model
    from dlmjax.traces import traces_for_prompts

    model_dir = tmp_path / "toy-sdar"
    shutil.copytree(resolve_model("toy-sdar"), model_dir)
    model = dlmjax.load_model(model_dir)
    prompts = ["14+2+2\n", "3+17-2\n"]
    plain, _ = traces_for_prompts(model, load_tokenizer(model_dir, model.config), prompts, name="p", max_new_tokens=24)
    newline = load_tokenizer(model_dir, model.config).encode("\n")[0]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": newline}))
    stopped, _ = traces_for_prompts(model, load_tokenizer(model_dir, model.config), prompts, name="p",
                                    max_new_tokens=24)
    assert stopped["block"].max() < plain["block"].max()


def test_traces_are_refused_where_no_trace_aware_decoder_would_run():
    """Traces in a geometry the decoders refuse would train a controller nothing can use: another
    block on a block-causal model, a causal model, a shifted-logit block-causal family, a prompt past the model's
    length."""
    import dlmjax
    from dlmjax.presets import resolve_model
    from dlmjax.traces import TraceError, collect_traces
    from dlmjax.validation import InputError

    with pytest.raises(TraceError, match="the model is a causal qwen3 model; a TSPD controller serves a diffusion"):
        collect_traces(dlmjax.load_model(resolve_model("toy-ar")), [[3, 4, 5]], max_new_tokens=8)
    toy = dlmjax.load_model(resolve_model("toy-sdar"))
    with pytest.raises(TraceError, match="--block 4: a block-causal model decodes in its own block size 8"):
        collect_traces(toy, [[3, 4, 5]], max_new_tokens=8, block=4)
    fast = dlmjax.load_model(resolve_model("random-fast-dllm-v2"))
    with pytest.raises(TraceError, match="shifted-logit"):
        collect_traces(fast, [[3, 4, 5]], max_new_tokens=8)
    limit = toy.config.max_position_embeddings
    with pytest.raises(InputError, match=f"leaves no room in the model's maximum length {limit}"):
        collect_traces(toy, [[3, 4, 5], [3] * limit], max_new_tokens=8)


def test_traces_refuse_whole_blocks_past_a_bidirectional_models_length_and_record_their_cache():
    """Whole blocks after the prompt must fit the model's maximum length, as generate refuses them
    (a controller trained on positions the model never saw would mislead); meta.json records the
    cache mode both decodes ran with."""
    import dlmjax
    from dlmjax.decoding import engine
    from dlmjax.decoding.api import generate
    from dlmjax.io.tokenizer import load_tokenizer
    from dlmjax.presets import resolve_model
    from dlmjax.traces import traces_for_prompts

    tokenizer = load_tokenizer(resolve_model("toy-sdar"))
    cfg = dlmjax.ModelConfig(family="llada", vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                             num_layers=1, num_heads=4, num_kv_heads=4, head_dim=8, attention="bidirectional",
                             mask_token_id=tokenizer.mask_id, eos_token_ids=(tokenizer.eos_id,),
                             pad_token_id=tokenizer.pad_id, max_position_embeddings=40)
    model = dlmjax.init_model(cfg, seed=1)
    prompt, new = list(range(10, 20)), 20  # 10 + 20 tokens fit in 40, one whole block of 32 does not
    with pytest.raises(engine.LayoutError, match="reach position 42, past the model's maximum length 40"):
        generate(model, [prompt], decoder="static", max_new_tokens=new)
    with pytest.raises(engine.LayoutError, match="reach position 42, past the model's maximum length 40"):
        collect_traces(model, [prompt], max_new_tokens=new, batch_size=1)
    assert collect_traces(model, [prompt], max_new_tokens=new, batch_size=1, block=10)["label"].size  # a block that fits

    toy = dlmjax.load_model(resolve_model("toy-sdar"))
    _, meta = traces_for_prompts(toy, tokenizer, ["1+2\n"], name="p", max_new_tokens=8)
    assert meta["cache"] == "exact"  # a block-causal model's own cache; another is refused, as the decoders do
    with pytest.raises(TraceError, match="--cache dual: a block-causal model decodes with its own exact cache"):
        traces_for_prompts(toy, tokenizer, ["1+2\n"], name="p", max_new_tokens=8, cache="dual")
    _, meta = traces_for_prompts(model, tokenizer, ["1+2\n"], name="p", max_new_tokens=4, cache="prefix", block=4)
    assert meta["cache"] == "prefix"


def test_each_prompt_is_traced_once_and_none_is_an_evaluation_prompt(capsys):
    """A repeated prompt decodes to the same traces again, and the held-out split by prompt would
    hold copies of training prompts (toy-constraint has 39 distinct prompts: 512 draws of it had put
    half the held-out prompts in training too, and all of its evaluation prompts): the toy draws
    are distinct and outside the first 1,024 evaluation prompts, a task named twice is traced once,
    text prompts with the same token ids are traced once, and a repeat of ids is refused."""
    from dlmjax.evaluation.tasks import load_eval_set
    from dlmjax.presets import load_checkpoint
    from dlmjax.toy.tasks import get_task
    from dlmjax.traces import task_prompts, traces_for_prompts, traces_for_tasks
    from dlmjax.validation import InputError

    (_, constraint), (_, arith) = task_prompts(["toy-constraint", "toy-arith", "toy-arith"], 2048, seed=0)
    evaluated = {item.prompt for item in load_eval_set("toy-arith", limit=1024).items}
    assert constraint == []  # its 39 prompts are all among its first 1,024 evaluation prompts
    assert len(set(arith)) == len(arith) == 2048 and not set(arith) & evaluated
    draws = [ex.prompt for ex in get_task("toy-arith").generate(2200, 0)]
    assert len(set(draws[:2048]) & evaluated) == 24  # what the first draws would have traced
    assert arith == [p for p in dict.fromkeys(draws) if p not in evaluated][:2048]  # in order
    _, model, tokenizer, _ = load_checkpoint("toy-sdar")
    _, meta = traces_for_tasks(model, tokenizer, ["toy-constraint", "toy-arith"], per_task=2)
    assert meta["tasks"] == ["toy-arith"] and meta["num_prompts"] == 2 and list(meta["max_new_tokens"]) == ["toy-arith"]
    assert "toy-constraint: 0 distinct prompt(s) in 4096 draws" in capsys.readouterr().out
    with pytest.raises(TraceError, match="no prompts to trace"):
        traces_for_tasks(model, tokenizer, ["toy-constraint"], per_task=2)
    with pytest.raises(InputError, match="unknown task 'gsm8k'; valid tasks: toy-arith, toy-constraint"):
        task_prompts(["gsm8k"], 2, seed=0)
    _, meta = traces_for_prompts(model, tokenizer, ["12+7\u00e9\n", "12+7\u00df\n", "3+4\n", "5+1\n"], name="p",
                                 max_new_tokens=8, limit=3)  # the toy tokenizer reads both letters as its unknown token
    assert meta["num_prompts"] == 3 and "1 prompt(s) encode to the token ids of an earlier one" in capsys.readouterr().out
    ids = [tokenizer.encode(p) for p in ("3+4\n", "5+1\n", "3+4\n")]
    with pytest.raises(TraceError, match="prompt 2 repeats prompt 0"):
        collect_traces(model, ids, max_new_tokens=8)
