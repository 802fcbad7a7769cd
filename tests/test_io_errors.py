"""Bad checkpoints fail with a clear message that names the problem and the fix."""

import json

import numpy as np
import pytest

import dlmjax
from dlmjax.config import ConfigError, from_hf_config
from dlmjax.io.safetensors import CheckpointError, SafetensorsFile
from dlmjax.io.tokenizer import load_tokenizer
from dlmjax.validation import InputError

QWEN3 = {
    "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "float32",
}


@pytest.fixture
def checkpoint(tmp_path):
    cfg = from_hf_config(QWEN3)
    return dlmjax.export_model(dlmjax.init_model(cfg), tmp_path / "ckpt")


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        dlmjax.load_model(checkpoint)


def test_a_training_run_or_a_drafter_given_as_the_model_names_what_to_pass(tmp_path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "config.yaml").write_text("objective: backbone\n")
    (run / "model" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"is a dlmjax training run; what it trained is in {run / 'model'}"):
        dlmjax.load_model(run)
    from dlmjax.io.hf import open_shards  # where weights are read (an MRP head given as --mrp-head RUN)

    with pytest.raises(CheckpointError, match="is a dlmjax training run"):
        open_shards(run)
    from dlmjax.presets import resolve_model

    drafter = resolve_model("toy-ar") / "drafter"
    with pytest.raises(CheckpointError, match="holds a DFlash drafter, not a model: pass it as --drafter DIR"):
        dlmjax.load_model(drafter)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist; pass a checkpoint directory or a preset .*toy-sdar"):
        dlmjax.load_model(tmp_path / "nowhere")


def test_the_python_api_takes_preset_names_as_the_cli_does():
    model = dlmjax.load_model("toy-sdar")  # the shipped model, as `--model toy-sdar`
    assert model.config.family == "sdar" and dlmjax.load_config("toy-ar").family == "qwen3"
    assert load_tokenizer("toy-sdar", model.config).encode("1+2=")


def test_a_preset_cache_folder_holding_something_else_is_named_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("DLMJAX_CACHE", str(tmp_path))
    stray = tmp_path / "presets" / "random-sdar"
    stray.mkdir(parents=True)
    (stray / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(InputError, match=r"random-sdar, which holds other files and no config.json; delete it"):
        dlmjax.load_model("random-sdar")
    (stray / "notes.txt").unlink()  # an empty folder is built into
    assert dlmjax.load_model("random-sdar").config.family == "sdar"


@pytest.mark.parametrize(
    "change,message",
    [
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}},
         r"`rope_scaling` = .*rope_type 'yarn' is not implemented \(default, linear and llama3 are\)"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
         r"`rope_parameters` = .*rope_type 'yarn' is not implemented"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0}},
         r"rope_type 'llama3' takes .*missing \['high_freq_factor', 'low_freq_factor', "
         r"'original_max_position_embeddings'\]"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
         r"partial_rotary_factor=0.5 inside `rope_parameters` is not implemented \(rotary over the whole head"),
        # transformers 5's spelling beside 4's, saying something else: which would a reader take?
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 1e6,
          "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
         r"`rope_parameters` .* and \{'rope_theta': 1000000.0, 'rope_scaling': .*\} disagree; keep one spelling"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 500000.0},
         r"`rope_parameters` .* and \{'rope_theta': 500000.0\} disagree; keep one spelling"),
    ],
)
def test_unsupported_rope_scaling(checkpoint, change, message):
    edit_config(checkpoint, **change)
    with pytest.raises(ConfigError, match=message):
        dlmjax.load_model(checkpoint)


def test_sliding_window_refused(checkpoint):
    edit_config(checkpoint, use_sliding_window=True, sliding_window=128)
    with pytest.raises(ConfigError, match="use_sliding_window.*sliding-window attention is not implemented"):
        dlmjax.load_model(checkpoint)


def test_unknown_key_is_named(checkpoint):
    edit_config(checkpoint, fancy_new_feature=3)
    with pytest.raises(ConfigError, match=r"unknown config keys \['fancy_new_feature'\]"):
        dlmjax.load_model(checkpoint)


def test_unsupported_model_type_lists_supported(checkpoint):
    edit_config(checkpoint, model_type="mamba")
    with pytest.raises(ConfigError, match="model_type='mamba' is not supported; supported model types: .*qwen3"):
        dlmjax.load_model(checkpoint)


def test_truncated_shard(checkpoint):
    shard = checkpoint / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated shard: tensors need"):
        dlmjax.load_model(checkpoint)


def _raw_safetensors(path, header: object, data: bytes = b"\0" * 8):
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)
    return path


@pytest.mark.parametrize("header,problem", [
    ([1, 2], r"a JSON list, not an object"),
    ({"a": {"dtype": "F32", "shape": [1]}}, r"tensor 'a' has data_offsets None"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, r"data_offsets \[-4, 0\], not \[begin, end\]"),
    ({"a": {"dtype": "F32", "shape": [-1, -1], "data_offsets": [0, 4]}}, r"shape \[-1, -1\], not a list"),
    ({"a": "F32"}, r"tensor 'a' is 'F32', not an object"),
    ({"__metadata__": ["x"]}, r"__metadata__ is \['x'\], not an object of strings"),
    ({"__metadata__": {"format": 1}}, r"__metadata__ is \{'format': 1\}, not an object of strings"),
])
def test_a_corrupt_safetensors_header_is_named(tmp_path, header, problem):
    """Each header entry is checked before anything is read: a negative offset used to read the
    header's own bytes as a weight."""
    path = _raw_safetensors(tmp_path / "bad.safetensors", header)
    with pytest.raises(CheckpointError, match=f"bad.safetensors: corrupt safetensors header.*{problem}"):
        SafetensorsFile(path)


def test_a_header_that_is_not_utf8_or_a_shape_past_int64_is_named(tmp_path):
    """A damaged byte in the header, and a shape whose element count wraps around in int64 (to 0,
    which matched an empty byte range): both are CheckpointErrors, not raw decode/numpy errors."""
    blob = json.dumps({"w\u00e9": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode().replace(b"\\u00e9", b"\xff")
    (tmp_path / "bytes.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + b"\0" * 8)
    with pytest.raises(CheckpointError, match="bytes.safetensors: corrupt safetensors header .*utf-8"):
        SafetensorsFile(tmp_path / "bytes.safetensors")
    path = _raw_safetensors(tmp_path / "huge.safetensors", {"w": {"dtype": "F32", "shape": [2**32, 2**32],
                                                                  "data_offsets": [0, 0]}})
    with pytest.raises(CheckpointError, match=r"tensor 'w': byte range does not match shape \(4294967296, 4294967296\)"):
        SafetensorsFile(path).get("w")


def test_a_scalar_tensor_reads_and_writes_as_a_scalar(tmp_path):
    """A 0-d tensor holds one value (the official library's reading): it used to read as 0 and
    be written as shape [1]."""
    header = {"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}
    path = _raw_safetensors(tmp_path / "scalar.safetensors", header, np.float32(3.5).tobytes())
    assert SafetensorsFile(path).get("s").shape == () and float(SafetensorsFile(path).get("s")) == 3.5
    dlmjax.io.safetensors.save_file({"s": np.float32(2.5), "v": np.zeros(2, np.float32)}, tmp_path / "out.safetensors")
    back = SafetensorsFile(tmp_path / "out.safetensors")
    assert back.get("s").shape == () and float(back.get("s")) == 2.5 and back.get("v").shape == (2,)


def test_missing_tensor(checkpoint):
    shard = SafetensorsFile(checkpoint / "model.safetensors")
    tensors = {k: np.array(shard.get(k)) for k in shard.keys() if k != "model.layers.0.mlp.up_proj.weight"}
    dlmjax.io.safetensors.save_file(tensors, checkpoint / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.0.mlp.up_proj.weight'\]"):
        dlmjax.load_model(checkpoint)


def test_unknown_tensor_dtype(checkpoint):
    shard = checkpoint / "model.safetensors"
    data = bytearray(shard.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + header_len].decode()
    # I32 has the same width as F32, so the file stays consistent; only the dtype is refused.
    data[8 : 8 + header_len] = header.replace('"F32"', '"I32"', 1).encode()
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="dtype 'I32', which dlmjax cannot load; supported: F64, F32, F16, BF16"):
        dlmjax.load_model(checkpoint)


def test_unknown_config_dtype(checkpoint):
    edit_config(checkpoint, dtype="float8_e4m3")
    with pytest.raises(ConfigError, match="dtype 'float8_e4m3' is unknown; supported: float32, bfloat16, float16"):
        dlmjax.load_model(checkpoint)


def test_unknown_load_dtype(checkpoint):
    with pytest.raises(ConfigError, match="unknown dtype 'int8'"):
        dlmjax.load_model(checkpoint, dtype="int8")


def test_shape_mismatch(checkpoint):
    edit_config(checkpoint, intermediate_size=48)
    with pytest.raises(CheckpointError, match="shape mismatch for 'model.layers.0.mlp"):
        dlmjax.load_model(checkpoint)


def test_a_fused_part_with_the_wrong_shape_is_named_with_its_config_field(checkpoint):
    """q/k/v are one fused param in dlmjax; a bad q_proj is still reported as q_proj, not as qkv."""
    shard = SafetensorsFile(checkpoint / "model.safetensors")
    tensors = {k: np.array(shard.get(k)) for k in shard.keys()}
    tensors["model.layers.0.self_attn.q_proj.weight"] = np.zeros((24, 32), np.float32)  # 3 heads of 8, not 4
    dlmjax.io.safetensors.save_file(tensors, checkpoint / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'model.layers.0.self_attn.q_proj.weight' in "
                                              r".*model.safetensors: checkpoint "
                                              r"\(32, 24\) after transpose, config expects \(32, 32\) \(its columns: "
                                              r"num_attention_heads x head_dim\)"):
        dlmjax.load_model(checkpoint)


def test_unexpected_tensor(checkpoint):
    shard = SafetensorsFile(checkpoint / "model.safetensors")
    tensors = {k: np.array(shard.get(k)) for k in shard.keys()}
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    dlmjax.io.safetensors.save_file(tensors, checkpoint / "model.safetensors")
    with pytest.raises(CheckpointError, match="has no place in a qwen3 model with this config .*qkv_bias=False"):
        dlmjax.load_model(checkpoint)


def test_a_tensor_of_a_layer_the_config_lacks_names_the_layer_count(tmp_path):
    two_layers = dlmjax.export_model(dlmjax.init_model(from_hf_config({**QWEN3, "num_hidden_layers": 2})), tmp_path / "c")
    edit_config(two_layers, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"in .*model.safetensors is for layer 1, but config.json says "
                                              r"num_hidden_layers=1"):
        dlmjax.load_model(two_layers)


def test_a_missing_head_names_tie_word_embeddings(checkpoint):
    shard = SafetensorsFile(checkpoint / "model.safetensors")
    tensors = {k: np.array(shard.get(k)) for k in shard.keys() if k != "lm_head.weight"}
    dlmjax.io.safetensors.save_file(tensors, checkpoint / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors \['lm_head.weight'\]; a head tied to the embedding "
                                              "needs tie_word_embeddings: true"):
        dlmjax.load_model(checkpoint)


def test_a_tied_config_with_a_different_saved_head_is_refused_and_an_equal_one_loads(checkpoint):
    """A fine-tune that trained its head but kept the base config's tie_word_embeddings: transformers 5
    uses the saved head, transformers 4 and vLLM the embedding; dlmjax refuses to pick one silently."""
    edit_config(checkpoint, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="ties the output head to the embedding .* the checkpoint's 'lm_head.weight' "
                                          "differs from 'model.embed_tokens.weight': set it to false"):
        dlmjax.load_model(checkpoint)
    shard = SafetensorsFile(checkpoint / "model.safetensors")
    tensors = {k: np.array(shard.get(k)) for k in shard.keys()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()  # a tied head saved explicitly
    dlmjax.io.safetensors.save_file(tensors, checkpoint / "model.safetensors")
    ids = np.arange(6, dtype=np.int32)[None]
    with_head = np.asarray(dlmjax.load_model(checkpoint)(ids).logits)
    del tensors["lm_head.weight"]  # tied as transformers saves it
    dlmjax.io.safetensors.save_file(tensors, checkpoint / "model.safetensors")
    np.testing.assert_array_equal(with_head, np.asarray(dlmjax.load_model(checkpoint)(ids).logits))


@pytest.mark.parametrize("change", [
    {"is_llama_config": True, "rope_interleaved": False},  # SmolLM2's published configs (nanotron exports)
    {"pretraining_tp": 2},  # Llama-2-13b's: the same matmuls split into slices
])
def test_published_bookkeeping_keys_load_with_the_same_weights(checkpoint, change):
    ids = np.arange(6, dtype=np.int32)[None]
    before = np.asarray(dlmjax.load_model(checkpoint)(ids).logits)
    edit_config(checkpoint, **change)
    np.testing.assert_array_equal(np.asarray(dlmjax.load_model(checkpoint)(ids).logits), before)


def test_interleaved_rope_is_refused(checkpoint):
    edit_config(checkpoint, rope_interleaved=True)
    with pytest.raises(ConfigError, match="`rope_interleaved` = True .*interleaved \\(GPT-J\\) RoPE is not implemented"):
        dlmjax.load_model(checkpoint)


def test_null_key_value_heads_means_one_per_attention_head():
    """As Qwen2/Qwen3Config (and Dream's and SDAR's) read it; an absent key keeps their default of 32."""
    assert from_hf_config({**QWEN3, "num_key_value_heads": None}).num_kv_heads == 4
    for model_type in ("qwen2", "dream", "sdar", "llama"):
        raw = {**QWEN3, "model_type": model_type, "num_key_value_heads": None, "mask_token_id": 3}
        assert from_hf_config(raw).num_kv_heads == 4, model_type


def test_llada_without_weight_tying_is_tied_as_in_its_config_class():
    raw = {"model_type": "llada", "d_model": 32, "n_heads": 4, "n_layers": 1, "mlp_hidden_size": 64, "vocab_size": 64,
           "activation_type": "silu", "block_type": "llama", "rope": True, "layer_norm_type": "rms", "mask_token_id": 63}
    assert from_hf_config(raw).tie_word_embeddings
    assert not from_hf_config({**raw, "weight_tying": False}).tie_word_embeddings


def test_duplicate_tensor_across_shards(checkpoint):
    shard = SafetensorsFile(checkpoint / "model.safetensors")
    name = "model.norm.weight"
    dlmjax.io.safetensors.save_file({name: np.array(shard.get(name))}, checkpoint / "extra.safetensors")
    with pytest.raises(CheckpointError, match="duplicate tensor 'model.norm.weight'"):
        dlmjax.load_model(checkpoint)


def test_no_safetensors(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        dlmjax.load_model(checkpoint)


def test_block_causal_needs_block_size():
    with pytest.raises(ConfigError, match="block_causal attention needs block_size"):
        dlmjax.ModelConfig(family="sdar", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                           num_heads=2, num_kv_heads=2, head_dim=4, attention="block_causal")


def test_config_roundtrip_for_every_family():
    from dlmjax.config import FAMILIES, to_hf_config

    for family in FAMILIES:
        if FAMILIES[family].layout in ("llada_moe", "llada2"):
            continue  # their own config keys: tests/test_moe_families.py round-trips them
        if FAMILIES[family].layout == "llada":
            cfg = dlmjax.ModelConfig(family="llada", vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_layers=1, num_heads=4, num_kv_heads=4, head_dim=8,
                                     attention="bidirectional", mask_token_id=63, rms_norm_eps=1e-5)
        else:
            cfg = from_hf_config({**QWEN3, "model_type": FAMILIES[family].model_types[0]})
        if family in ("qwen2", "dream"):
            assert cfg.qkv_bias and not cfg.o_bias
        assert from_hf_config(to_hf_config(cfg)) == cfg, family


def test_a_controller_beside_an_unindexed_checkpoint_is_not_a_shard(checkpoint):
    """A TSPD controller stored beside a model whose weights have no index is not read as weights."""
    name = "model.norm.weight"  # a name the model has: read as a shard it would be a duplicate
    dlmjax.io.safetensors.save_file({name: np.ones(32, np.float32)}, checkpoint / "tspd_controller.safetensors")
    assert not (checkpoint / "model.safetensors.index.json").exists()
    assert dlmjax.load_model(checkpoint).config.hidden_size == 32
