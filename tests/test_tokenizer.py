"""Tokenizer loading from a checkpoint directory: special ids per family and chat templates."""

import json

import pytest

from dlmjax.config import ModelConfig
from dlmjax.io.tokenizer import TokenizerError, load_tokenizer
from dlmjax.toy.tokenizer import EOS, MASK, PAD, char_tokenizer, save_char_tokenizer


def config(family, mask=None):
    return ModelConfig(family=family, vocab_size=104, hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=2, num_kv_heads=2, head_dim=4, mask_token_id=mask,
                       attention="block_causal" if family == "sdar" else "causal",
                       block_size=4 if family == "sdar" else None)


def test_char_tokenizer_roundtrip(tmp_path):
    ids = save_char_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    text = "12+30=42\n#### 42"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) == len(text)
    assert (tok.mask_id, tok.eos_id, tok.pad_id) == (ids["mask"], ids["eos"], ids["pad"])
    assert tok.decode([ids["mask"], *tok.encode("ab"), ids["eos"]]) == "ab"


def test_mask_id_from_config_wins(tmp_path):
    save_char_tokenizer(tmp_path)
    assert load_tokenizer(tmp_path, config("sdar", mask=7)).mask_id == 7


def test_family_mask_string_is_found(tmp_path):
    tok = char_tokenizer()
    tok.add_special_tokens(["<|MASK|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    loaded = load_tokenizer(tmp_path, config("sdar"))
    assert loaded.mask_id == tok.token_to_id("<|MASK|>")
    assert loaded.pad_id == loaded.eos_id == tok.token_to_id(EOS)  # pad falls back to eos


def test_missing_mask_is_a_clear_error(tmp_path):
    char_tokenizer().save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path, config("qwen3"))
    assert tok.mask_id is None
    with pytest.raises(TokenizerError, match="no mask token"):
        tok.require_mask()


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="missing tokenizer.json"):
        load_tokenizer(tmp_path)


def test_chat_template(tmp_path):
    save_char_tokenizer(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    cfg_path.write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == f"<user>hi{EOS}<assistant>"
    assert PAD != EOS != MASK


def test_generation_config_stop_ids_end_a_chat_turn(tmp_path):
    """Qwen-based chat checkpoints (SDAR-Chat) name <|endoftext|> in config.json and their turn's
    end <|im_end|> in generation_config.json: decoding stops at either, as transformers' generate()
    and SDAR's evaluation do. Here toy-sdar's config keeps its EOS and generation_config.json adds
    the newline token, which every toy-arith answer holds: rows then end at their first newline."""
    import shutil

    import dlmjax
    from dlmjax.decoding.api import generate
    from dlmjax.presets import resolve_model

    model_dir = tmp_path / "toy-sdar"
    shutil.copytree(resolve_model("toy-sdar"), model_dir)
    model = dlmjax.load_model(model_dir)
    newline = load_tokenizer(model_dir, model.config).encode("\n")[0]
    prompts = ["14+2+2\n", "3+17-2\n"]
    plain = generate(model, prompts, tokenizer=load_tokenizer(model_dir, model.config), max_new_tokens=24)
    assert all(newline in row.tokens[:-1] for row in plain.rows)  # they go on past a newline
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [newline, 5]}))
    tok = load_tokenizer(model_dir, model.config)
    assert tok.stop_ids == (newline, 5, tok.eos_id)
    stopped = generate(model, prompts, tokenizer=tok, max_new_tokens=24)
    for row, full in zip(stopped.rows, plain.rows):
        cut = full.tokens.index(newline) + 1
        assert row.tokens == full.tokens[:cut]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": "\n"}))
    with pytest.raises(TokenizerError, match="generation_config.json: eos_token_id"):
        load_tokenizer(model_dir, model.config)
