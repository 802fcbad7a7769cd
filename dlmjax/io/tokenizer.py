"""Tokenizers from a checkpoint directory: tokenizer.json, chat template, special-token ids.

Uses the `tokenizers` library directly (no transformers needed). The mask token is resolved
per family: config.json `mask_token_id`, else tokenizer_config.json `mask_token`, else the
family's known mask strings (`<|mdm_mask|>` LLaDA, `<|mask|>` Dream, `<|MASK|>` SDAR).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as _Backend

from dlmjax.config import FAMILIES, ModelConfig
from dlmjax.validation import InputError, read_json_file


class TokenizerError(InputError):
    """A tokenizer that cannot serve the requested use."""


@dataclass
class Tokenizer:
    backend: _Backend
    mask_id: int | None
    eos_id: int | None
    pad_id: int | None
    bos_id: int | None
    chat_template: str | None = None
    stop_ids: tuple[int, ...] = ()  # generation_config.json's eos_token_id(s), then eos_id: where a chat turn ends

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **template_vars) -> str:
        """The chat template rendered over `messages`; `template_vars` are further variables the
        template reads (e.g. Qwen3's enable_thinking=False)."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template; pass raw prompts instead")
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_str(self.bos_id),
            eos_token=self._token_str(self.eos_id),
            **template_vars,
        )

    def require_mask(self) -> int:
        if self.mask_id is None:
            raise TokenizerError(
                "the tokenizer has no mask token, which diffusion decoding needs; add one "
                "(e.g. '<|mask|>') to tokenizer.json and set mask_token_id in config.json"
            )
        return self.mask_id

    def _token_str(self, token_id: int | None) -> str:
        return "" if token_id is None else self.backend.id_to_token(token_id) or ""


def _raise_template_error(message):
    raise TokenizerError(f"chat template error: {message}")


def _special_token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(ckpt_dir: Path, tok_cfg: dict) -> str | None:
    jinja_file = ckpt_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def load_tokenizer(ckpt_dir: str | Path, cfg: ModelConfig | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint directory or preset name (as `dlmjax.load_model`)."""
    from dlmjax.io.hf import checkpoint_path

    ckpt_dir = checkpoint_path(ckpt_dir)
    path = ckpt_dir / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"missing tokenizer.json in {ckpt_dir}; save the fast tokenizer beside the weights "
            "(`AutoTokenizer.from_pretrained(...).save_pretrained(dir)`)"
        )
    try:
        backend = _Backend.from_file(str(path))
    except Exception as err:  # noqa: BLE001 (the tokenizers library raises a plain Exception)
        raise TokenizerError(f"{path} cannot be read as a tokenizer ({err}); re-save it with "
                             "`AutoTokenizer.from_pretrained(...).save_pretrained(dir)`") from None
    if cfg is not None and backend.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
        raise TokenizerError(
            f"{path} has {backend.get_vocab_size(with_added_tokens=True)} tokens but the model's vocab_size is "
            f"{cfg.vocab_size}: this tokenizer does not belong to the checkpoint; put the model's own tokenizer "
            "beside its weights")
    cfg_path = ckpt_dir / "tokenizer_config.json"
    tok_cfg = read_json_file(cfg_path, error=TokenizerError) if cfg_path.is_file() else {}
    if not isinstance(tok_cfg, dict):
        raise TokenizerError(f"{cfg_path} holds {type(tok_cfg).__name__}, not an object of settings")

    def lookup(name: str) -> int | None:
        content = _special_token_content(tok_cfg.get(name))
        return None if content is None else backend.token_to_id(content)

    family = FAMILIES.get(cfg.family) if cfg else None
    mask_id = cfg.mask_token_id if cfg and cfg.mask_token_id is not None else lookup("mask_token")
    if mask_id is None and family is not None:
        mask_id = next((backend.token_to_id(t) for t in family.mask_tokens if backend.token_to_id(t) is not None), None)
    eos_id = lookup("eos_token")
    if eos_id is None and cfg is not None:
        eos_id = cfg.eos_token_id
    pad_id = lookup("pad_token")
    if pad_id is None:
        pad_id = cfg.pad_token_id if cfg is not None and cfg.pad_token_id is not None else eos_id
    bos_id = lookup("bos_token")
    if bos_id is None and cfg is not None:
        bos_id = cfg.bos_token_id
    return Tokenizer(
        backend=backend, mask_id=mask_id, eos_id=eos_id, pad_id=pad_id, bos_id=bos_id,
        chat_template=_chat_template(ckpt_dir, tok_cfg), stop_ids=_stop_ids(ckpt_dir, eos_id),
    )


def _stop_ids(ckpt_dir: Path, eos_id: int | None) -> tuple[int, ...]:
    """The ids generation stops at besides config.json's: generation_config.json's
    `eos_token_id` (an id or a list; what transformers' generate() stops at: for Qwen-based chat
    models both <|im_end|> and <|endoftext|>, where config.json may name only the latter), then
    the tokenizer's eos token (SDAR's evaluation stops at both)."""
    path = ckpt_dir / "generation_config.json"
    raw = read_json_file(path, error=TokenizerError) if path.is_file() else {}
    if not isinstance(raw, dict):
        raise TokenizerError(f"{path} holds {type(raw).__name__}, not an object of settings")
    ids = raw.get("eos_token_id")
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise TokenizerError(f"{path}: eos_token_id {raw.get('eos_token_id')!r} must be a token id or a list of "
                             "them; fix or remove it")
    ids += [] if eos_id is None else [eos_id]
    return tuple(dict.fromkeys(ids))
