"""Parity with transformers' PyTorch models: load, compare logits under each mask, export, reload.

Every family goes through the same roundtrip: tiny random transformers model ->
save_pretrained -> dlmjax.load_model -> logits vs PyTorch (fp32, <= 1e-4) under causal,
bidirectional and block-causal additive 4D masks -> dlmjax.export_model ->
from_pretrained -> logits again.
"""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlmjax
from dlmjax.io.safetensors import CheckpointError
from dlmjax.presets import PRESETS, load_checkpoint
from tiny_models import (
    additive_mask, llada_tensors, random_tokens, state_dict_numpy, torch_logits, torch_model, write_checkpoint,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
VARIANTS = {
    "qwen3-gqa": ("qwen3", {}),
    "qwen3-tied-mha": ("qwen3", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2-bias-gqa": ("qwen2", {}),
    "llama-gqa-bias": ("llama", dict(attention_bias=True)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    # Llama 3.1+ RoPE: with head_dim 8 and original 64 the four frequencies fall in all three
    # regimes (wavelengths 6.3: kept, 63: blended, 628 and 6283: divided by the factor)
    "llama3-rope": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64})),
    "qwen3-linear-rope": ("qwen3", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                         "factor": 2.0})),
}
MASKS = ("causal", "bidirectional", "block_causal")


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
    kind, overrides = VARIANTS[request.param]
    model = torch_model(kind, seed=len(request.param), **overrides)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("mask", MASKS)
def test_logits_match_pytorch_under_each_mask(saved, mask):
    model, path = saved
    ours = dlmjax.load_model(path)
    tokens = random_tokens(2, 12)
    expected = torch_logits(model, tokens, mask, block_size=4)
    got = ours(jnp.asarray(tokens), attention=mask) if mask != "block_causal" else _block_causal(path, tokens)
    assert max_diff(got.logits, expected) <= TOL


def _block_causal(path, tokens):
    # The block size comes from the config; a causal family has none, so set it for this check.
    model = dlmjax.load_model(path)
    model.config = model.config.replace(block_size=4)
    return model(jnp.asarray(tokens), attention="block_causal")


def test_export_reloads_in_transformers(saved, tmp_path):
    model, path = saved
    ours = dlmjax.load_model(path)
    out = dlmjax.export_model(ours, tmp_path / "export", files_from=path)
    index_or_file = list(out.glob("*.safetensors"))
    assert index_or_file, "export wrote no safetensors"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = random_tokens(2, 12, seed=1)
    assert max_diff(torch_logits(reloaded, tokens), torch_logits(model, tokens)) == 0.0
    assert max_diff(dlmjax.load_model(out)(jnp.asarray(tokens)).logits, torch_logits(model, tokens)) <= TOL


def test_sharded_export_writes_index_and_reloads(tmp_path):
    model = torch_model("qwen3")
    model.save_pretrained(tmp_path / "src")
    ours = dlmjax.load_model(tmp_path / "src")
    out = dlmjax.export_model(ours, tmp_path / "out", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = random_tokens(1, 9)
    assert max_diff(torch_logits(reloaded, tokens), torch_logits(model, tokens)) == 0.0


def test_a_sharded_export_holds_one_shard_in_host_memory_not_the_model(tmp_path):
    """Each shard is written as soon as it is full (a model of 16 GB needed 16 GB of host memory
    beside it): exporting toy-sdar in 100 kB shards allocates well under its 3.2 MB of weights."""
    import tracemalloc

    from flax import nnx

    _, model, _, _ = load_checkpoint("toy-sdar")
    weights = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model)))
    tracemalloc.start()
    try:
        dlmjax.export_model(model, tmp_path / "out", max_shard_bytes=100_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 10
    assert peak < weights / 2, (peak, weights)


def _llada_config(llama_cfg) -> dict:
    return {
        "model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": llama_cfg.hidden_size,
        "n_heads": llama_cfg.num_attention_heads, "n_kv_heads": llama_cfg.num_key_value_heads,
        "n_layers": llama_cfg.num_hidden_layers, "mlp_hidden_size": llama_cfg.intermediate_size,
        "vocab_size": llama_cfg.vocab_size, "embedding_size": llama_cfg.vocab_size,
        "rope_theta": 10000.0, "rms_norm_eps": llama_cfg.rms_norm_eps, "max_sequence_length": 256,
        "weight_tying": False, "include_bias": False, "include_qkv_bias": False, "activation_type": "silu",
        "block_type": "llama", "layer_norm_type": "rms", "rope": True, "alibi": False, "mask_token_id": 95,
        "eos_token_id": 94, "pad_token_id": 94, "flash_attention": False, "attention_dropout": 0.0,
        "residual_dropout": 0.0, "embedding_dropout": 0.0, "block_group_size": 1, "scale_logits": False,
    }


def test_llada_layout_matches_llama_bidirectional(tmp_path):
    llama = torch_model("llama", head_dim=8)
    path = write_checkpoint(tmp_path / "llada", _llada_config(llama.config), llada_tensors(state_dict_numpy(llama)))
    ours = dlmjax.load_model(path)
    assert ours.config.family == "llada" and ours.config.attention == "bidirectional"
    assert ours.config.mask_token_id == 95
    tokens = random_tokens(2, 11)
    expected = torch_logits(llama, tokens, "bidirectional")
    assert max_diff(ours(jnp.asarray(tokens)).logits, expected) <= TOL
    # export keeps LLaDA's names and reloads in dlmjax
    out = dlmjax.export_model(ours, tmp_path / "llada-export")
    names = set(dlmjax.io.hf.open_shards(out))
    assert "model.transformer.blocks.0.attn_out.weight" in names
    assert max_diff(dlmjax.load_model(out)(jnp.asarray(tokens)).logits, expected) <= TOL
    # the dropouts written as LLaDA-8B writes them: LLaDA's own code defaults each to 0.1, which a
    # fine-tune of the export in PyTorch would have trained with
    written = json.loads((out / "config.json").read_text())
    assert [written[f"{k}_dropout"] for k in ("attention", "residual", "embedding")] == [0.0, 0.0, 0.0]


def test_a_config_without_dtype_loads_in_the_dtype_its_weights_are_stored_in(tmp_path):
    """LLaDA-8B's config.json names no dtype and its weights are bf16: it loads as bf16 (as
    transformers' default dtype "auto" loads it), not as twice the memory in fp32."""
    import ml_dtypes

    llama = torch_model("llama", head_dim=8)
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in llada_tensors(state_dict_numpy(llama)).items()}
    path = write_checkpoint(tmp_path / "llada", _llada_config(llama.config), bf16)
    assert dlmjax.load_model(path).embed[...].dtype == jnp.bfloat16
    assert dlmjax.load_model(path, dtype="float32").embed[...].dtype == jnp.float32  # asked for: as asked
    hf = tmp_path / "llama"
    llama.to(torch.bfloat16).save_pretrained(hf)
    config = json.loads((hf / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (hf / "config.json").write_text(json.dumps(config))
    expected = next(transformers.AutoModelForCausalLM.from_pretrained(hf).parameters()).dtype
    assert expected == torch.bfloat16 and dlmjax.load_model(hf).config.dtype == "bfloat16"


def relabelled_checkpoint(model, out_dir, **config_changes):
    """The transformers model's weights and config under another family's model_type."""
    config = {**json.loads(model.config.to_json_string()), **config_changes}
    config.pop("architectures", None)
    return write_checkpoint(out_dir, config, state_dict_numpy(model))


def test_dream_layout_matches_qwen2_with_shifted_logits(tmp_path):
    qwen2 = torch_model("qwen2")
    path = relabelled_checkpoint(qwen2, tmp_path / "dream", model_type="Dream", mask_token_id=95)
    ours = dlmjax.load_model(path)
    assert ours.config.family == "dream" and ours.config.shift_logits
    tokens = random_tokens(2, 10)
    raw = torch_logits(qwen2, tokens, "bidirectional")
    shifted = np.concatenate([raw[:, :1], raw[:, :-1]], axis=1)
    assert max_diff(ours(jnp.asarray(tokens)).logits, shifted) <= TOL
    out = dlmjax.export_model(ours, tmp_path / "dream-export")
    assert json.loads((out / "config.json").read_text())["model_type"] == "Dream"  # the published spelling
    assert max_diff(dlmjax.load_model(out)(jnp.asarray(tokens)).logits, shifted) <= TOL


def test_sdar_layout_is_block_causal_qwen3(tmp_path):
    qwen3 = torch_model("qwen3")
    path = relabelled_checkpoint(qwen3, tmp_path / "sdar", model_type="sdar", block_size=4)
    ours = dlmjax.load_model(path)
    assert ours.config.attention == "block_causal" and ours.config.block_size == 4
    tokens = random_tokens(2, 12)
    expected = torch_logits(qwen3, tokens, "block_causal", block_size=4)
    assert max_diff(ours(jnp.asarray(tokens)).logits, expected) <= TOL
    out = dlmjax.export_model(ours, tmp_path / "sdar-export")
    assert json.loads((out / "config.json").read_text())["block_size"] == 4
    assert max_diff(dlmjax.load_model(out)(jnp.asarray(tokens)).logits, expected) <= TOL


# Remote code as the families' checkpoints carry it (config class + model class beside the weights,
# named in config.json's auto_map). The classes here are transformers' own Qwen3/Qwen2 under the
# family's model_type, standing in for SDAR's and Dream's files (not shipped offline): what the test
# checks is that an export carries whatever code its source carried, and that transformers runs it.
REMOTE_CODE = {
    "sdar": ("qwen3", "Qwen3", "SDAR"),
    "Dream": ("qwen2", "Qwen2", "Dream"),
}


def write_remote_code(path, model_type, base, name):
    (path / f"configuration_{name.lower()}.py").write_text(
        f"from transformers import {base}Config\n\n\nclass {name}Config({base}Config):\n"
        f"    model_type = {model_type!r}\n")
    (path / f"modeling_{name.lower()}.py").write_text(
        f"from transformers import {base}ForCausalLM\n\nfrom .configuration_{name.lower()} import {name}Config\n\n\n"
        f"class {name}ForCausalLM({base}ForCausalLM):\n    config_class = {name}Config\n")
    return {"AutoConfig": f"configuration_{name.lower()}.{name}Config",
            "AutoModelForCausalLM": f"modeling_{name.lower()}.{name}ForCausalLM"}


@pytest.mark.parametrize("model_type", sorted(REMOTE_CODE))
def test_export_carries_the_sources_remote_code(model_type, tmp_path):
    """A remote-code family exported from its checkpoint loads back with trust_remote_code=True
    (auto_map and the *.py files copied, model_type spelled as the source spells it)."""
    kind, base, name = REMOTE_CODE[model_type]
    src = tmp_path / "src"
    src.mkdir()
    auto_map = write_remote_code(src, model_type, base, name)
    relabelled_checkpoint(torch_model(kind), src, model_type=model_type, auto_map=auto_map, block_size=4,
                          mask_token_id=95)
    source = transformers.AutoModelForCausalLM.from_pretrained(src, trust_remote_code=True).eval()
    out = dlmjax.export_model(dlmjax.load_model(src), tmp_path / "export", files_from=src)
    written = json.loads((out / "config.json").read_text())
    assert written["auto_map"] == auto_map and written["model_type"] == model_type
    assert {p.name for p in out.glob("*.py")} == {p.name for p in src.glob("*.py")}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(reloaded).__name__ == f"{name}ForCausalLM"
    tokens = random_tokens(2, 8)
    assert max_diff(torch_logits(reloaded, tokens), torch_logits(source, tokens)) == 0.0
    plain = dlmjax.export_model(dlmjax.load_model(src), tmp_path / "plain")  # no source: no code
    assert "auto_map" not in json.loads((plain / "config.json").read_text()) and not list(plain.glob("*.py"))
    with pytest.warns(DeprecationWarning, match="files_from"):  # the former name still works
        old_name = dlmjax.export_model(dlmjax.load_model(src), tmp_path / "old-name", tokenizer_from=src)
    assert json.loads((old_name / "config.json").read_text())["auto_map"] == auto_map
    with pytest.raises(CheckpointError, match="not a directory"):  # a typo: refused, not an export without a tokenizer
        dlmjax.export_model(dlmjax.load_model(src), tmp_path / "typo", files_from=tmp_path / "srcc")


def test_bf16_load_is_as_accurate_as_pytorch_bf16(saved):
    model, path = saved
    tokens = random_tokens(1, 8)
    ours = dlmjax.load_model(path, dtype="bfloat16")
    assert ours.embed[...].dtype == jnp.bfloat16
    got = ours(jnp.asarray(tokens)).logits
    assert got.dtype == jnp.float32
    exact = torch_logits(model, tokens)
    torch_bf16_error = max_diff(torch_logits(copy.deepcopy(model).to(torch.bfloat16), tokens), exact)
    assert max_diff(got, exact) <= 2 * torch_bf16_error + 1e-3


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_exported_configs_spell_rope_as_transformers_4_code_reads_it(preset):
    """SDAR's, Dream's and Fast-dLLM v2's modeling code (written against transformers 4), vLLM and
    SGLang read `rope_theta`; transformers 5's `rope_parameters` alone would leave them at theta
    10000. The export writes `rope_theta` + `rope_scaling`, which transformers 5 reads too
    (test_export_reloads_in_transformers)."""
    from dlmjax.config import ROPE_FIELDS, ModelConfig, from_hf_config, to_hf_config

    cfg = ModelConfig(vocab_size=96, rope_theta=1e6, **PRESETS[preset])
    out = to_hf_config(cfg)
    assert out["rope_theta"] == 1e6 and out.get("rope_scaling") is None and "rope_parameters" not in out
    read = from_hf_config(out)
    assert [getattr(read, f) for f in ROPE_FIELDS] == [getattr(cfg, f) for f in ROPE_FIELDS]


def test_additive_mask_helper_is_what_we_think():
    mask = additive_mask("block_causal", 8, 4)[0, 0].numpy()
    assert (mask[:4, :4] == 0).all() and (mask[:4, 4:] < -1e30).all() and (mask[4:, :] == 0).all()


def test_rope_scaling_in_the_older_config_key_and_unsupported_types(tmp_path):
    """Configs written by transformers 4 carry `rope_theta` + `rope_scaling` (its type under
    `rope_type` or `type`); they load like transformers 5's `rope_parameters`. YaRN and the
    dynamic types are refused, naming what is implemented."""
    from dlmjax.config import ConfigError
    from dlmjax.io.hf import load_config

    params = dict(VARIANTS["llama3-rope"][1]["rope_parameters"])
    model = torch_model("llama", seed=3, rope_parameters=params)
    model.save_pretrained(tmp_path / "new")
    raw = json.loads((tmp_path / "new" / "config.json").read_text())
    tokens = random_tokens(2, 12)
    expected = torch_logits(model, tokens)
    for type_key in ("rope_type", "type"):
        old = {k: v for k, v in raw.items() if k != "rope_parameters"}
        old["rope_theta"] = params["rope_theta"]
        old["rope_scaling"] = {type_key: "llama3",
                               **{k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}}
        (tmp_path / type_key).mkdir()
        (tmp_path / type_key / "config.json").write_text(json.dumps(old))
        for f in (tmp_path / "new").glob("*.safetensors"):
            (tmp_path / type_key / f.name).write_bytes(f.read_bytes())
        ours = dlmjax.load_model(tmp_path / type_key)
        assert ours.config.rope_scaling == "llama3" and ours.config.rope_original_max_positions == 64
        assert max_diff(ours(jnp.asarray(tokens)).logits, expected) <= TOL
    plain = dlmjax.load_model(tmp_path / "new")
    plain.config = plain.config.replace(rope_scaling="none")
    assert max_diff(plain(jnp.asarray(tokens)).logits, expected) > 10 * TOL  # the scaling matters here
    yarn = dict(raw, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    (tmp_path / "yarn").mkdir()
    (tmp_path / "yarn" / "config.json").write_text(json.dumps(yarn))
    with pytest.raises(ConfigError, match="rope_type 'yarn' is not implemented.*linear and llama3"):
        load_config(tmp_path / "yarn")


def test_linear_rope_with_an_unread_original_length_loads_as_linear():
    """transformers' linear RoPE reads only `factor`; a config that also carries
    `original_max_position_embeddings` (as some do) is the same model, not an unknown key."""
    from dlmjax.config import ConfigError, rope_fields

    base = {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    extra = {**base, "rope_scaling": {**base["rope_scaling"], "original_max_position_embeddings": 32}}
    assert rope_fields(extra) == rope_fields(base) == {"rope_theta": 10000.0, "rope_scaling": "linear",
                                                       "rope_factor": 2.0}
    with pytest.raises(ConfigError, match="unknown \\['beta_fast'\\]"):
        rope_fields({**base, "rope_scaling": {**base["rope_scaling"], "beta_fast": 32}})


def test_a_rope_theta_inside_the_older_rope_scaling_is_read_as_transformers_5_reads_it(tmp_path):
    """transformers 5 turns `rope_scaling` into its `rope_parameters`, so a `rope_theta` inside it
    is the one its model uses (it was accepted and ignored: logits 0.6-0.9 off); beside a different
    top-level `rope_theta` (transformers 4 reads that one) the config is refused."""
    from dlmjax.config import ConfigError

    params = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}
    model = torch_model("llama", seed=3, rope_parameters=params)
    model.save_pretrained(tmp_path / "new")
    raw = json.loads((tmp_path / "new" / "config.json").read_text())
    tokens = random_tokens(2, 12)
    old = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_theta")}
    old["rope_scaling"] = params
    (tmp_path / "new" / "config.json").write_text(json.dumps(old))
    ours = dlmjax.load_model(tmp_path / "new")
    assert ours.config.rope_theta == 1000.0
    assert max_diff(ours(jnp.asarray(tokens)).logits, torch_logits(model, tokens)) <= TOL
    (tmp_path / "new" / "config.json").write_text(json.dumps({**old, "rope_theta": 10000.0}))
    with pytest.raises(ConfigError, match=r"`rope_theta` \(10000.0\) and `rope_scaling.rope_theta` \(1000.0\) "
                                          "disagree"):
        dlmjax.load_model(tmp_path / "new")


@pytest.mark.parametrize("family, changes, lost, hint", [
    ("qwen3", dict(attention="block_causal", block_size=4), "'attention': 'block_causal'", "family sdar"),
    ("llama", dict(shift_logits=True), "'shift_logits': True", None),
    ("qwen3", dict(rotary_dim=4), "'rotary_dim': 4", None),
    ("llada", dict(o_bias=True), "'o_bias': True", None),
    ("llada", dict(qk_norm=True), "'qk_norm': True", None),
    ("sdar", dict(attention="bidirectional", block_size=None), "'attention': 'bidirectional'", None),
    # modeling_dream.py takes hidden_size / num_attention_heads and reads no head_dim
    ("dream", dict(head_dim=8), "head_dim", None),
])
def test_export_refuses_a_config_its_familys_checkpoint_cannot_hold(family, changes, lost, hint):
    """A config.json that would load as another model (other attention, logits, norms or biases)
    is refused on export, naming what is lost, and the family that holds it where one does."""
    from dlmjax.config import ConfigError, ModelConfig, to_hf_config

    fam = dlmjax.config.FAMILIES[family]
    cfg = ModelConfig(vocab_size=96, **{**PRESETS["random-qwen3"], "family": family, "attention": fam.attention,
                                        "shift_logits": fam.shift_logits, "qk_norm": fam.qk_norm,
                                        "block_size": 4 if fam.attention == "block_causal" else None,
                                        "qkv_bias": family in dlmjax.config.QWEN2_BIAS_FAMILIES})
    to_hf_config(cfg)  # the family's own settings export
    cfg = cfg.replace(**changes)
    with pytest.raises(ConfigError, match=f"family {family}'s config.json cannot express .*{lost}") as err:
        to_hf_config(cfg)
    if hint:
        assert hint in str(err.value)


def test_a_toy_backbone_its_family_cannot_export_is_refused_before_training(tmp_path):
    from dlmjax.train.config import RunConfigError, load_run_config

    with pytest.raises(RunConfigError, match="configs/toy-sdar.yaml with the overrides model.family=qwen3 train.init_from=null: model: family qwen3's "
                                             "config.json cannot "
                                             "express .*family sdar"):  # refused where the file is read
        load_run_config("configs/toy-sdar.yaml", ["model.family=qwen3", "train.init_from=null"])


def test_legacy_inv_freq_buffers_are_ignored_as_transformers_ignores_them(tmp_path):
    llama = torch_model("llama")
    tensors = state_dict_numpy(llama)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    config = json.loads(llama.config.to_json_string())
    path = write_checkpoint(tmp_path / "old", config, tensors)
    tokens = random_tokens(1, 8)
    assert max_diff(dlmjax.load_model(path)(jnp.asarray(tokens)).logits, torch_logits(llama, tokens)) <= TOL


def test_llada_configs_must_name_what_llada_defaults_otherwise():
    """LLaDA's own defaults are LayerNorm, no RoPE, the sequential block: a config.json without
    those keys is not the model dlmjax implements."""
    from dlmjax.config import ConfigError, from_hf_config

    full = _llada_config(torch_model("llama").config)
    for key in ("layer_norm_type", "rope", "block_type", "activation_type"):
        with pytest.raises(ConfigError, match=f"lacks required keys \\['{key}'\\]"):
            from_hf_config({k: v for k, v in full.items() if k != key})
    with pytest.raises(ConfigError, match="activation_type"):
        from_hf_config({**full, "activation_type": "swiglu"})


def test_absent_head_dim_and_kv_heads_take_transformers_defaults(tmp_path):
    """A config.json without head_dim, num_key_value_heads or max_position_embeddings means what
    transformers' config class defaults it to: Qwen3's head_dim is 128 (not hidden / heads), Qwen2's
    and Qwen3's KV heads 32, Llama's KV heads its heads; 32768 positions for Qwen2 and Qwen3, 2048
    for Llama (dlmjax's generation limit, written out on export). Logits equal transformers' loaded
    from the same files."""
    cases = [("qwen3", dict(head_dim=128, num_key_value_heads=32, num_attention_heads=32), ("head_dim",
                                                                                         "num_key_value_heads")),
             ("qwen2", dict(num_key_value_heads=32, num_attention_heads=32, hidden_size=64), ("num_key_value_heads",)),
             ("llama", dict(num_key_value_heads=4, head_dim=8), ("num_key_value_heads", "head_dim"))]
    cases = [(kind, shape, (*dropped, "max_position_embeddings")) for kind, shape, dropped in cases]
    tokens = random_tokens(1, 6)
    for kind, shape, dropped in cases:
        path = tmp_path / kind
        torch_model(kind, **shape).save_pretrained(path)
        config = json.loads((path / "config.json").read_text())
        for key in dropped:
            config.pop(key)
        (path / "config.json").write_text(json.dumps(config))
        expected = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
        ours = dlmjax.load_model(path)
        assert (ours.config.head_dim, ours.config.num_kv_heads, ours.config.max_position_embeddings) == (
            expected.config.head_dim, expected.config.num_key_value_heads, expected.config.max_position_embeddings), kind
        assert max_diff(ours(jnp.asarray(tokens)).logits, torch_logits(expected, tokens)) <= TOL, kind


def test_sliding_window_with_every_layer_type_full_loads_as_full_attention(tmp_path):
    """`layer_types` decides where transformers windows, when it is given: all full_attention with
    `use_sliding_window: true` is a model without a window."""
    qwen2 = torch_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0,
                        layer_types=["full_attention", "full_attention"])
    qwen2.save_pretrained(tmp_path / "q")
    assert json.loads((tmp_path / "q" / "config.json").read_text())["use_sliding_window"] is True
    tokens = random_tokens(2, 12)
    assert max_diff(dlmjax.load_model(tmp_path / "q")(jnp.asarray(tokens)).logits, torch_logits(qwen2, tokens)) <= TOL


def test_a_sliding_window_no_layer_uses_loads_as_full_attention(tmp_path):
    """Qwen2 windows only the layers from `max_window_layers` on: with it at the layer count,
    `use_sliding_window: true` leaves every layer in full attention (transformers' layer_types)."""
    qwen2 = torch_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert set(qwen2.config.layer_types) == {"full_attention"}
    qwen2.save_pretrained(tmp_path / "q")
    tokens = random_tokens(2, 12)
    assert max_diff(dlmjax.load_model(tmp_path / "q")(jnp.asarray(tokens)).logits, torch_logits(qwen2, tokens)) <= TOL
