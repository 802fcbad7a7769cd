"""MRP decoders and heads: mrp-spec is lossless against static at batch 1 and N with trained and
random heads; the packed verification equals separate forwards; the head's own KV cache equals
a full forward; heads for another backbone are refused; the reference weight names round-trip."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dlmjax.decoding import engine
from dlmjax.decoding.api import generate
from dlmjax.decoding.mrp import MRPRemask, MRPSpec, head_copies
from dlmjax.decoding.spec import DecoderSpecError, parse_decoder
from dlmjax.evaluation.tasks import load_eval_set
from dlmjax.heads.mrp import (
    HEAD_FILE, HeadMismatchError, has_head, head_tensors, init_head, load_head, residual_logits, residual_step,
    save_head,
)
from dlmjax.io.hf import export_model, load_model
from dlmjax.io.safetensors import CheckpointError, SafetensorsFile, save_file
from dlmjax.io.tokenizer import load_tokenizer
from dlmjax.presets import resolve_model
from test_decoding import MAX_NEW, PROMPTS, peaky_model


@pytest.fixture(scope="module")
def toy():
    path = resolve_model("toy-sdar")
    model = load_model(path)
    return model, load_tokenizer(path, model.config), path


@pytest.fixture(scope="module")
def prompts():
    """Toy-task prompts of many lengths (so rows start inside their first block at every offset)."""
    arith = load_eval_set("toy-arith", limit=12).items
    constraint = load_eval_set("toy-constraint", limit=4).items
    return [item.prompt for item in arith + constraint]


def random_head(model, **kw):
    return init_head(model.config, num_layers=kw.pop("num_layers", 1), init_std=kw.pop("init_std", 0.02), **kw)


def decode_all(model, tokenizer, prompts, decoder, head, batch):
    rows = []
    for start in range(0, len(prompts), batch):
        rows += generate(model, prompts[start : start + batch], tokenizer=tokenizer, decoder=decoder,
                         max_new_tokens=16, head=head).rows
    return rows


@pytest.fixture(scope="module")
def static_rows(toy, prompts):
    model, tokenizer, _ = toy
    return decode_all(model, tokenizer, prompts, "static", None, 8)


@pytest.mark.parametrize("which", ["trained", "random"])
def test_spec_is_lossless_at_batch_1_and_8(toy, prompts, static_rows, which):
    model, tokenizer, path = toy
    head = load_head(path, model.config) if which == "trained" else random_head(model, seed=3)
    batched = decode_all(model, tokenizer, prompts, "mrp-spec:drafts=3", head, 8)
    assert [r.tokens for r in batched] == [r.tokens for r in static_rows]
    assert sum(r.nfe for r in batched) < sum(r.nfe for r in static_rows)  # the first draft is the backbone's own
    alone = decode_all(model, tokenizer, prompts[::8], "mrp-spec:drafts=3", head, 1)  # 2 prompts, batch 1
    assert [r.tokens for r in alone] == [r.tokens for r in static_rows[::8]]
    # Acceptance is per row, but not compared here: the toy model's confidences saturate at 1.0 in
    # fp32, so 1-ulp differences between batch shapes can reorder tied picks and move an acceptance.
    # The peaked backbone below has no such ties and checks per-row NFE at batch 1 and N.


def test_spec_is_lossless_on_a_peaked_random_backbone():
    """Another backbone, prompts at every offset in their block, drafts as deep as the block (deeper
    than the masked positions left in most rounds), chained modules."""
    model = peaky_model("sdar", seed=4)
    head = random_head(model, num_modules=2, num_layers=2, init_std=0.2, seed=1)
    static = generate(model, PROMPTS, decoder="static", max_new_tokens=MAX_NEW)
    spec = generate(model, PROMPTS, decoder="mrp-spec:drafts=4", max_new_tokens=MAX_NEW, head=head)
    assert [r.tokens for r in spec.rows] == [r.tokens for r in static.rows]
    alone = generate(model, [PROMPTS[2]], decoder="mrp-spec:drafts=4", max_new_tokens=MAX_NEW, head=head)
    assert alone.rows[0].tokens == spec.rows[2].tokens and alone.rows[0].nfe == spec.rows[2].nfe


@pytest.mark.parametrize("block, drafts", [(1, 1), (2, 2), (4, 3)])
def test_spec_never_takes_more_forwards_than_static(block, drafts):
    """Where a row's seed is exact (after the prefill and the forward that moved it to its block),
    draft 0 is the backbone's own pick and is committed at once, as static commits it: a block whose
    last mask it is moves on in that forward. Before, mrp-spec verified it, which at block 1 took
    twice static's forwards."""
    model = peaky_model("sdar", seed=4, block_size=block)
    head = random_head(model, num_modules=1, num_layers=1, init_std=0.2, seed=1)
    static = generate(model, PROMPTS, decoder="static", max_new_tokens=MAX_NEW)
    spec = generate(model, PROMPTS, decoder=f"mrp-spec:drafts={drafts}", max_new_tokens=MAX_NEW, head=head)
    assert [r.tokens for r in spec.rows] == [r.tokens for r in static.rows]
    assert all(s.nfe <= t.nfe for s, t in zip(spec.rows, static.rows)), ([r.nfe for r in spec.rows],
                                                                         [r.nfe for r in static.rows])


def test_trained_head_makes_direct_decoding_accurate(toy):
    """The shipped head earns its keep: on toy-constraint, two commits per forward from the head's
    corrected logits stay accurate where the same commits from uncorrected logits (a zero head) fail."""
    model, tokenizer, path = toy
    eval_set = load_eval_set("toy-constraint", limit=32)
    prompts = [item.prompt for item in eval_set.items]

    def accuracy(head):
        rows = decode_all(model, tokenizer, prompts, "mrp-direct:mrp_steps=1", head, 32)
        return sum(eval_set.score(eval_set.items, [r.text for r in rows])) / len(prompts)

    trained, zero = accuracy(load_head(path, model.config)), accuracy(random_head(model, init_std=0.0))
    assert trained >= zero + 0.3, (trained, zero)


def test_trained_head_remask_recovers_low_threshold_accuracy(toy):
    """At tau=0.2 threshold decoding commits conflicting digits together on toy-constraint; the
    shipped head, told what else commits this step, vetoes them (benchmarks/mrp_toy.py: 32.8% ->
    70.3% on 64 prompts)."""
    model, tokenizer, path = toy
    eval_set = load_eval_set("toy-constraint", limit=32)
    prompts = [item.prompt for item in eval_set.items]
    head = load_head(path, model.config)

    def accuracy(decoder):
        rows = decode_all(model, tokenizer, prompts, decoder, head, 32)
        return sum(eval_set.score(eval_set.items, [r.text for r in rows])) / len(prompts)

    threshold, remask = accuracy("threshold:tau=0.2"), accuracy("mrp-remask:tau=0.2,delta=1")
    assert remask >= threshold + 0.2, (threshold, remask)


def test_packed_verification_equals_separate_forwards(toy, prompts):
    """The spec round's drafts+1 copies verified in one forward = one step forward per copy (and the
    same for the head's packed forward)."""
    model, tokenizer, _ = toy
    head = random_head(model, seed=5)
    ids = [tokenizer.encode(p) for p in prompts[:4]]
    cfg = model.config
    geometry, canvas, rows = engine.plan_layout(ids, block=cfg.block_size, max_new_tokens=16, block_causal=True,
                                                pad_id=cfg.pad_token_id, mask_id=cfg.mask_token_id)
    fwd = engine.BlockForwards(model, rows, geometry, "exact", cfg.mask_token_id, head)
    canvas = jnp.asarray(canvas)
    state = engine.start(fwd, canvas)
    block, cache, head_cache, logits, hidden = state.block, state.cache, state.head_cache, state.logits, state.hidden
    copies = MRPSpec(drafts=4).draft(fwd, state, fwd.block_tokens(canvas, block))
    assert copies.shape[1] == 5 and bool(jnp.any(copies[:, 4] != copies[:, 0]))
    packed_logits, packed_hidden = fwd.verify(canvas, copies, cache, block)
    for k in range(5):
        canvas_k = jax.lax.dynamic_update_slice_in_dim(canvas, copies[:, k], geometry.prefix, axis=1)
        logits_k, hidden_k = fwd.step(canvas_k, cache, block)
        np.testing.assert_allclose(packed_logits[:, k], logits_k, rtol=1e-5, atol=1e-5)  # logits reach ~15
        # fp32 rounding of differently shaped matmuls (the fused qkv one too): up to ~1.1e-5 on CPU
        np.testing.assert_allclose(packed_hidden[:, k], hidden_k, rtol=1e-5, atol=3e-5)
    # The head's packed forward over the same copies (mrp-remask's) = one unpacked head step per copy.
    packed_residual = residual_logits(head, model, head_copies(fwd, 0, copies, hidden, head_cache, block))
    positions = jnp.asarray(rows.positions)[:, geometry.prefix : geometry.prefix + cfg.block_size]
    valid = jnp.asarray(rows.valid)[:, geometry.prefix : geometry.prefix + cfg.block_size]
    for k in range(5):
        residual_k = residual_step(head, model, 0, copies[:, k], hidden, logits, positions, valid_bl=valid,
                                   cache=head_cache[0])[2]
        np.testing.assert_allclose(packed_residual[:, k], residual_k, rtol=1e-5, atol=1e-5)


def test_head_kv_cache_equals_a_full_forward():
    """Head over block b against its cache of blocks < b = the head over the whole sequence."""
    model = peaky_model("sdar", seed=6)
    head = random_head(model, num_layers=2, init_std=0.2, seed=2)
    tokens = jnp.asarray([[5, 6, 7, 8, 9, 10, 11, 12, 3, 3, 14, 3]], jnp.int32)
    positions = jnp.arange(12, dtype=jnp.int32)[None]
    out = model(tokens, positions)
    full, full_hidden, _ = residual_step(head, model, 0, tokens, out.hidden, out.logits, positions)
    empty, start = head.empty_caches(1, 16), jnp.zeros((1,), jnp.int32)
    chunks = head.context_chunks(model, empty, tokens[:, :8], out.hidden[:, :8], positions[:, :8],
                                 jnp.ones((1, 8), bool), start)
    caches = tuple(cache.put_chunk(chunk, start) for cache, chunk in zip(empty, chunks))
    part, part_hidden, _ = residual_step(head, model, 0, tokens[:, 8:], out.hidden[:, 8:], out.logits[:, 8:],
                                         positions[:, 8:], cache=caches[0])
    np.testing.assert_allclose(part, full[:, 8:], atol=1e-4)
    np.testing.assert_allclose(part_hidden, full_hidden[:, 8:], atol=1e-5)


def test_direct_without_head_steps_is_static_and_with_them_commits_more(toy, prompts, static_rows):
    model, tokenizer, _ = toy
    head = random_head(model, num_modules=2, seed=7)
    static = static_rows
    zero = decode_all(model, tokenizer, prompts, "mrp-direct:mrp_steps=0", head, 16)
    assert [r.tokens for r in zero] == [r.tokens for r in static]
    three = decode_all(model, tokenizer, prompts, "mrp-direct:mrp_steps=3", head, 16)
    assert sum(r.nfe for r in three) < sum(r.nfe for r in static) / 2


def test_remask_without_vetoes_is_threshold_decoding(toy, prompts):
    model, tokenizer, path = toy
    head = load_head(path, model.config)
    threshold = decode_all(model, tokenizer, prompts, "threshold:tau=0.5", None, 16)
    no_veto = decode_all(model, tokenizer, prompts, "mrp-remask:tau=0.5,delta=1e9,rule=residual", head, 16)
    assert [r.tokens for r in no_veto] == [r.tokens for r in threshold]


def test_remask_veto_rules():
    """Position 0: small residual, stays confident. 1: large residual. 2: the residual drops its
    confidence below tau. 3: not proposed."""
    size = jnp.asarray([[0.1, 3.0, 0.5, 0.0]])  # |C| at each proposed token
    post = jnp.asarray([[0.96, 0.99, 0.6, 0.5]])  # the token's probability under logits + C
    proposed = jnp.asarray([[True, True, True, False]])
    keep = {rule: MRPRemask(tau=0.9, delta=1.0, rule=rule).vetoed(proposed, size, post)
            for rule in ("residual", "confidence", "both")}
    assert keep["residual"].tolist() == [[True, False, True, False]]
    assert keep["confidence"].tolist() == [[True, True, False, False]]
    assert keep["both"].tolist() == [[True, False, False, False]]
    # every proposal vetoed: the one with the smallest |C| stays
    kept = MRPRemask(tau=0.9, delta=1.0, rule="residual").vetoed(proposed, size.at[0, 0].set(2.0), post)
    assert kept.tolist() == [[False, False, True, False]]


def test_head_for_another_backbone_is_refused(toy, tmp_path):
    model, tokenizer, _ = toy
    other_hidden = peaky_model("sdar", seed=1)  # hidden 32, vocab 64: neither matches toy-sdar
    with pytest.raises(HeadMismatchError, match="hidden_size"):
        generate(model, ["1+2="], tokenizer=tokenizer, decoder="mrp-spec", head=random_head(other_hidden))
    wider_vocab = init_head(model.config.replace(vocab_size=model.config.vocab_size + 8), num_layers=1)
    with pytest.raises(HeadMismatchError, match="vocab_size"):
        generate(model, ["1+2="], tokenizer=tokenizer, decoder="mrp-direct", head=wider_vocab)
    with pytest.raises(DecoderSpecError, match="needs an MRP head"):
        generate(model, ["1+2="], tokenizer=tokenizer, decoder="mrp-remask")
    with pytest.raises(DecoderSpecError, match="greedy"):
        parse_decoder("mrp-spec:temperature=0.7")
    for options in ("top_p=0.5", "sampled_scores=true"):  # options of sampling, which they never do
        for decoder in ("mrp-spec", "mrp-direct"):
            with pytest.raises(DecoderSpecError, match="top_p and sampled_scores shape sampling"):
                parse_decoder(f"{decoder}:{options}")
    # the default decoders of `dlmjax eval` fit any block (PSD's depth, the drafts, mrp-direct's steps)
    from dlmjax.decoding.api import _block_size
    from dlmjax.evaluation.runner import default_decoders

    for small in (1, 2):
        small_model = peaky_model("sdar", block_size=small)
        for spec in default_decoders(small_model, head=random_head(small_model)):
            assert _block_size(parse_decoder(spec), small_model) == small, spec
    with pytest.raises(DecoderSpecError, match="head_input='post'; choose one of others, pre"):
        parse_decoder("mrp-remask:head_input=post")
    block = model.config.block_size  # a forward's commits past the block only cost time
    with pytest.raises(DecoderSpecError, match=f"drafts={block + 1} cannot fit a block of {block} tokens"):
        generate(model, ["1+2="], tokenizer=tokenizer, decoder=f"mrp-spec:drafts={block + 1}", head=random_head(model))
    with pytest.raises(DecoderSpecError, match=f"mrp_steps={block} cannot fit .* choose mrp_steps <= {block - 1}"):
        generate(model, ["1+2="], tokenizer=tokenizer, decoder=f"mrp-direct:mrp_steps={block}", head=random_head(model))
    # a head stored beside another backbone refuses to load for this one
    export_model(other_hidden, tmp_path / "other")
    save_head(random_head(other_hidden), tmp_path / "other")
    with pytest.raises(HeadMismatchError, match="hidden_size"):
        load_head(tmp_path / "other", model.config)


def test_a_head_loads_from_a_preset_name_and_a_missing_directory_is_named(toy, tmp_path):
    model, _, path = toy
    assert load_head("toy-sdar", model.config).config == load_head(path, model.config).config
    with pytest.raises(CheckpointError, match="is not a directory; pass a checkpoint directory or a preset name"):
        load_head(tmp_path / "nowhere", model.config)


def test_reference_names_round_trip_through_a_checkpoint_dir(toy, tmp_path):
    model, _, path = toy
    head = random_head(model, num_modules=2, num_layers=2, residual_scale=0.5, seed=9)
    out = export_model(model, tmp_path / "ckpt", files_from=path)
    assert not has_head(out)
    with pytest.raises(CheckpointError, match="no MRP head"):
        load_head(out)
    save_head(head, out)
    names = SafetensorsFile(out / HEAD_FILE).keys()
    d = model.config.hidden_size
    for name in ("mrp_modules.1.model.enorm.weight", "mrp_modules.1.model.hnorm.weight",
                 "mrp_modules.0.model.eh_proj.weight", "mrp_modules.1.model.layers.1.self_attn.q_proj.weight",
                 "mrp_modules.0.model.layers.0.mlp.down_proj.weight", "mrp_modules.0.model.norm.weight"):
        assert name in names
    assert SafetensorsFile(out / HEAD_FILE).get("mrp_modules.0.model.eh_proj.weight").shape == (d, 2 * d)  # torch [out, in]
    loaded = load_head(out, model.config)
    assert loaded.config == head.config
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(head)), nnx.to_flat_state(nnx.state(loaded))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(p))
    assert set(head_tensors(loaded)) == set(names)
    load_model(out)  # the backbone still loads from the directory that now also holds the head
    # config.json states the head's shape (the reference code's SDARMRPConfig keys), so a head of
    # another shape saved over it loads, and the reference code builds as many layers
    config = json.loads((out / "config.json").read_text())
    assert (config["num_mrp_heads"], config["num_nextn_predict_layers"], config["mrp_residual_scale"]) == (2, 2, 0.5)
    save_head(random_head(model, num_modules=1, num_layers=3, seed=2), out)
    assert (load_head(out, model.config).config.num_modules, load_head(out, model.config).config.num_layers) == (1, 3)
    for bad in (None, "2", float("nan")):
        (out / "config.json").write_text(json.dumps({**config, "num_mrp_heads": 1, "num_nextn_predict_layers": 3,
                                                     "mrp_residual_scale": bad}))
        with pytest.raises(CheckpointError, match="mrp_residual_scale=.* must be a finite number"):
            load_head(out, model.config)


@pytest.mark.parametrize("preset", ["random-sdar-moe", "random-llada2-moe"])
def test_a_head_saved_beside_another_block_causal_family_loads_with_it(preset, tmp_path):
    """MRP heads train on any block-causal backbone; the head's shape keys are SDAR's config keys,
    which another family's config.json refuses (LLaDA2 reads num_nextn_predict_layers as its own
    MTP layers), so they are written for SDAR alone: the directory stayed unloadable."""
    from dlmjax.presets import load_checkpoint

    path, model, _, _ = load_checkpoint(preset)
    out = export_model(model, tmp_path / "ckpt", files_from=path)
    save_head(random_head(model, num_modules=1, num_layers=2, seed=3), out)
    config = json.loads((out / "config.json").read_text())
    assert "num_mrp_heads" not in config and config.get("num_nextn_predict_layers") in (None, 0)  # LLaDA2 writes 0
    load_model(out)
    assert load_head(out, model.config).config.num_layers == 2


def test_a_head_inside_the_model_shards_is_not_saved_over_but_refused(toy, tmp_path):
    """The reference code's layout: the head's tensors in model.safetensors. A second copy in
    mrp_head.safetensors made the directory unloadable (duplicate tensors)."""
    model, _, path = toy
    out = export_model(model, tmp_path / "ckpt", files_from=path)
    shard = SafetensorsFile(out / "model.safetensors")
    together = {n: np.array(shard.get(n)) for n in shard.keys()}
    together.update(head_tensors(random_head(model, seed=1)))
    (out / "model.safetensors").unlink()
    save_file(together, out / "model.safetensors", metadata={"format": "pt"})
    assert load_head(out, model.config).config.num_layers == 1
    with pytest.raises(CheckpointError, match="holds a head inside its model shards .*dlmjax export"):
        save_head(random_head(model, seed=2), out)
    load_model(out)  # untouched


def test_mrp_decoders_run_on_an_moe_backbone():
    """The head's own layers are dense: its KV cache used to take the backbone's expert layers and
    fail validation (SDAR-30B-A3B)."""
    import dlmjax

    cfg = dlmjax.ModelConfig(family="sdar_moe", vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=8, attention="block_causal", block_size=4,
                             qk_norm=True, mask_token_id=39, eos_token_ids=(38,), pad_token_id=0,
                             max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, moe_layers=(0, 1), norm_topk_prob=True)
    model = dlmjax.init_model(cfg, seed=0)
    head = random_head(model, seed=1)
    static = generate(model, [[1, 2, 3], [4, 5]], decoder="static", max_new_tokens=8)
    spec = generate(model, [[1, 2, 3], [4, 5]], decoder="mrp-spec:drafts=3", max_new_tokens=8, head=head)
    assert [r.tokens for r in spec.rows] == [r.tokens for r in static.rows]


@functools.partial(nnx.jit, static_argnames=("lo", "hi", "mask"))
def remask_step(model, head, seq_1l, *, lo: int, hi: int, mask: int):
    """One step of `reference_remask` as one program: the block's probabilities (the mask token
    excluded) and the head's residual on each position's argmax, read from the pre-commit block."""
    from dlmjax.heads.mrp import head_output

    out = model(seq_1l)
    probs = jax.nn.softmax(out.logits[0, lo:hi].astype(jnp.float32).at[:, mask].set(-jnp.inf), axis=-1)
    h_p = head_output(head, model, 0, seq_1l[:, lo:hi], out.hidden[:, lo:hi], jnp.arange(lo, hi, dtype=jnp.int32)[None])
    return probs, head.config.residual_scale * model.token_logits(h_p, jnp.argmax(probs, axis=-1)[None])


def reference_remask(model, head, prompt, *, tau, delta, max_new):
    """(tokens, forwards, vetoes) of the reference code's remask (`_generate_residual_remask`: the
    residual rule, the head reading the pre-commit block alone), written as a plain loop: no
    cache, one full backbone forward per step."""
    cfg = model.config
    block, mask, eos = cfg.block_size, cfg.mask_token_id, set(cfg.eos_token_ids)
    start = (len(prompt) // block) * block
    num_blocks = -(-(len(prompt) - start + max_new) // block)
    seq = list(prompt) + [mask] * (start + num_blocks * block - len(prompt))
    forwards = vetoes = 0
    for b in range(num_blocks):
        lo, hi = start + b * block, start + (b + 1) * block
        while mask in seq[lo:hi]:
            probs, residual = remask_step(model, head, jnp.asarray([seq[:hi]], jnp.int32), lo=lo, hi=hi, mask=mask)
            forwards += 1
            probs = np.asarray(probs)
            tokens, conf = probs.argmax(-1), probs.max(-1)
            masked = np.asarray(seq[lo:hi]) == mask
            size = np.abs(np.asarray(residual)[0])
            proposed = masked & (conf > tau)
            kept = proposed & (size <= delta)
            if proposed.any() and not kept.any():
                kept[np.argmin(np.where(proposed, size, np.inf))] = True
            if not kept.any():
                kept[np.argmax(np.where(masked, conf, -1.0))] = True
            vetoes += int(proposed.sum() - kept[proposed].sum())
            for j in np.flatnonzero(kept):
                seq[lo + j] = int(tokens[j])
        if eos & set(seq[len(prompt):hi]):
            break
    out = seq[len(prompt): len(prompt) + max_new]
    cut = min((i for i, t in enumerate(out) if t in eos), default=len(out) - 1)
    return out[: cut + 1], forwards, vetoes


def test_remask_as_the_reference_code_runs_it_equals_a_plain_loop(toy, prompts):
    """`mrp-remask:rule=residual,head_input=pre,head_context=block` is the reference code's remask:
    tokens and per-row forwards equal a no-cache loop of it (batch and alone), with vetoes."""
    model, tokenizer, path = toy
    head = load_head(path, model.config)
    tau, delta, max_new = 0.3, 0.5, 16
    spec = f"mrp-remask:tau={tau},delta={delta},rule=residual,head_input=pre,head_context=block"
    ids = [tokenizer.encode(p) for p in prompts]
    together = generate(model, ids, decoder=spec, head=head, max_new_tokens=max_new)
    total_vetoes = 0
    for i, prompt in enumerate(ids):
        tokens, forwards, vetoes = reference_remask(model, head, prompt, tau=tau, delta=delta, max_new=max_new)
        total_vetoes += vetoes
        assert (together.rows[i].tokens, together.rows[i].nfe) == (tokens, forwards), i
    assert total_vetoes > 0, "no proposal was vetoed: the test is vacuous"
    alone = generate(model, [ids[1]], decoder=spec, head=head, max_new_tokens=max_new).rows[0]
    assert (alone.tokens, alone.nfe) == (together.rows[1].tokens, together.rows[1].nfe)
    # the default reads the head's cache of the earlier blocks: other vetoes (here the same tokens
    # after more or fewer forwards)
    cached = generate(model, ids, decoder=spec.replace("head_context=block", "head_context=cache"), head=head,
                      max_new_tokens=max_new)
    assert [r.nfe for r in cached.rows] != [r.nfe for r in together.rows]
