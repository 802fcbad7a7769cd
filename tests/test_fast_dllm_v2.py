"""Fast-dLLM v2 (`Fast_dLLM_QwenForCausalLM`, model_type `Fast_dLLM_Qwen`): Qwen2.5 layers under a
block-causal mask in blocks of `bd_size`, logits shifted by one. Parity with transformers' Qwen2
components (fp32), strict config translation, export round trip."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import dlmjax
from dlmjax.config import ConfigError, from_hf_config, to_hf_config
from tiny_models import compiled_forward, random_tokens, state_dict_numpy, torch_logits, torch_model, write_checkpoint

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
    """Efficient-Large-Model/Fast_dLLM_v2_7B's config.json as published (its training switch
    `conplemenrary_mask` spelt as there) translates to the 7B shape, block 32, mask 151665."""
    raw = {
        "architectures": ["Fast_dLLM_QwenForCausalLM"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig", "AutoModel": "modeling.Fast_dLLM_QwenModel",
                     "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
        "bd_size": 32, "bos_token_id": 151643, "conplemenrary_mask": True, "eos_token_id": 151645,
        "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
        "layer_types": ["full_attention"] * 28, "max_position_embeddings": 32768, "max_window_layers": 28,
        "model_type": "Fast_dLLM_Qwen", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "pad_token_id": 151645, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.53.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
    }
    cfg = from_hf_config(raw)
    assert (cfg.family, cfg.block_size, cfg.mask_token_id, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.rope_theta, cfg.dtype) == ("fast_dllm_v2", 32, 151665, 28, 28, 4, 128, 1e6, "bfloat16")
    assert from_hf_config({k: v for k, v in raw.items() if k != "bd_size"}).block_size == 32  # the modeling default
    assert to_hf_config(cfg)["bd_size"] == 32
    with pytest.raises(ConfigError, match="names its block `bd_size`"):
        from_hf_config({**raw, "block_size": 32})
    without_types = {k: v for k, v in raw.items() if k != "layer_types"}
    with pytest.raises(ConfigError, match="sliding-window"):  # layers 20..27 windowed
        from_hf_config({**without_types, "use_sliding_window": True, "max_window_layers": 20})
    assert from_hf_config({**without_types, "use_sliding_window": True}) == cfg  # windows from layer 28 on: none
    # where layer_types is given it decides, as in transformers: all full attention is no window
    assert from_hf_config({**raw, "use_sliding_window": True, "max_window_layers": 20}) == cfg
    with pytest.raises(ConfigError, match=r"unknown config keys \['dual_cache'\]"):
        from_hf_config({**raw, "dual_cache": True})
    with pytest.raises(ConfigError, match="bd_size"):
        from_hf_config({**raw, "bd_size": 0})
    # bd_size and the training switch are Fast-dLLM v2's own keys: other families refuse them
    with pytest.raises(ConfigError, match=r"unknown config keys \['bd_size', 'conplemenrary_mask'\]"):
        from_hf_config({**raw, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})


def peaked_fast_dllm(seed: int, block: int = 8):
    """A tiny random Fast-dLLM v2 model (block-causal, shifted logits, q/k/v biases) with weights
    scaled up so that its distributions are peaked (no near-ties between cached and full forwards)."""
    import jax
    from flax import nnx

    cfg = dlmjax.ModelConfig(
        family="fast_dllm_v2", vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, attention="block_causal", block_size=block, shift_logits=True, qkv_bias=True,
        mask_token_id=MASK, eos_token_ids=(EOS,), pad_token_id=0, max_position_embeddings=128)
    graphdef, state = nnx.split(dlmjax.init_model(cfg, seed=seed))
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, state))
    head = model.embed if model.lm_head is None else model.lm_head.kernel
    head[...] = head[...] * 4.0
    return model


MASK, EOS = 39, 38
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13], [3], [5, 9, 14, 2, 2, 7, 30, 8, 1, 2], [20, 21]]


def reference_fast_dllm_v2(model, prompt, *, block, sub_block, tau, max_new):
    """The procedure of Fast-dLLM v2's generate(), one full forward of the canvas per step (no cache;
    block-causal, so later blocks do not matter): a block's masked first position is the argmax of
    the logits at the column before it (generate(): from the forward that stored the previous
    block), then sub-blocks in turn, each step committing the masked positions of the current
    sub-block with confidence > tau, and always its most confident one."""
    import jax

    start = (len(prompt) // block) * block
    num_blocks = -(-(len(prompt) - start + max_new) // block)
    seq = list(prompt) + [MASK] * (start + num_blocks * block - len(prompt))
    for b in range(num_blocks):
        cols = list(range(start + b * block, start + (b + 1) * block))
        while any(seq[c] == MASK for c in cols):
            logits = compiled_forward(model)(jnp.asarray([seq], jnp.int32)).logits[0].at[:, MASK].set(-jnp.inf)
            probs = np.asarray(jax.nn.softmax(logits, axis=-1))  # position p: the logits computed at p - 1
            if seq[cols[0]] == MASK:
                seq[cols[0]] = int(probs[cols[0]].argmax())
                continue
            sub = next(cols[i : i + sub_block] for i in range(0, block, sub_block)
                       if any(seq[c] == MASK for c in cols[i : i + sub_block]))
            masked = [c for c in sub if seq[c] == MASK]
            best = max(masked, key=lambda c: (probs[c].max(), -c))
            for c in sorted({best, *[c for c in masked if probs[c].max() > tau]}):
                seq[c] = int(probs[c].argmax())
        if EOS in seq[len(prompt) : cols[-1] + 1]:
            break
    out = seq[len(prompt) : len(prompt) + max_new]
    return out[: out.index(EOS) + 1] if EOS in out else out


@pytest.mark.parametrize("spec,sub_block,tau", [("fast-dllm-v2:sub_block=4,tau=0.3", 4, 0.3),
                                                ("fast-dllm-v2:sub_block=8,tau=0.5", 8, 0.5)])
def test_decoding_matches_reference_loop(spec, sub_block, tau):
    from dlmjax.decoding.api import generate

    model = peaked_fast_dllm(seed=5)
    max_new = 14
    together = generate(model, PROMPTS, decoder=spec, max_new_tokens=max_new)
    for i, prompt in enumerate(PROMPTS):
        expected = reference_fast_dllm_v2(model, prompt, block=8, sub_block=sub_block, tau=tau, max_new=max_new)
        assert together.rows[i].tokens == expected, (spec, i)
    alone = generate(model, [PROMPTS[1]], decoder=spec, max_new_tokens=max_new).rows[0]  # block-aligned prompt
    assert (alone.tokens, alone.nfe) == (together.rows[1].tokens, together.rows[1].nfe)
    assert together.tpf > 1.0, "no step committed two tokens: the test is vacuous"


def test_a_blocks_first_token_is_the_argmax_when_sampling_too():
    """generate() takes it autoregressively with argmax at any temperature; it used to be sampled."""
    from dlmjax.decoding.api import generate

    model = peaked_fast_dllm(seed=5)
    block, checked = 8, 0
    for seed in range(2):
        result = generate(model, PROMPTS, decoder="fast-dllm-v2:sub_block=4,temperature=2.0", max_new_tokens=24,
                          seed=seed)
        for prompt, row in zip(PROMPTS, result.rows):
            seq = list(prompt) + row.tokens
            logits = compiled_forward(model)(jnp.asarray([seq + [MASK] * (64 - len(seq))], jnp.int32)).logits[0]
            greedy = np.asarray(logits.at[:, MASK].set(-jnp.inf)).argmax(-1)  # shifted: column c scores position c
            firsts = range((len(prompt) // block + 1) * block, len(seq), block)
            assert [seq[c] for c in firsts] == [int(greedy[c]) for c in firsts]
            checked += len(firsts)
    assert checked >= 20


def test_other_decoders_are_refused_with_the_fix(qwen2_and_checkpoint):
    from dlmjax.config import FAMILIES
    from dlmjax.decoding.api import generate
    from dlmjax.decoding.spec import DecoderSpecError, parse_decoder
    from dlmjax.presets import load_eval_preset

    ours = dlmjax.load_model(qwen2_and_checkpoint[1])
    with pytest.raises(DecoderSpecError, match="use --decoder fast-dllm-v2"):
        generate(ours, [[5, 6, 7]], decoder="threshold:tau=0.9", max_new_tokens=4)
    with pytest.raises(DecoderSpecError, match="sub_block=3 does not divide the block 4"):
        generate(ours, [[5, 6, 7]], decoder="fast-dllm-v2:sub_block=3", max_new_tokens=4)
    # and its decoder is refused on other families, whose first block token it would take alone
    with pytest.raises(DecoderSpecError, match="fast-dllm-v2 is Fast-dLLM v2's own procedure.*sdar model"):
        generate(dlmjax.load_model("toy-sdar"), [[5, 6, 7]], decoder="fast-dllm-v2", max_new_tokens=4)
    with pytest.raises(DecoderSpecError, match="max_post_steps=2147483648 must be <= 2147483647"):
        parse_decoder("llada2:editing_threshold=0.5,max_post_steps=2147483648")
    preset = load_eval_preset("fast-dllm-v2-7b")
    assert preset.mask_token_id == FAMILIES[preset.family].default_mask_token_id
    assert parse_decoder(preset.decoders[0]) == parse_decoder("fast-dllm-v2:tau=0.9,sub_block=8")


def test_its_decoder_is_the_default_for_the_family():
    from dlmjax.decoding.api import generate
    from dlmjax.evaluation.runner import default_decoders

    model = peaked_fast_dllm(seed=1)
    assert default_decoders(model) == ["fast-dllm-v2"]
    out = generate(model, [PROMPTS[0]], decoder=default_decoders(model)[0], max_new_tokens=8).rows[0]
    assert out.tokens == reference_fast_dllm_v2(model, PROMPTS[0], block=8, sub_block=8, tau=0.9, max_new=8)
    from dlmjax.decoding.spec import parse_decoder

    # sampling: generate() compares tau with the sampled token's tempered top-p probability, at its
    # default top_p of 0.95 (generate()'s and batch_sample's)
    sampling = parse_decoder("fast-dllm-v2:temperature=0.7")
    assert sampling.sampled_scores and sampling.top_p == 0.95
    assert parse_decoder("fast-dllm-v2:temperature=0.7,top_p=1").top_p == 1.0


def test_the_random_preset_is_a_fast_dllm_v2_checkpoint_that_decodes(tmp_path, monkeypatch):
    """`--model random-fast-dllm-v2`: the published layout (bd_size, architecture) offline, decoded
    by the family's default decoder."""
    import json

    from dlmjax.decoding.api import generate
    from dlmjax.evaluation.runner import default_decoders
    from dlmjax.presets import load_checkpoint

    monkeypatch.setenv("DLMJAX_CACHE", str(tmp_path))
    path, model, tokenizer, _ = load_checkpoint("random-fast-dllm-v2")
    config = json.loads((path / "config.json").read_text())
    assert config["bd_size"] == 32 and config["architectures"] == ["Fast_dLLM_QwenForCausalLM"]
    assert model.config.family == "fast_dllm_v2" and model.config.shift_logits
    result = generate(model, ["ab"], tokenizer=tokenizer, decoder=default_decoders(model)[0], max_new_tokens=8)
    assert result.decoder.startswith("fast-dllm-v2") and len(result.rows[0].tokens) == 8
