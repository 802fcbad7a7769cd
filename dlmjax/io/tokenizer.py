"""Tokenizers from a checkpoint directory: tokenizer.json, chat template, special-token ids.

Uses the `tokenizers` library directly (no transformers needed). The mask token is resolved
per family: config.json `mask_token_id`, else tokenizer_config.json `mask_token`, else the
family's known mask strings (`<|mdm_mask|>` LLaDA, `<|mask|>` Dream, `<|MASK|>` SDAR).

Chat templates render as transformers renders them: in Jinja's immutable sandbox (a template
from a downloaded checkpoint cannot reach Python), with trim_blocks/lstrip_blocks, loop controls,
`{% generation %}` blocks, `raise_exception`, `strftime_now`, transformers' `tojson` (keys in
order, non-ASCII kept) and the tokenizer_config.json special tokens as variables.
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

from dlmjax.config import FAMILIES, ModelConfig
from dlmjax.io.safetensors import refuse_git_lfs_pointer
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
    # tokenizer_config.json's bos/eos/pad/unk token strings, the chat template's variables (as transformers)
    template_tokens: dict = field(default_factory=dict)

    def encode(self, text: str) -> list[int]:
        """The text's ids alone, no special tokens added (continuations, stop strings, training rows)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str, special: bool = True) -> list[int]:
        """A prompt's ids as transformers' `tokenizer(text)` gives them: with the special tokens
        the tokenizer adds (Llama 3's BOS; none for Qwen, SDAR, Dream), unless the text already
        starts with the BOS token, as a chat template writes it (lm-eval's rule: no second BOS).
        `special=False`: none at all (`encode`)."""
        bos = self.template_tokens.get("bos_token")
        return self.backend.encode(text, add_special_tokens=special and not (bos and text.startswith(bos))).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **template_vars) -> str:
        """The chat template rendered over `messages` (as transformers renders it, module
        docstring); `template_vars` are further variables the template reads (e.g. Qwen3's
        enable_thinking=False, tools). `continue_final_message`: the text ends inside the last
        message (an assistant turn's prefix, lm-eval's gen_prefix), not after its end tokens."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template; pass raw prompts instead (CLI: drop --chat, "
                                 "or add --no-chat to a preset that sets chat)")
        if continue_final_message and (not messages or not isinstance(messages[-1].get("content"), str)):
            raise TokenizerError("continue_final_message needs a last message with text content to continue")
        if continue_final_message:
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_MARK}]
        values = {"tools": None, "documents": None, **self.template_tokens, **template_vars}
        try:
            text = _template(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                        **values)
        except jinja2.TemplateError as err:
            raise TokenizerError(f"chat template error: {err}") from None
        if not continue_final_message:
            return text
        if _CONTINUE_MARK.strip() not in text:
            raise TokenizerError("continue_final_message: the chat template dropped the last message's text, so it "
                                 "cannot be continued")
        at = text.rindex(_CONTINUE_MARK.strip())
        # a template that strips message text also strips the message's own trailing space
        return text[:at] if text[at : at + len(_CONTINUE_MARK)] == _CONTINUE_MARK else text[:at].rstrip()

    def user_turns(self, prompts: list[str], chat=True) -> list[str]:
        """Each prompt as a user turn of the chat template, ready for the answer (`chat`: True, or
        a dict of template variables, e.g. {"enable_thinking": False})."""
        template_vars = chat if isinstance(chat, dict) else {}
        return [self.apply_chat_template([{"role": "user", "content": p}], **template_vars) for p in prompts]

    def chat_row(self, prompt: str, answer: str, chat=True, stop_ids=None) -> tuple[str, str]:
        """A training row as the chat template writes the conversation: (the prompt as a user turn
        ready for the answer, as `user_turns` gives it with `training_chat_vars`; the assistant
        turn that follows it, the answer with the template's own framing, up to and including the
        first stop token after the answer's text). That is what the model writes before decoding
        stops: LLaDA's answer then `<|eot_id|>`, Dream's and Qwen's then `<|im_end|>`; a turn
        without a stop token is kept whole. `stop_ids`: where decoding stops (`decode_stop_ids`;
        default the tokenizer's `stop_ids`)."""
        template_vars = training_chat_vars(chat)
        (prompt_turn,) = self.user_turns([prompt], template_vars)
        conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        whole = self.apply_chat_template(conversation, add_generation_prompt=False, **template_vars)
        if not whole.startswith(prompt_turn):
            raise TokenizerError("the chat template writes this answer's turn elsewhere than after the prompt's turn "
                                 f"for generation ({prompt_turn[-40:]!r} is not followed by the answer; e.g. Qwen3's "
                                 "template moves a <think> block out of an answer rendered with enable_thinking: "
                                 "false)")
        turn = whole[len(prompt_turn):]
        after = self._answer_end(prompt_turn, turn, answer, conversation[:1], template_vars)
        stops = [self.backend.id_to_token(i) for i in (self.stop_ids if stop_ids is None else stop_ids)]
        ends = [turn.index(stop, after) + len(stop) for stop in stops if stop and stop in turn[after:]]
        return prompt_turn, turn[: min(ends)] if ends else turn

    def _answer_end(self, prompt_turn: str, turn: str, answer: str, user: list, template_vars: dict) -> int:
        """Where the answer's text ends in its rendered assistant `turn`: before the markup the
        template closes a turn with, as a placeholder answer shows it (a stop token's text inside
        the answer, or an answer such as "e" that the closing "<|im_end|>" holds, is not its end);
        for a template whose framing depends on the answer, after the answer's last occurrence."""
        marked = self.apply_chat_template(user + [{"role": "assistant", "content": _ANSWER_MARK}],
                                          add_generation_prompt=False, **template_vars)
        if marked.startswith(prompt_turn) and _ANSWER_MARK in marked:
            opening, _, closing = marked[len(prompt_turn):].partition(_ANSWER_MARK)
            if turn.startswith(opening) and turn.endswith(closing) and len(turn) >= len(opening) + len(closing):
                return len(turn) - len(closing)
        answer_at = turn.rfind(answer.strip())
        return answer_at + len(answer.strip()) if answer_at >= 0 else 0

    def require_mask(self) -> int:
        if self.mask_id is None:
            raise TokenizerError(
                "the tokenizer has no mask token, which diffusion decoding needs; add one "
                "(e.g. '<|mask|>') to tokenizer.json and set mask_token_id in config.json"
            )
        return self.mask_id


# The day training data is rendered at: a template that writes today's date (Llama 3.1's
# `strftime_now`) would make a run's rows depend on the day it runs, and a resume on another day
# would read other rows. Llama 3.1's own template falls back to this day.
TRAINING_DATE = datetime(2024, 7, 26)


def training_chat_vars(chat) -> dict:
    """The chat template's variables for training data (`chat`: True, or the user's variables):
    `strftime_now` answers TRAINING_DATE, so the rows are a function of the data alone."""
    return {**(chat if isinstance(chat, dict) else {}), "strftime_now": TRAINING_DATE.strftime}


_ANSWER_MARK = "\x00dlmjax-answer\x00"  # a placeholder answer, to find the markup around an answer
_CONTINUE_MARK = "\x00dlmjax-continue\x00 "  # appended to the message to continue; cut off after rendering


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (TRL's training templates mark the assistant's
    tokens so): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_template_error(message):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' `tojson`: keys in order, non-ASCII kept, no HTML escaping (Jinja's escapes)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# the named special tokens transformers 5 passes a chat template (its `special_tokens_map`)
TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _special_token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(ckpt_dir: Path, tok_cfg: dict) -> str | None:
    jinja_file = ckpt_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _declared_tokens(ckpt_dir: Path, tok_cfg: dict) -> dict[int, dict]:
    """{id: AddedToken fields} of the tokens tokenizer_config.json's `added_tokens_decoder` and
    added_tokens.json declare (transformers adds those tokenizer.json lacks)."""
    declared = {}
    decoder = tok_cfg.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{ckpt_dir / 'tokenizer_config.json'}: added_tokens_decoder must map ids to tokens")
    for i, token in decoder.items():
        token = token if isinstance(token, dict) else {"content": token}
        if not (str(i).isdigit() and isinstance(token.get("content"), str)):
            raise TokenizerError(f"{ckpt_dir / 'tokenizer_config.json'}: added_tokens_decoder entry {i!r}: {token!r} "
                                 "is not an id and a token")
        declared[int(i)] = token
    path = ckpt_dir / "added_tokens.json"
    extra = read_json_file(path, error=TokenizerError) if path.is_file() else {}
    if not (isinstance(extra, dict) and all(isinstance(i, int) and not isinstance(i, bool) for i in extra.values())):
        raise TokenizerError(f"{path} must map tokens to ids")
    for content, i in extra.items():
        declared.setdefault(i, {"content": content})
    return declared


def _add_declared_tokens(backend: _Backend, ckpt_dir: Path, tok_cfg: dict) -> None:
    """Add the declared tokens (`_declared_tokens`) that tokenizer.json lacks, each on its declared
    id, as transformers does. One whose id is taken or leaves a gap cannot be placed there: it is
    left out with a warning (what dlmjax did with every declared token before)."""
    from tokenizers import AddedToken

    held = backend.get_added_tokens_decoder()
    for i, token in sorted(_declared_tokens(ckpt_dir, tok_cfg).items()):
        flags = {k: bool(token[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in token}
        special = bool(token.get("special", False))
        if (known := backend.token_to_id(token["content"])) is not None:
            if special and (known not in held or not held[known].special):  # transformers takes the config's flag
                backend.add_special_tokens([AddedToken(token["content"], special=True, **flags)])  # same id
            continue
        size = backend.get_vocab_size(with_added_tokens=True)
        if i != size:
            warnings.warn(f"{ckpt_dir}: token {token['content']!r} is declared with id {i} (tokenizer_config.json or "
                          f"added_tokens.json), which tokenizer.json cannot give it (its next id is {size}): left "
                          "out; re-save the tokenizer with `AutoTokenizer.from_pretrained(dir).save_pretrained(dir)`",
                          stacklevel=3)
            continue
        added = AddedToken(token["content"], special=special, **flags)
        (backend.add_special_tokens if special else backend.add_tokens)([added])


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
    refuse_git_lfs_pointer(path, TokenizerError)
    try:
        backend = _Backend.from_file(str(path))
    except Exception as err:  # noqa: BLE001 (the tokenizers library raises a plain Exception)
        raise TokenizerError(f"{path} cannot be read as a tokenizer ({err}); re-save it with "
                             "`AutoTokenizer.from_pretrained(...).save_pretrained(dir)`") from None
    cfg_path = ckpt_dir / "tokenizer_config.json"
    tok_cfg = read_json_file(cfg_path, error=TokenizerError) if cfg_path.is_file() else {}
    if not isinstance(tok_cfg, dict):
        raise TokenizerError(f"{cfg_path} holds {type(tok_cfg).__name__}, not an object of settings")
    _add_declared_tokens(backend, ckpt_dir, tok_cfg)
    if cfg is not None and backend.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
        raise TokenizerError(
            f"{path} has {backend.get_vocab_size(with_added_tokens=True)} tokens but the model's vocab_size is "
            f"{cfg.vocab_size}: this tokenizer does not belong to the checkpoint; put the model's own tokenizer "
            "beside its weights")
    map_path = ckpt_dir / "special_tokens_map.json"  # older checkpoints name their special tokens only there
    token_map = read_json_file(map_path, error=TokenizerError) if map_path.is_file() else {}
    if not isinstance(token_map, dict):
        raise TokenizerError(f"{map_path} holds {type(token_map).__name__}, not an object of special tokens")
    tok_cfg = {**{k: v for k, v in token_map.items() if k.endswith("_token")},
               **{k: v for k, v in tok_cfg.items() if v is not None or k not in token_map}}

    special = {name: _special_token_content(value) for name, value in tok_cfg.items() if name.endswith("_token")}

    def lookup(name: str) -> int | None:
        return None if special.get(name) is None else backend.token_to_id(special[name])

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
    bos_id = lookup("bos_token")  # as transformers: the tokenizer's own (Qwen declares none), not config.json's
    # as transformers' special tokens map: the tokenizer's named tokens that are set (an unset one is undefined)
    template_tokens = {name: special[name] for name in TEMPLATE_TOKEN_NAMES if special.get(name) is not None}
    return Tokenizer(
        backend=backend, mask_id=mask_id, eos_id=eos_id, pad_id=pad_id, bos_id=bos_id,
        chat_template=_chat_template(ckpt_dir, tok_cfg), stop_ids=_checkpoint_stop_ids(ckpt_dir, eos_id),
        template_tokens=template_tokens,
    )


def decode_stop_ids(cfg: ModelConfig, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """Where a row stops: config.json's eos ids, then, with the checkpoint's tokenizer, its other
    stop ids (generation_config.json's, the tokenizer's eos): a chat model stops at the end of its
    turn."""
    return tuple(dict.fromkeys(tuple(cfg.eos_token_ids) + (tokenizer.stop_ids if tokenizer else ())))


def _checkpoint_stop_ids(ckpt_dir: Path, eos_id: int | None) -> tuple[int, ...]:
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
