"""A character-level tokenizer saved as a real tokenizer.json (HF `tokenizers` format).

Specials first (pad, eos, mask), then printable ASCII and newline; one token per character.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD, EOS, MASK, UNK = "<|pad|>", "<|endoftext|>", "<|mask|>", "<|unk|>"
SPECIALS = (PAD, EOS, MASK, UNK)
CHARS = tuple(chr(i) for i in range(32, 127)) + ("\n",)


def char_tokenizer(chars: tuple[str, ...] = CHARS) -> Tokenizer:
    vocab = {token: i for i, token in enumerate(SPECIALS + tuple(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # every character, newlines too
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """The special-token ids (pad, eos, mask) and the vocabulary size of a character tokenizer."""
    return {"pad": tok.token_to_id(PAD), "eos": tok.token_to_id(EOS), "mask": tok.token_to_id(MASK),
            "vocab_size": tok.get_vocab_size()}


def save_char_tokenizer(out_dir: str | Path, chars: tuple[str, ...] = CHARS) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json; returns the special-token ids."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = char_tokenizer(chars)
    tok.save(str(out_dir / "tokenizer.json"))
    # tokenizer_class: without it transformers' AutoTokenizer takes the model type's class (Qwen2's for
    # qwen3/sdar), which re-tokenises the text its own way and drops the newline this vocabulary holds
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": PAD, "eos_token": EOS, "mask_token": MASK,
              "unk_token": UNK, "model_max_length": 4096}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return special_ids(tok)
