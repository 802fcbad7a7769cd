"""The DFlash drafter: config translation, strict errors, weights round trip, and parity of the
draft logits with an independent PyTorch reference (tests/drafter_reference.py)."""

from __future__ import annotations

import copy
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dlmjax
from dlmjax.config import ConfigError
from dlmjax.heads.drafter import (
    DrafterConfig, DrafterMismatchError, block_hidden, block_visibilities, context_features, default_target_layer_ids,
    init_drafter, visibilities,
)
from dlmjax.io.dflash import from_dflash_config, load_drafter, resolve_drafter, save_drafter, to_dflash_config
from dlmjax.io.safetensors import CheckpointError, SafetensorsFile, save_file
from drafter_reference import RefDrafter, draft_logits, target_pass
from tiny_models import randomize, torch_model

# A config.json as z-lab publishes it for Qwen3-8B (block 16).
QWEN3_8B_B16 = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.3",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

TARGET_LAYERS = 6
MASK_ID = 95


def tiny_drafter_config(num_layers=2, block_size=8, layer_types=None, sliding_window=None, ids=None) -> dict:
    raw = copy.deepcopy(QWEN3_8B_B16)
    raw.update(
        hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=96, num_target_layers=TARGET_LAYERS, block_size=block_size,
        rope_theta=10000.0, max_position_embeddings=512, max_window_layers=num_layers, dtype="float32",
        layer_types=layer_types or ["full_attention"] * num_layers, sliding_window=sliding_window,
        use_sliding_window=sliding_window is not None,
    )
    raw["dflash_config"] = {
        "mask_token_id": MASK_ID,
        "target_layer_ids": list(ids or default_target_layer_ids(TARGET_LAYERS, num_layers)),
    }
    return raw


def write_reference_drafter(path, raw: dict, seed: int = 0):
    """A random PyTorch reference drafter saved as a DFlash directory; returns the module."""
    torch.manual_seed(seed)
    ref = randomize(RefDrafter(raw), seed=seed, scale=0.3)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    save_file({k: v.numpy() for k, v in ref.state_dict().items()}, path / "model.safetensors", metadata={"format": "pt"})
    return ref


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Qwen3 target, in transformers and in dlmjax."""
    model = torch_model("qwen3", seed=3, num_hidden_layers=TARGET_LAYERS)
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)
    return model, dlmjax.load_model(path), path


# ----------------------------------------------------------------------------------------------
# config.json


def test_published_qwen3_8b_config_round_trips_unchanged():
    cfg = from_dflash_config(QWEN3_8B_B16)
    assert (cfg.num_layers, cfg.hidden_size, cfg.block_size, cfg.num_target_layers) == (5, 4096, 16, 36)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.mask_token_id == 151669
    assert cfg.rope_theta == 1e6 and cfg.dtype == "bfloat16" and cfg.layer_types == ("full_attention",) * 5
    assert to_dflash_config(cfg) == QWEN3_8B_B16
    assert json.dumps(to_dflash_config(cfg), sort_keys=True) == json.dumps(QWEN3_8B_B16, sort_keys=True)


def test_a_llama3_scaled_drafter_config_round_trips_and_a_changed_one_is_written_as_it_now_is():
    raw = {**copy.deepcopy(QWEN3_8B_B16), "rope_theta": 500000.0,
           "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 8192}}
    cfg = from_dflash_config(raw)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_positions) == ("llama3", 8.0, 8192)
    assert to_dflash_config(cfg) == raw
    new = to_dflash_config(cfg.replace(rope_factor=4.0))
    assert new["rope_scaling"] == {**raw["rope_scaling"], "factor": 4.0}
    assert from_dflash_config(new) == cfg.replace(rope_factor=4.0, hf_extra=from_dflash_config(new).hf_extra)
    plain = to_dflash_config(cfg.replace(rope_scaling="none"))
    assert (plain["rope_theta"], plain["rope_scaling"]) == (500000.0, None)


def test_dtype_and_torch_dtype_agree_and_are_written_as_the_drafter_is():
    """A config holding both keys (transformers 4 wrote torch_dtype, 5 writes dtype) must say one
    dtype; each key present is written with the dtype the drafter is saved in (one kept stale
    contradicted the weights)."""
    raw = {**tiny_drafter_config(), "torch_dtype": "float32"}
    cfg = from_dflash_config(raw)
    assert to_dflash_config(cfg) == raw
    written = to_dflash_config(cfg.replace(dtype="bfloat16"))
    assert (written["dtype"], written["torch_dtype"]) == ("bfloat16", "bfloat16")
    only_torch = {k: v for k, v in raw.items() if k != "dtype"}
    assert to_dflash_config(from_dflash_config(only_torch)) == only_torch  # the key it was read from
    with pytest.raises(ConfigError, match=r"`dtype` \('float32'\) and `torch_dtype` \('bfloat16'\) disagree"):
        from_dflash_config({**raw, "torch_dtype": "bfloat16"})


def test_block_size_inside_dflash_config_round_trips():
    """Newer z-lab drafters (Qwen3.5) keep block_size inside dflash_config only."""
    raw = copy.deepcopy(QWEN3_8B_B16)
    raw["dflash_config"]["block_size"] = raw.pop("block_size")
    cfg = from_dflash_config(raw)
    assert cfg.block_size == 16 and to_dflash_config(cfg) == raw


def test_default_target_layer_ids_and_always_written():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(32, 4) == (1, 10, 20, 29)
    # a small target: the spread repeats ids (the shipped 4-layer toy-ar under a 2-layer drafter)
    for layers, drafters in [(4, 2), (4, 3), (3, 2), (2, 2)]:
        with pytest.raises(ConfigError, match=r"default target_layer_ids for .* not distinct increasing layers; "
                                              r"name distinct ids .*drafter.target_layer_ids in a run config"):
            default_target_layer_ids(layers, drafters)
    raw = copy.deepcopy(QWEN3_8B_B16)
    del raw["dflash_config"]["target_layer_ids"]
    cfg = from_dflash_config(raw)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert to_dflash_config(cfg)["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    del raw["max_position_embeddings"]
    assert from_dflash_config(raw).max_position_embeddings == 32768  # transformers' Qwen3Config default


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.update(foo_bar=1), "foo_bar"),
        (lambda r: r.pop("num_target_layers"), "num_target_layers"),
        (lambda r: r["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda r: r["dflash_config"].update(extra=1), "extra"),
        (lambda r: r.update(architectures=["Qwen3ForCausalLM"]), "DFlashDraftModel"),
        (lambda r: r.update(rope_scaling={"type": "yarn", "factor": 4.0}),
         r"`rope_scaling` .*rope_type 'yarn' is not implemented \(default, linear and llama3 are\)"),
        (lambda r: r["dflash_config"].update(target_layer_ids=[9, 1]),
         r"must increase, each id once \(e.g. \[1, 9\]\)"),
        (lambda r: r["dflash_config"].update(target_layer_ids=[1, 1]), "must increase, each id once"),
        (lambda r: r["dflash_config"].update(target_layer_ids=[]), "target_layer_ids is empty"),
        # transformers drops the window without the switch (vLLM and SGLang then refuse the drafter)
        (lambda r: r.update(layer_types=["sliding_attention"], sliding_window=8), "use_sliding_window"),
        # values of the wrong type are refused by name (they were truncated: 0.9 read as layer 0)
        (lambda r: r["dflash_config"].update(target_layer_ids=[0.9, 1.9, 2.9]), r"target_layer_ids=\[0.9, 1.9, 2.9\] "
                                                                                 "must be layer numbers"),
        (lambda r: r["dflash_config"].update(target_layer_ids="0,1,2"), "target_layer_ids='0,1,2' must be a list"),
        (lambda r: r["dflash_config"].update(mask_token_id=95.9), r"mask_token_id=95.9 must be an integer"),
        (lambda r: r["dflash_config"].update(mask_token_id=True), r"mask_token_id=True must be an integer"),
        (lambda r: r["dflash_config"].update(mask_token_id=None), r"mask_token_id=None must be an integer"),
        (lambda r: r.update(block_size=4.5), r"block_size=4.5 must be an integer"),
        (lambda r: r.update(block_size="8"), r"block_size='8' must be an integer"),
        (lambda r: r.update(rms_norm_eps="1e-6"), r"rms_norm_eps='1e-6' must be a finite number"),
        (lambda r: r.update(num_target_layers="36"), r"`num_target_layers`='36' must be an integer"),
        (lambda r: r.update(num_key_value_heads=0), r"num_kv_heads=0 must be >= 1"),
        (lambda r: r.update(num_key_value_heads=5), r"num_attention_heads=32 is not a multiple of num_key_value_heads=5"),
        # SGLang reads these at the top level or inside dflash_config: the two places must agree
        (lambda r: r["dflash_config"].update(num_target_layers=35),
         r"num_target_layers 36 and dflash_config.num_target_layers 35 disagree"),
        (lambda r: r.update(target_layer_ids=[1, 9]), r"target_layer_ids \[1, 9\] and dflash_config.target_layer_ids "
                                                       r"\[1, 9, 17, 25, 33\] disagree"),
        (lambda r: r["dflash_config"].update(mask_token=""), r"mask_token='' must be a token's text"),
        (lambda r: r["dflash_config"].update(mask_token=5), r"mask_token=5 must be a token's text"),
    ],
)
def test_strict_config_errors_name_the_key(change, message):
    raw = copy.deepcopy(QWEN3_8B_B16)
    change(raw)
    with pytest.raises(ConfigError, match=message):
        from_dflash_config(raw)


def _move_into_dflash_config(*keys):
    def change(raw):
        raw["dflash_config"].update({key: raw.pop(key) for key in keys})
    return change


@pytest.mark.parametrize("change", [
    _move_into_dflash_config("num_target_layers", "block_size"),
    _move_into_dflash_config("block_size"),
    lambda r: r.update(target_layer_ids=r["dflash_config"].pop("target_layer_ids")),  # top level
    lambda r: r.update(target_layer_ids=list(r["dflash_config"]["target_layer_ids"])),  # both places
    lambda r: r["dflash_config"].update(num_target_layers=r["num_target_layers"], block_size=r["block_size"]),
    lambda r: r["dflash_config"].update(mask_token="<|MASK|>"),  # beside the id, which wins (as in vLLM and SGLang)
])
def test_sglang_config_forms_read_as_the_published_one_and_write_back_unchanged(change):
    """SGLang reads block_size, num_target_layers and target_layer_ids at the top level or inside
    dflash_config, and dflash_config.mask_token; dlmjax reads them alike and writes each key back
    where it stood."""
    raw = copy.deepcopy(QWEN3_8B_B16)
    change(raw)
    cfg = from_dflash_config(raw)
    assert cfg.replace(hf_extra=()) == from_dflash_config(QWEN3_8B_B16).replace(hf_extra=())
    assert to_dflash_config(cfg) == raw


def test_a_mask_token_named_by_text_takes_the_target_tokenizers_id(tmp_path):
    """Without dflash_config.mask_token_id the mask id is, as SGLang resolves it, the target
    tokenizer's id of dflash_config.mask_token (default <|MASK|>), or the id adding that token to
    the tokenizer gives; the id is written out explicitly (vLLM reads it nowhere else)."""
    from dlmjax.io.tokenizer import load_tokenizer
    from dlmjax.toy.tokenizer import save_char_tokenizer

    save_char_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    raw = tiny_drafter_config()
    raw["vocab_size"] = tokenizer.vocab_size + 4  # an embedding table with unused rows, as Qwen3's
    del raw["dflash_config"]["mask_token_id"]
    with pytest.raises(ConfigError, match=r"no `dflash_config.mask_token_id`, so the mask id is the target tokenizer's "
                                          r"for mask_token '<\|MASK\|>': load the drafter with its target"):
        from_dflash_config(raw)
    assert tokenizer.token_to_id("<|MASK|>") is None
    assert from_dflash_config(raw, tokenizer).mask_token_id == tokenizer.vocab_size  # added after the vocabulary
    raw["dflash_config"]["mask_token"] = "<|mask|>"
    cfg = from_dflash_config(raw, tokenizer)
    assert cfg.mask_token_id == tokenizer.mask_id
    assert to_dflash_config(cfg) == {**raw, "dflash_config": {**raw["dflash_config"], "mask_token_id": tokenizer.mask_id}}
    raw["dflash_config"]["mask_token"] = "<|MASK|>"
    raw["vocab_size"] = tokenizer.vocab_size
    with pytest.raises(ConfigError, match=rf"no token '<\|MASK\|>', and adding it would give id {tokenizer.vocab_size}, "
                                          rf"outside vocab_size {tokenizer.vocab_size}: set dflash_config.mask_token_id"):
        from_dflash_config(raw, tokenizer)


def test_incompatible_target_is_refused_with_both_values(target, tmp_path):
    _, ours, _ = target
    write_reference_drafter(tmp_path / "ok", tiny_drafter_config())
    load_drafter(tmp_path / "ok", ours.config)  # fits
    cases = [
        (dict(hidden_size=64, intermediate_size=64), r"hidden_size 64 != target hidden_size 32"),
        (dict(num_target_layers=8), r"num_target_layers 8 != target num_hidden_layers 6"),
        (dict(vocab_size=151936), r"vocab_size 151936 != target vocab_size 96"),
    ]
    broken = tiny_drafter_config()
    broken.pop("num_target_layers")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps(broken))
    with pytest.raises(ConfigError, match=f"drafter {tmp_path / 'broken' / 'config.json'} is missing required keys"):
        load_drafter(tmp_path / "broken", ours.config)  # the file named: a model, drafter and head have one each
    for i, (change, message) in enumerate(cases):
        raw = tiny_drafter_config()
        raw.update(change)
        (tmp_path / f"c{i}").mkdir()
        (tmp_path / f"c{i}" / "config.json").write_text(json.dumps(raw))
        with pytest.raises(DrafterMismatchError, match=message):
            load_drafter(tmp_path / f"c{i}", ours.config)
    cfg = from_dflash_config(tiny_drafter_config())
    from dlmjax.heads.drafter import check_compatible

    with pytest.raises(DrafterMismatchError, match=r"mask_token_id 200 is outside the target's vocab \(vocab_size 96\)"):
        check_compatible(cfg.replace(mask_token_id=200), ours.config)
    with pytest.raises(DrafterMismatchError, match=r"target_layer_ids \[6\] are out of range .* 6 layers"):
        check_compatible(cfg.replace(target_layer_ids=(1, 6)), ours.config)
    with pytest.raises(DrafterMismatchError, match="causal"):
        check_compatible(cfg, ours.config.replace(attention="bidirectional", family="llada"))


def test_drafter_decoder_without_a_drafter_is_a_clear_error(target, tmp_path):
    _, ours, path = target
    with pytest.raises(CheckpointError, match=r"no drafter|none in .*drafter; pass --drafter DIR"):
        resolve_drafter(path, ours.config)
    write_reference_drafter(tmp_path / "d", tiny_drafter_config())
    assert resolve_drafter(path, ours.config, tmp_path / "d").config.num_layers == 2


def test_wrong_fc_shape_is_a_clear_error(tmp_path):
    raw = tiny_drafter_config()
    write_reference_drafter(tmp_path, raw)
    raw["dflash_config"]["target_layer_ids"] = [1, 2, 3]  # fc now expects 3 x hidden inputs
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'fc.weight': checkpoint \(32, 64\), config expects \(32, 96\)"):
        load_drafter(tmp_path)


# ----------------------------------------------------------------------------------------------
# weights


def test_import_export_is_bit_exact(tmp_path):
    raw = tiny_drafter_config()
    raw["dtype"] = "bfloat16"
    write_reference_drafter(tmp_path / "src", tiny_drafter_config())
    src = SafetensorsFile(tmp_path / "src" / "model.safetensors")
    bf16 = {k: np.asarray(src.get(k)).astype(jnp.bfloat16) for k in src.keys()}
    save_file(bf16, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "src" / "config.json").write_text(json.dumps(raw))
    drafter = load_drafter(tmp_path / "src")
    save_drafter(drafter, tmp_path / "out")
    out = SafetensorsFile(tmp_path / "out" / "model.safetensors")
    assert sorted(out.keys()) == sorted(bf16)
    assert "embed_tokens.weight" not in out.keys() and "lm_head.weight" not in out.keys()
    for k, v in bf16.items():
        got = np.asarray(out.get(k))
        assert got.dtype == v.dtype and got.shape == v.shape
        assert got.tobytes() == v.tobytes(), k
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == raw


def test_fresh_drafter_saves_in_dflash_names(target, tmp_path):
    _, ours, _ = target
    cfg = DrafterConfig.for_target(ours.config, num_layers=2, block_size=4, mask_token_id=MASK_ID)
    save_drafter(init_drafter(cfg), tmp_path, dtype="bfloat16")
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["DFlashDraftModel"] and written["dtype"] == "bfloat16"
    assert written["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3]}
    names = set(SafetensorsFile(tmp_path / "model.safetensors").keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.mlp.gate_proj.weight"} <= names
    assert load_drafter(tmp_path, ours.config).config.replace(hf_extra=()) == cfg.replace(dtype="bfloat16", hf_extra=())


def test_saving_a_drafter_that_reads_the_targets_last_layer_warns_about_the_servers(target, tmp_path, caplog):
    """HF's hidden_states[N] (id N - 1) is final-normed; vLLM feeds that id the residual before the
    norm and SGLang refuses it: a drafter reading it is written with a warning saying so."""
    _, ours, _ = target
    cfg = DrafterConfig.for_target(ours.config, num_layers=1, block_size=4, mask_token_id=MASK_ID)
    last = ours.config.num_layers - 1
    with caplog.at_level("WARNING", logger="dlmjax.io.dflash"):
        save_drafter(init_drafter(cfg), tmp_path / "inner", dtype=None)
        assert not caplog.records
        save_drafter(init_drafter(cfg.replace(target_layer_ids=(1, last))), tmp_path / "last", dtype=None)
    assert f"target_layer_ids holds {last}, num_target_layers - 1" in caplog.text and "vLLM" in caplog.text


def test_a_drafter_for_a_llama3_scaled_target_takes_its_rope_and_saves_it_as_transformers_reads_it(target, tmp_path):
    from transformers import Qwen3Config

    _, ours, _ = target
    scaled = ours.config.replace(rope_theta=500000.0, rope_scaling="llama3", rope_factor=8.0,
                                 rope_original_max_positions=16)
    cfg = DrafterConfig.for_target(scaled, num_layers=2, block_size=4, mask_token_id=MASK_ID)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_positions) == ("llama3", 8.0, 16)
    save_drafter(init_drafter(cfg), tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    read = Qwen3Config(**{k: v for k, v in written.items() if k not in ("architectures", "dflash_config")})
    assert read.rope_parameters == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    assert load_drafter(tmp_path, scaled).config.replace(hf_extra=()) == cfg.replace(dtype="bfloat16", hf_extra=())


def test_sliding_window_layers_export_as_transformers_reads_them(target, tmp_path):
    """A drafter with sliding-window layers (made here, not imported) saves a config.json from
    which transformers' Qwen3Config, which vLLM and SGLang read, takes the same window and layers;
    and the window is read back the way transformers reads it (4096 when only switched on)."""
    from transformers import Qwen3Config

    _, ours, _ = target
    cfg = DrafterConfig.for_target(ours.config, num_layers=2, block_size=4, mask_token_id=MASK_ID,
                                   layer_types=("sliding_attention", "full_attention"), sliding_window=3)
    save_drafter(init_drafter(cfg), tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    read = Qwen3Config(**{k: v for k, v in written.items() if k not in ("architectures", "dflash_config")})
    assert (read.sliding_window, read.layer_types) == (3, ["sliding_attention", "full_attention"])
    assert load_drafter(tmp_path, ours.config).config.sliding_window == 3
    switched_on = {k: v for k, v in written.items() if k != "sliding_window"}
    assert from_dflash_config(switched_on).sliding_window == Qwen3Config(**{
        k: v for k, v in switched_on.items() if k not in ("architectures", "dflash_config")}).sliding_window == 4096


# ----------------------------------------------------------------------------------------------
# parity with the PyTorch reference


def _context_and_block(tm, layer_ids):
    """The reference target's features at `layer_ids` over a fixed random context [1, 11], and the
    block drafted after it: [its last token, MASK x 7]."""
    tokens = np.random.RandomState(0).randint(0, 90, (1, 11))
    _, feats = target_pass(tm, torch.from_numpy(tokens).long(), layer_ids)
    return feats, np.array([[int(tokens[0, -1])] + [MASK_ID] * 7])


def _dlmjax_draft_logits(drafter, target, feats_np, block_np):
    s, k = feats_np.shape[1], block_np.shape[1]
    ctx = drafter.context(jnp.asarray(feats_np))
    ctx_pos = jnp.arange(s, dtype=jnp.int32)[None]
    kv = drafter.context_kv(ctx, ctx_pos)
    positions = jnp.arange(s, s + k, dtype=jnp.int32)[None]
    hidden = block_hidden(drafter, target, jnp.asarray(block_np), positions, kv, ctx_pos, jnp.ones((1, s), bool))
    return np.asarray(target.lm_logits(hidden))


# a Llama 3.1 target's scaling, its context shrunk so that the tiny head dim's four wavelengths (6 to
# 6,283 positions) fall in all three of llama3's regimes: kept, blended and divided by the factor
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


@pytest.mark.parametrize(
    "layer_types, window, rope_scaling",
    [(None, None, None), (["sliding_attention", "full_attention"], 5, None), (None, None, LLAMA3_ROPE),
     (None, None, {"rope_type": "linear", "factor": 2.0})],
    ids=["full", "sliding", "llama3-rope", "linear-rope"],
)
def test_draft_logits_match_reference(target, tmp_path, layer_types, window, rope_scaling):
    tm, ours, _ = target
    raw = tiny_drafter_config(layer_types=layer_types, sliding_window=window)
    raw["rope_scaling"] = rope_scaling
    ref = write_reference_drafter(tmp_path, raw, seed=1)
    drafter = load_drafter(tmp_path, ours.config)
    feats, block = _context_and_block(tm, ref.ids)
    expected = draft_logits(ref, tm, feats, torch.from_numpy(block).long()).numpy()
    got = _dlmjax_draft_logits(drafter, ours, feats.numpy(), block)
    assert np.abs(got - expected).max() <= 1e-5
    assert np.abs(expected).max() > 0.1  # the logits are not trivially small


def test_a_shipped_mask_embedding_replaces_the_targets_row_as_vllm_reads_it(target, tmp_path):
    """A drafter directory with mask_embedding.pt (torch.save of {mask_token_id, embedding}, the
    embedding a row of a larger tensor, as trainers save it): its drafts use that embedding at mask
    positions, as the reference does; an export writes it back, and the servers' torch.load reads it."""
    tm, ours, _ = target
    ref = write_reference_drafter(tmp_path / "d", tiny_drafter_config(), seed=1)
    torch.manual_seed(5)
    table = torch.randn(4, 32).to(torch.bfloat16)
    torch.save({"mask_token_id": MASK_ID, "embedding": table[2]}, tmp_path / "d" / "mask_embedding.pt")
    shipped = RefDrafter.load(tmp_path / "d")
    drafter = load_drafter(tmp_path / "d", ours.config)
    feats, block = _context_and_block(tm, ref.ids)
    expected = draft_logits(shipped, tm, feats, torch.from_numpy(block).long()).numpy()
    got = _dlmjax_draft_logits(drafter, ours, feats.numpy(), block)
    assert np.abs(got - expected).max() <= 1e-5
    without = draft_logits(ref, tm, feats, torch.from_numpy(block).long()).numpy()
    assert np.abs(expected - without).max() > 0.1  # the embedding changes the drafts

    save_drafter(drafter, tmp_path / "out", dtype="bfloat16")
    written = torch.load(tmp_path / "out" / "mask_embedding.pt", weights_only=True)
    assert written["mask_token_id"] == MASK_ID and torch.equal(written["embedding"], table[2])
    again = load_drafter(tmp_path / "out", ours.config)
    np.testing.assert_array_equal(np.asarray(again.mask_embedding[...], np.float32), table[2].float().numpy())
    save_drafter(drafter, tmp_path / "kept", dtype=None)  # the drafter's own dtype, float32
    assert torch.load(tmp_path / "kept" / "mask_embedding.pt", weights_only=True)["embedding"].dtype == torch.float32


@pytest.mark.parametrize("shipped, message", [
    ({"mask_token_id": MASK_ID + 1, "embedding": torch.zeros(32)}, "is for mask_token_id 96, but config.json's"),
    ({"mask_token_id": torch.tensor(MASK_ID + 1), "embedding": torch.zeros(32)}, "is for mask_token_id 96, but"),
    ({"mask_token_id": MASK_ID}, r"keys \['mask_token_id'\]; a mask embedding file has `embedding`"),
    (torch.zeros(31), r"holds shape \(31,\); a mask embedding has hidden_size=32 values"),
], ids=["other-mask-id", "other-mask-id-tensor", "no-embedding", "wrong-size"])
def test_a_mask_embedding_for_another_drafter_is_refused(tmp_path, shipped, message):
    write_reference_drafter(tmp_path, tiny_drafter_config())
    torch.save(shipped, tmp_path / "mask_embedding.pt")
    with pytest.raises(CheckpointError, match=message):
        load_drafter(tmp_path)


@pytest.mark.parametrize("shipped", [{"mask_token_id": torch.tensor(MASK_ID), "embedding": torch.arange(32.0)},
                                     torch.nn.Parameter(torch.arange(32.0))], ids=["tensor-mask-id", "parameter"])
def test_a_mask_embedding_saved_as_torch_load_reads_it_loads(tmp_path, shipped):
    write_reference_drafter(tmp_path, tiny_drafter_config())
    torch.save(shipped, tmp_path / "mask_embedding.pt")
    drafter = load_drafter(tmp_path)
    np.testing.assert_array_equal(np.asarray(drafter.mask_embedding[...], np.float32), np.arange(32.0))


def test_block_visibilities_are_the_matrices_as_kernel_visibilities():
    """Decoding's visibilities come as `layers.Visibility` (what the flash kernels read), full and
    sliding-window layers alike, and each is the matrix `visibilities` gives: rows whose blocks
    start at different positions, context keys past the block start and invalid ones."""
    from dlmjax.models.layers import Visibility

    cfg = from_dflash_config(tiny_drafter_config(layer_types=["sliding_attention", "full_attention"], sliding_window=3))
    rng = np.random.default_rng(0)
    starts = jnp.asarray([[5], [9], [2]], jnp.int32)
    positions = starts + jnp.arange(4, dtype=jnp.int32)[None]
    ctx_pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (3, 12))
    ctx_valid = jnp.asarray(rng.random((3, 12)) > 0.2)
    ctx, blk = block_visibilities(cfg, positions, ctx_pos, ctx_valid)
    want_ctx, want_blk = visibilities(cfg, positions, jnp.zeros((3, 4), jnp.int32), ctx_pos,
                                      jnp.broadcast_to(starts, (3, 4)), ctx_valid)
    assert all(isinstance(v, Visibility) for v in ctx + blk) and ctx[0].window == 3 and ctx[1].window is None
    for got, want in zip(ctx + blk, want_ctx + want_blk):
        np.testing.assert_array_equal(got.matrix(), want)


def test_context_features_are_hf_hidden_states_id_plus_one(target, tmp_path):
    tm, ours, _ = target
    cfg = from_dflash_config(tiny_drafter_config(num_layers=3, ids=[0, 2, 5]))  # incl. the last layer
    tokens = np.random.RandomState(1).randint(0, 90, (1, 9))
    out = ours(jnp.asarray(tokens), hidden_layers=cfg.hidden_layers)
    got = np.asarray(context_features(ours, cfg, out.layer_hidden))
    _, expected = target_pass(tm, torch.from_numpy(tokens).long(), list(cfg.target_layer_ids))
    assert got.shape == (1, 9, 3 * 32)
    assert np.abs(got - expected.numpy()).max() <= 1e-5
