"""MoE families against their PyTorch references: Qwen3-MoE (transformers), SDAR-MoE, LLaDA-MoE and
LLaDA2 (tests/moe_reference.py, built from transformers components); weight layouts in and out;
strict config translation."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import dlmjax
from dlmjax.config import ConfigError, from_hf_config, to_hf_config
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


def test_qwen3_moe_reads_both_spellings_of_experts_and_rope():
    base = qwen3_moe_config_json(True)
    new_style = {k: v for k, v in base.items() if k not in ("num_experts", "rope_theta")}
    new_style.update(num_local_experts=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert from_hf_config(new_style) == from_hf_config(base)
    with pytest.raises(ConfigError, match="keep one of them"):
        from_hf_config({**base, "num_local_experts": 4})


@pytest.mark.parametrize("change, message", [
    (dict(shared_expert_intermediate_size=8), r"unknown config keys \['shared_expert_intermediate_size'\]"),
    (dict(num_experts_per_tok=9), "cannot pick more experts"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob"),
    (dict(mlp_only_layers="1"), "list of integers"),
])
def test_qwen3_moe_config_translation_is_strict(change, message):
    with pytest.raises(ConfigError, match=message):
        from_hf_config({**qwen3_moe_config_json(True), **change})


def test_a_missing_expert_tensor_is_named(qwen3_moe, tmp_path):
    _, _, published = qwen3_moe
    tensors = {name: SafetensorsFile(published / "model.safetensors").get(name)
               for name in SafetensorsFile(published / "model.safetensors").keys()}
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    broken = write_checkpoint(tmp_path / "broken", qwen3_moe_config_json(True), tensors)
    with pytest.raises(CheckpointError, match=r"missing expert tensors \['model.layers.2.mlp.experts.5.up_proj"):
        dlmjax.load_model(broken)


def test_moe_configs_round_trip_through_config_json():
    for cfg in (from_hf_config(qwen3_moe_config_json(False)),):
        assert from_hf_config(to_hf_config(cfg)) == cfg
