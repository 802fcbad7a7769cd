"""MoE families against their PyTorch references: Qwen3-MoE (transformers), SDAR-MoE, LLaDA-MoE and
LLaDA2 (tests/moe_reference.py, built from transformers components); weight layouts in and out;
strict config translation."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import dlmjax
from dlmjax.config import ConfigError, ModelConfig, from_hf_config, to_hf_config
from dlmjax.decoding.api import generate
from dlmjax.io.safetensors import CheckpointError, SafetensorsFile
from tiny_models import random_tokens, randomize, state_dict_numpy, torch_logits, write_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-5
QWEN3_MOE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                 mlp_only_layers=[1], rope_theta=10000.0)


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def qwen3_moe_model(norm_topk_prob: bool, seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**QWEN3_MOE, norm_topk_prob=norm_topk_prob, attn_implementation="eager",
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return randomize(Qwen3MoeForCausalLM(config), seed)


def per_expert_tensors(state: dict) -> dict:
    """transformers 5's fused experts -> the published per-expert layout of Qwen3-MoE checkpoints."""
    out = {}
    for name, value in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, width = name[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = value[e, :width]
                out[f"{prefix}{e}.up_proj.weight"] = value[e, width:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(value.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = value[e]
        else:
            out[name] = value
    return out


def qwen3_moe_config_json(norm_topk_prob: bool) -> dict:
    return dict(QWEN3_MOE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                norm_topk_prob=norm_topk_prob, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "raw_topk"])
def qwen3_moe(request, tmp_path_factory):
    model = qwen3_moe_model(request.param, seed=int(request.param))
    state = state_dict_numpy(model)
    root = tmp_path_factory.mktemp("qwen3moe")
    fused = write_checkpoint(root / "fused", qwen3_moe_config_json(request.param), state)
    published = write_checkpoint(root / "per_expert", qwen3_moe_config_json(request.param), per_expert_tensors(state))
    return model, fused, published


def test_qwen3_moe_logits_equal_transformers_from_either_layout(qwen3_moe):
    model, fused, published = qwen3_moe
    tokens = random_tokens(2, 10)
    expected = torch_logits(model, tokens)
    for path in (fused, published):
        ours = dlmjax.load_model(path)
        assert ours.config.moe_layers == (0, 2), "mlp_only_layers=[1] keeps layer 1 dense"
        assert max_diff(ours(jnp.asarray(tokens)).logits, expected) <= TOL


def test_qwen3_moe_export_is_per_expert_and_transformers_loads_it(qwen3_moe, tmp_path):
    model, fused, _ = qwen3_moe
    out = dlmjax.export_model(dlmjax.load_model(fused), tmp_path / "export")
    names = set(SafetensorsFile(out / "model.safetensors").keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names and "model.layers.1.mlp.gate_proj.weight" in names
    assert not any(n.endswith("gate_up_proj") for n in names)
    config = json.loads((out / "config.json").read_text())
    assert config["mlp_only_layers"] == [1] and config["num_experts"] == 8
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = random_tokens(1, 9, seed=3)
    assert max_diff(torch_logits(reloaded, tokens), torch_logits(model, tokens)) <= TOL
    assert from_hf_config(config) == dlmjax.load_model(fused).config


def test_a_bf16_moe_checkpoint_exports_bitwise_in_bf16(qwen3_moe, tmp_path):
    """The softmax router is kept in float32 and used in the activations' dtype: a bf16 checkpoint
    exports its gate in bf16 again (it came back float32, every tensor else bf16)."""
    import ml_dtypes

    _, fused, _ = qwen3_moe
    source = SafetensorsFile(fused / "model.safetensors")
    bf16 = {name: source.get(name).astype(ml_dtypes.bfloat16) for name in source.keys()}
    config = {**json.loads((fused / "config.json").read_text()), "torch_dtype": "bfloat16"}
    original = write_checkpoint(tmp_path / "bf16", config, bf16)
    exported = SafetensorsFile(dlmjax.export_model(dlmjax.load_model(original), tmp_path / "out") / "model.safetensors")
    again = SafetensorsFile(dlmjax.export_model(dlmjax.load_model(tmp_path / "out"), tmp_path / "again")
                            / "model.safetensors")
    gates = [name for name in exported.keys() if name.endswith("mlp.gate.weight")]
    assert gates and all(exported.get(name).dtype == ml_dtypes.bfloat16 for name in exported.keys())
    for name in gates:
        np.testing.assert_array_equal(exported.get(name), bf16[name])
    assert all(np.array_equal(exported.get(n).view(np.uint16), again.get(n).view(np.uint16)) for n in exported.keys())


def test_qwen3_moe_reads_both_spellings_of_experts_and_rope():
    base = qwen3_moe_config_json(True)
    new_style = {k: v for k, v in base.items() if k not in ("num_experts", "rope_theta")}
    new_style.update(num_local_experts=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert from_hf_config(new_style) == from_hf_config(base)
    with pytest.raises(ConfigError, match="keep one of them"):
        from_hf_config({**base, "num_local_experts": 4})


def test_qwen3_coders_published_keys_load_as_the_model_they_describe():
    """Qwen3-Coder-30B-A3B's config.json carries qkv_bias, shared_expert_intermediate_size and
    use_qk_norm, which no Qwen3-MoE modeling code reads: at those values they load (they were
    refused as unknown keys), as the same model; absent counts take Qwen3MoeConfig's defaults."""
    base = qwen3_moe_config_json(True)
    coder = {**base, "qkv_bias": False, "shared_expert_intermediate_size": 0, "use_qk_norm": True}
    assert from_hf_config(coder) == from_hf_config(base)
    stripped = {k: v for k, v in base.items() if k not in ("num_key_value_heads", "max_position_embeddings")}
    cfg = from_hf_config({**stripped, "num_attention_heads": 8})
    assert (cfg.num_kv_heads, cfg.max_position_embeddings) == (4, 32768)


@pytest.mark.parametrize("change, message", [
    (dict(shared_expert_intermediate_size=8), r"`shared_expert_intermediate_size` = 8 \(Qwen3-MoE has no shared"),
    (dict(use_qk_norm=False), r"`use_qk_norm` = False \(Qwen3-MoE always normalises q and k\)"),
    (dict(qkv_bias=True), r"`qkv_bias` = True \(Qwen3-MoE has no q/k/v biases\)"),
    (dict(use_sliding_window=True, sliding_window=4, max_window_layers=48), "transformers 4 and 5 disagree"),
    (dict(num_experts_per_tok=9), "cannot pick more experts"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob"),
    (dict(mlp_only_layers="1"), "list of integers"),
])
def test_qwen3_moe_config_translation_is_strict(change, message):
    with pytest.raises(ConfigError, match=message):
        from_hf_config({**qwen3_moe_config_json(True), **change})


def test_qwen3_moe_config_problems_come_in_one_error():
    """A value Qwen3-MoE cannot take and a key no family reads are named together, so that one
    round of edits to config.json fixes both."""
    raw = {**qwen3_moe_config_json(True), "qkv_bias": True, "moe_capacity_factor": 1.25}
    with pytest.raises(ConfigError, match=r"unknown config keys \['moe_capacity_factor'\].*`qkv_bias` = True"):
        from_hf_config(raw)


def _moe_raw_configs() -> dict:
    return {"qwen3_moe": qwen3_moe_config_json(True), "llada_moe": llada_moe_config_json(LLADA_MOE),
            "llada2_moe": llada2_config_json(LLADA2)}


@pytest.mark.parametrize("family, key", [
    ("qwen3_moe", "num_experts"), ("qwen3_moe", "num_experts_per_tok"), ("qwen3_moe", "moe_intermediate_size"),
    ("qwen3_moe", "decoder_sparse_step"), ("llada_moe", "num_experts"), ("llada_moe", "num_experts_per_tok"),
    ("llada_moe", "expert_intermediate_size"), ("llada_moe", "dense_intermediate_size"),
    ("llada2_moe", "num_experts"), ("llada2_moe", "num_experts_per_tok"), ("llada2_moe", "moe_intermediate_size"),
    ("llada2_moe", "first_k_dense_replace"), ("llada2_moe", "intermediate_size"),
    ("llada2_moe", "routed_scaling_factor"),
])
def test_moe_config_nulls_and_bools_are_refused_by_name(family, key):
    """A null count or width is not taken as a default (nor crashes), and `true` is not the integer 1."""
    raw = _moe_raw_configs()[family]
    assert key in raw or key in ("decoder_sparse_step", "first_k_dense_replace", "routed_scaling_factor")
    with pytest.raises(ConfigError, match=f"config.json `{key}`"):
        from_hf_config({**raw, key: None})
    with pytest.raises(ConfigError, match=f"config.json `{key}`=True must be"):
        from_hf_config({**raw, key: True})


def test_moe_layer_lists_are_checked_and_all_dense_is_refused_in_config_json_terms():
    """moe_layer_freq 0, [] or odd entries used to load as MoE layers; experts in no layer were
    refused with ModelConfig's field name, which no config.json has."""
    raw = _moe_raw_configs()
    layers = raw["llada_moe"]["num_hidden_layers"]
    for freq in (0, [], ["dense"] * layers, [2] * layers, [0.5] * layers):
        with pytest.raises(ConfigError, match=r"`moe_layer_freq` = .* must list one 0 \(dense\) or 1"):
            from_hf_config({**raw["llada_moe"], "moe_layer_freq": freq})
    assert from_hf_config({**raw["llada_moe"], "moe_layer_freq": [0] + [1] * (layers - 1)}).moe_layers[0] == 1
    all_dense = [("llada_moe", {"moe_layer_freq": [0] * layers}, "moe_layer_freq"),
                 ("qwen3_moe", {"mlp_only_layers": list(range(raw["qwen3_moe"]["num_hidden_layers"]))},
                  "mlp_only_layers, decoder_sparse_step"),
                 ("qwen3_moe", {"decoder_sparse_step": 99}, "mlp_only_layers, decoder_sparse_step"),
                 ("llada2_moe", {"first_k_dense_replace": 99}, "first_k_dense_replace")]
    for family, change, keys in all_dense:
        with pytest.raises(ConfigError, match=f"makes no layer a mixture of experts \\({keys}\\).*keep at least one"):
            from_hf_config({**raw[family], **change})


def test_moe_config_bools_must_be_true_or_false():
    for family, key in [("llada_moe", "attention_bias"), ("llada_moe", "qk_layernorm"), ("llada2_moe", "use_qkv_bias"),
                        ("llada2_moe", "use_bias")]:
        with pytest.raises(ConfigError, match=f"config.json `{key}`=2 must be true or false"):
            from_hf_config({**_moe_raw_configs()[family], key: 2})


def test_llada_moe_absent_qk_layernorm_means_no_norm():
    """modeling_lladamoe.py builds q/k norms only where the config sets qk_layernorm: a config.json
    without the key has none."""
    absent = {k: v for k, v in _moe_raw_configs()["llada_moe"].items() if k != "qk_layernorm"}
    assert not from_hf_config(absent).qk_norm
    assert from_hf_config({**absent, "qk_layernorm": True}).qk_norm


def test_a_llada_moe_config_saved_as_model_type_lladamoe_reads_as_the_published_one():
    """ZHZisZZ/dllm's LLaDA-MoE config class saves model_type "lladamoe" (it was refused)."""
    published = _moe_raw_configs()["llada_moe"]
    assert published["model_type"] == "llada"
    assert from_hf_config({**published, "model_type": "lladamoe"}) == from_hf_config(published)


def test_llada2_absent_group_keys_take_the_authors_defaults():
    """LLaDA2MoeConfig (inclusionAI's dInfer and dFactory) defaults to n_group 8 and topk_group 4: a
    config.json without them routes group-limited there, so it does here."""
    config = {**llada2_config_json({**LLADA2, "experts": 16, "top_k": 4}), "moe_intermediate_size": 8}
    absent = {k: v for k, v in config.items() if k not in ("n_group", "topk_group")}
    cfg = from_hf_config(absent)
    assert (cfg.router_groups, cfg.router_topk_groups) == (8, 4)
    assert from_hf_config(to_hf_config(cfg)) == cfg


@pytest.mark.parametrize("preset, change", [
    ("random-qwen3-moe", dict(router="sigmoid")), ("random-qwen3-moe", dict(rotary_dim=8)),
    ("random-qwen3-moe", dict(shared_expert_intermediate_size=32)), ("random-llada-moe", dict(norm_topk_prob=True)),
    ("random-llada-moe", dict(o_bias=True)), ("random-llada2-moe", dict(router_expert_bias=False)),
    ("random-llada2-moe", dict(qk_norm=False)), ("random-llada2-moe", dict(moe_layers=(0,))),
])
def test_moe_export_refuses_what_the_familys_config_cannot_hold(preset, change):
    from dlmjax.presets import PRESETS

    cfg = ModelConfig(vocab_size=96, **PRESETS[preset])
    to_hf_config(cfg)  # the family's own settings export
    with pytest.raises(ConfigError, match=f"cannot express .*{next(iter(change))}"):
        to_hf_config(cfg.replace(**change))


@pytest.mark.parametrize("family", ["llada_moe", "llada2_moe"])
def test_partial_rotary_export_reads_back_where_the_quotient_rounds_down(family):
    """rotary_dim / head_dim in floating point can land just below the rotary dim once multiplied
    back (58 / 100 * 100 = 57.99...); the exported factor must give int(head_dim * factor) = rotary_dim,
    as dlmjax and the families' modeling code read it."""
    raw = llada_moe_config_json(LLADA_MOE) if family == "llada_moe" else llada2_config_json(LLADA2)
    cfg = from_hf_config(raw).replace(num_heads=1, num_kv_heads=1, head_dim=100, hidden_size=100, rotary_dim=58)
    out = to_hf_config(cfg)
    assert int(100 * out["partial_rotary_factor"]) == 58
    assert from_hf_config(out).rotary_dim == 58


def test_the_softmax_router_refuses_a_scaling_factor_it_would_not_apply():
    cfg = from_hf_config(qwen3_moe_config_json(True))
    with pytest.raises(ConfigError, match="routed_scaling_factor=2.5 is applied by the sigmoid"):
        cfg.replace(routed_scaling_factor=2.5)


def test_moe_config_nulls_that_mean_none_are_read_so():
    cfg = from_hf_config({**llada2_config_json(LLADA2), "num_shared_experts": None, "n_group": None,
                          "topk_group": None})
    assert (cfg.shared_expert_intermediate_size, cfg.router_groups, cfg.router_topk_groups) == (0, 1, 1)
    qwen = qwen3_moe_config_json(True)
    assert from_hf_config({**qwen, "num_local_experts": None}) == from_hf_config(qwen)


def test_moe_rename_rules_go_both_ways():
    """One table per layout: every published name comes back from its canonical name on export."""
    from dlmjax.io.moe_weights import _RENAMES, _rename

    for layout, rules in _RENAMES.items():
        for published, canonical in rules:
            full = lambda prefix: prefix.replace("{i}", "17") + ("" if prefix.endswith("weight") else "weight")
            name = full(published)
            ours = _rename(name, layout)
            assert ours == full(canonical)
            assert _rename(ours, layout, to_published=True) == name
    assert _rename("model.layers.3.mlp.gate.weight", "llada2") == "model.layers.3.mlp.gate.weight"


def test_a_missing_expert_tensor_is_named(qwen3_moe, tmp_path):
    _, _, published = qwen3_moe
    tensors = {name: SafetensorsFile(published / "model.safetensors").get(name)
               for name in SafetensorsFile(published / "model.safetensors").keys()}
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    broken = write_checkpoint(tmp_path / "broken", qwen3_moe_config_json(True), tensors)
    with pytest.raises(CheckpointError, match=r"missing expert tensors \['model.layers.2.mlp.experts.5.up_proj"):
        dlmjax.load_model(broken)


def test_moe_configs_round_trip_through_config_json():
    for cfg in (from_hf_config(qwen3_moe_config_json(False)), from_hf_config(llada_moe_config_json(LLADA_MOE)),
                from_hf_config(llada2_config_json(LLADA2)),
                from_hf_config({**qwen3_moe_config_json(True), "model_type": "sdar_moe", "block_size": 8})):
        assert from_hf_config(to_hf_config(cfg)) == cfg


# ----------------------------------------------------------------------------------------------
# SDAR-MoE: Qwen3-MoE layers under SDAR's block-causal attention


def test_sdar_moe_equals_qwen3_moe_under_a_block_causal_mask(qwen3_moe, tmp_path):
    model, fused, _ = qwen3_moe
    config = {**json.loads((fused / "config.json").read_text()), "model_type": "sdar_moe",
              "architectures": ["SDARMoeForCausalLM"], "block_size": 4}
    path = write_checkpoint(tmp_path / "sdar_moe", config, state_dict_numpy(model))
    ours = dlmjax.load_model(path)
    assert (ours.config.family, ours.config.attention, ours.config.mask_token_id) == ("sdar_moe", "block_causal",
                                                                                      151669)
    tokens = random_tokens(2, 12)
    assert max_diff(ours(jnp.asarray(tokens)).logits, torch_logits(model, tokens, "block_causal", 4)) <= TOL


# ----------------------------------------------------------------------------------------------
# LLaDA-MoE and LLaDA2 against tests/moe_reference.py

LLADA_MOE = dict(family="llada_moe", vocab=96, hidden=32, layers=3, heads=4, kv_heads=4, head_dim=8, rotary_dim=8,
                 theta=50000.0, eps=1e-5, experts=8, top_k=3, moe_width=16, shared=12, dense_layers={1},
                 dense_width=48, qkv_bias=False, o_bias=False)
LLADA2 = dict(family="llada2", vocab=96, hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, rotary_dim=4,
              theta=600000.0, eps=1e-6, experts=8, top_k=2, n_group=4, topk_group=2, scale=2.5, moe_width=16,
              shared=16, dense_layers={0}, dense_width=48, qkv_bias=False, o_bias=True)


def llada_moe_config_json(c):
    return {"architectures": ["LLaDAMoEModelLM"], "model_type": "llada", "vocab_size": c["vocab"],
            "hidden_size": c["hidden"], "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
            "num_key_value_heads": c["kv_heads"], "hidden_act": "silu", "rms_norm_eps": c["eps"],
            "rope_theta": c["theta"], "rope_scaling": None, "partial_rotary_factor": 1.0, "qk_layernorm": True,
            "dense_intermediate_size": c["dense_width"], "expert_intermediate_size": c["moe_width"],
            "num_experts": c["experts"], "num_experts_per_tok": c["top_k"],
            "shared_expert_intermediate_size": c["shared"], "moe_layer_freq": [1, 0, 1], "norm_topk_prob": None,
            "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
            "router_num_group": None, "router_topk_group": None, "routed_scaling_factor": 1, "clip_qkv": None,
            "attention_bias": False, "eos_token_id": 90, "pad_token_id": 90, "tie_word_embeddings": False}


def llada2_config_json(c):
    return {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "vocab_size": c["vocab"],
            "hidden_size": c["hidden"], "intermediate_size": c["dense_width"], "num_hidden_layers": c["layers"],
            "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"], "head_dim": c["head_dim"],
            "hidden_act": "silu", "use_qkv_bias": c["qkv_bias"], "use_bias": c["o_bias"], "use_qk_norm": True,
            "norm_head": False, "rms_norm_eps": c["eps"], "rope_theta": c["theta"], "partial_rotary_factor": 0.5,
            "num_experts": c["experts"], "num_shared_experts": 1, "num_experts_per_tok": c["top_k"],
            "n_group": c["n_group"], "topk_group": c["topk_group"], "routed_scaling_factor": c["scale"],
            "moe_intermediate_size": c["moe_width"], "first_k_dense_replace": 1, "score_function": "sigmoid",
            "moe_router_enable_expert_bias": True, "router_dtype": "fp32", "norm_topk_prob": True,
            "embedding_dropout": 0.1, "attention_dropout": 0.1, "output_dropout": 0.1, "block_size": 4,
            "max_position_embeddings": 512, "eos_token_id": 90, "pad_token_id": 90, "tie_word_embeddings": False}


def reference_model(c, seed):
    from moe_reference import Reference

    torch.manual_seed(seed)
    model = randomize(Reference(c), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("gate.expert_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.05)
    return model


def reference_logits(model, tokens, mask_kind):
    from tiny_models import additive_mask

    with torch.no_grad():
        return model(torch.from_numpy(tokens).long(), additive_mask(mask_kind, tokens.shape[1], 4)).numpy()


@pytest.mark.parametrize("c, config_json, mask", [(LLADA_MOE, llada_moe_config_json, "bidirectional"),
                                                  (LLADA2, llada2_config_json, "block_causal")],
                         ids=["llada_moe", "llada2"])
def test_llada_moe_families_equal_the_pytorch_reference_and_export_their_layout(c, config_json, mask, tmp_path):
    model = reference_model(c, seed=len(c["family"]))
    published = model.published_state()
    path = write_checkpoint(tmp_path / "ckpt", config_json(c), published)
    ours = dlmjax.load_model(path)
    assert ours.config.attention == mask and ours.config.mask_token_id == 156895
    tokens = random_tokens(2, 12)
    expected = reference_logits(model, tokens, mask)
    assert max_diff(ours(jnp.asarray(tokens)).logits, expected) <= TOL

    out = dlmjax.export_model(ours, tmp_path / "export")
    exported = SafetensorsFile(out / "model.safetensors")
    assert set(exported.keys()) == set(published), "the export is in the family's published layout"
    for name in published:
        np.testing.assert_array_equal(exported.get(name), published[name], err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert from_hf_config(config) == ours.config
    assert max_diff(dlmjax.load_model(out)(jnp.asarray(tokens)).logits, expected) <= TOL


def test_llada_moe_is_told_from_dense_llada_by_architectures():
    config = llada_moe_config_json(LLADA_MOE)
    assert from_hf_config(config).family == "llada_moe"
    with pytest.raises(ConfigError, match="never renormalises"):
        from_hf_config({**config, "norm_topk_prob": True})
    with pytest.raises(ConfigError, match=r"unknown config keys \['moe_capacity_factor'\]"):
        from_hf_config({**config, "moe_capacity_factor": 1.25})


def test_llada2_router_sets_excluded_groups_to_minus_inf_under_negative_biases():
    """LLaDA2's gate gives the experts of the groups it drops -inf; a 0.0 there (transformers'
    DeepseekV3TopkRouter before it changed) would beat the kept groups' scores once the expert bias
    pushes them below 0. dlmjax and the reference pick inside the kept groups only."""
    from moe_reference import Llada2Gate

    from dlmjax.models import moe

    c = {**LLADA2, "experts": 16, "top_k": 4, "n_group": 4, "topk_group": 2, "scale": 2.5}
    gate = Llada2Gate(c)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(16, c["hidden"], generator=gen))
        gate.expert_bias.copy_(-1.5 - torch.rand(16, generator=gen))  # every biased score < 0
    x = torch.randn(40, c["hidden"], generator=gen)
    logits, ref_weights, ref_experts = gate(x)
    cfg = from_hf_config({**llada2_config_json(LLADA2), "num_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
                          "topk_group": 2})
    weights, experts = moe.route(cfg, jnp.asarray(logits.detach().numpy()), jnp.asarray(gate.expert_bias.numpy()))
    ours, ref = np.sort(np.asarray(experts), axis=1), np.sort(ref_experts.numpy(), axis=1)
    np.testing.assert_array_equal(ours, ref)
    np.testing.assert_allclose(np.sort(np.asarray(weights), axis=1), np.sort(ref_weights.detach().numpy(), axis=1),
                               rtol=1e-5, atol=1e-6)

    # the same choice with the dropped groups at 0.0 picks experts outside the kept groups
    choice = (torch.sigmoid(logits) + gate.expert_bias).view(40, 4, 4)
    kept = torch.zeros(40, 4, dtype=torch.bool).scatter_(1, choice.topk(2, -1).values.sum(-1).topk(2, -1).indices, True)
    zero_filled = torch.where(kept[:, :, None], choice, torch.zeros_like(choice)).view(40, 16).topk(4, -1).indices
    assert not np.array_equal(np.sort(zero_filled.numpy(), axis=1), ref)
    groups_of_ours = np.asarray(experts) // 4
    assert all(set(groups_of_ours[t]) <= set(np.nonzero(kept[t].numpy())[0]) for t in range(40))


def test_llada2_config_fields():
    cfg = from_hf_config(llada2_config_json(LLADA2))
    assert (cfg.rotary_dim, cfg.block_size, cfg.moe_layers, cfg.shared_expert_intermediate_size) == (4, 4, (1, 2), 16)
    assert (cfg.router, cfg.router_groups, cfg.router_topk_groups, cfg.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5)
    default_block = {k: v for k, v in llada2_config_json(LLADA2).items() if k != "block_size"}
    assert from_hf_config(default_block).block_size == 32
    with pytest.raises(ConfigError, match="multi-token-prediction"):
        from_hf_config({**llada2_config_json(LLADA2), "num_nextn_predict_layers": 1})
    # keys the published configs (inclusionAI's llada2_mini / llada2_flash) carry and the modeling code never reads
    published = {"use_rmsnorm": True, "norm_softmax": False, "using_split_qkv_in_self_attention": False}
    assert from_hf_config({**llada2_config_json(LLADA2), **published}) == cfg
    with pytest.raises(ConfigError, match="fused query_key_value"):
        from_hf_config({**llada2_config_json(LLADA2), "using_split_qkv_in_self_attention": True})


# ----------------------------------------------------------------------------------------------
# Presets


def test_random_moe_presets_load_and_decode(tmp_path, monkeypatch):
    from dlmjax.presets import load_checkpoint

    monkeypatch.setenv("DLMJAX_CACHE", str(tmp_path))
    for name, decoder in (("random-llada2-moe", "threshold:tau=0.95"), ("random-qwen3-moe", "ar")):
        _, model, tokenizer, _ = load_checkpoint(name)
        assert model.config.num_experts == 8
        result = generate(model, ["ab"], tokenizer=tokenizer, decoder=decoder, max_new_tokens=4)
        assert len(result.rows[0].tokens) == 4
