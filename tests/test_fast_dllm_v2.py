"""Fast-dLLM v2 (`Fast_dLLM_QwenForCausalLM`, model_type `Fast_dLLM_Qwen`): Qwen2.5 layers under a
block-causal mask in blocks of `bd_size`, logits shifted by one. Parity with transformers' Qwen2
components (fp32), strict config translation, export round trip."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import dlmjax
from dlmjax.config import ConfigError, from_hf_config, to_hf_config
from tiny_models import random_tokens, state_dict_numpy, torch_logits, torch_model, write_checkpoint

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TOL = 1e-4
BD = 4  # the tiny model's bd_size (the 7B's is 32)


def fast_dllm_config(qwen2_config: dict, **changes) -> dict:
    """A transformers Qwen2 config relabelled as Fast-dLLM v2 writes it (model_type, architectures,
    auto_map to its remote code, bd_size, mask id)."""
    config = {**qwen2_config, "model_type": "Fast_dLLM_Qwen", "architectures": ["Fast_dLLM_QwenForCausalLM"],
              "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                           "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
              "bd_size": BD, "mask_token_id": 95}
    config.update(changes)
    return config


@pytest.fixture(scope="module")
def qwen2_and_checkpoint(tmp_path_factory):
    qwen2 = torch_model("qwen2", seed=21)
    path = tmp_path_factory.mktemp("fast-dllm-v2")
    write_checkpoint(path, fast_dllm_config(json.loads(qwen2.config.to_json_string())), state_dict_numpy(qwen2))
    return qwen2, path


def expected_logits(qwen2, tokens):
    """Qwen2 under the block-causal mask, logits shifted right by one (Fast-dLLM v2's token shift:
    position i reads the logits computed at i - 1; position 0 keeps its own)."""
    raw = torch_logits(qwen2, tokens, "block_causal", block_size=BD)
    return np.concatenate([raw[:, :1], raw[:, :-1]], axis=1)


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def test_logits_match_qwen2_block_causal_shifted(qwen2_and_checkpoint):
    qwen2, path = qwen2_and_checkpoint
    ours = dlmjax.load_model(path)
    cfg = ours.config
    assert (cfg.family, cfg.attention, cfg.block_size, cfg.shift_logits) == ("fast_dllm_v2", "block_causal", BD, True)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.mask_token_id) == (True, False, False, 95)
    tokens = random_tokens(2, 3 * BD + 2)  # a partial last block too
    expected = expected_logits(qwen2, tokens)
    assert max_diff(ours(jnp.asarray(tokens)).logits, expected) <= TOL
    # the mask is what makes it block-causal: plain causal attention gives other logits
    causal = torch_logits(qwen2, tokens, "causal")
    assert max_diff(np.concatenate([causal[:, :1], causal[:, :-1]], axis=1), expected) > 1e-2


def test_export_round_trip(qwen2_and_checkpoint, tmp_path):
    qwen2, path = qwen2_and_checkpoint
    ours = dlmjax.load_model(path)
    out = dlmjax.export_model(ours, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["bd_size"]) == (
        "Fast_dLLM_Qwen", ["Fast_dLLM_QwenForCausalLM"], BD)
    assert "block_size" not in config and "attention_bias" not in config and config["mask_token_id"] == 95
    tokens = random_tokens(2, 2 * BD + 1, seed=1)
    expected = expected_logits(qwen2, tokens)
    assert max_diff(dlmjax.load_model(out)(jnp.asarray(tokens)).logits, expected) <= TOL
    # the tensors keep the published (Qwen2) names: they load strictly into a transformers Qwen2
    from safetensors.torch import load_file

    fresh = torch_model("qwen2", seed=99)
    fresh.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    assert max_diff(expected_logits(fresh, tokens), expected) <= TOL


def test_published_7b_config_translates():
    """A config in the form of Efficient-Large-Model/Fast_dLLM_v2_7B's (Qwen2.5-7B-Instruct's fields
    plus Fast-dLLM v2's) translates to the 7B shape, block 32, mask 151665."""
    raw = {
        "architectures": ["Fast_dLLM_QwenForCausalLM"], "model_type": "Fast_dLLM_Qwen",
        "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                     "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
        "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
        "max_position_embeddings": 32768, "max_window_layers": 28, "num_attention_heads": 28,
        "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.53.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
        "bd_size": 32, "layer_types": ["full_attention"] * 28,
    }
    cfg = from_hf_config(raw)
    assert (cfg.family, cfg.block_size, cfg.mask_token_id, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.rope_theta, cfg.dtype) == ("fast_dllm_v2", 32, 151665, 28, 28, 4, 128, 1e6, "bfloat16")
    assert from_hf_config({k: v for k, v in raw.items() if k != "bd_size"}).block_size == 32  # the modeling default
    assert to_hf_config(cfg)["bd_size"] == 32
    with pytest.raises(ConfigError, match="names its block `bd_size`"):
        from_hf_config({**raw, "block_size": 32})
    with pytest.raises(ConfigError, match="sliding-window"):
        from_hf_config({**raw, "use_sliding_window": True})
    with pytest.raises(ConfigError, match=r"unknown config keys \['dual_cache'\]"):
        from_hf_config({**raw, "dual_cache": True})
    with pytest.raises(ConfigError, match="bd_size"):
        from_hf_config({**raw, "bd_size": 0})
    # bd_size is Fast-dLLM v2's own key: other families refuse it
    with pytest.raises(ConfigError, match=r"unknown config keys \['bd_size'\]"):
        from_hf_config({**raw, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})


def test_decoding_is_refused_with_the_reason(qwen2_and_checkpoint):
    from dlmjax.config import FAMILIES
    from dlmjax.decoding.api import generate
    from dlmjax.decoding.spec import DecoderSpecError
    from dlmjax.presets import PUBLISHED_DENSE

    ours = dlmjax.load_model(qwen2_and_checkpoint[1])
    with pytest.raises(DecoderSpecError, match=r"sub-blocks of 8\) needs engine support"):
        generate(ours, [[1, 2, 3]], decoder="threshold:tau=0.9", max_new_tokens=4)
    settings = PUBLISHED_DENSE["Efficient-Large-Model/Fast_dLLM_v2_7B"]
    assert settings["mask_token_id"] == FAMILIES[settings["family"]].default_mask_token_id
    assert (settings["block"], settings["sub_block"], settings["tau"], settings["decoder"]) == (32, 8, 0.9, None)
