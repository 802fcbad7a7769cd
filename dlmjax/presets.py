"""Named models usable wherever a checkpoint directory is: `--model toy-sdar`.

`toy-sdar` and `toy-ar` are trained toy models shipped inside the package (dlmjax/toy/checkpoints;
how each was made is in its TRAINING.md).

A preset is materialised once as a real HF checkpoint directory (config.json, model.safetensors,
tokenizer.json) under `$DLMJAX_CACHE` (default ~/.cache/dlmjax) and then loaded like any other.
The random presets are untrained: they exercise the whole pipeline, not the quality of text.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dlmjax.config import ModelConfig
from dlmjax.heads.mrp import MRPHead, has_head, load_head
from dlmjax.io.hf import export_model, load_model
from dlmjax.io.tokenizer import Tokenizer, load_tokenizer
from dlmjax.models.transformer import Transformer, init_model
from dlmjax.toy.tokenizer import save_char_tokenizer

_TINY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             max_position_embeddings=512, qk_norm=True)
PRESETS: dict[str, dict] = {
    "random-sdar": dict(family="sdar", attention="block_causal", block_size=4, **_TINY),
    "random-qwen3": dict(family="qwen3", attention="causal", **_TINY),
}


SHIPPED_DIR = Path(__file__).parent / "toy" / "checkpoints"
SHIPPED = ("toy-sdar", "toy-ar")


def preset_names() -> tuple[str, ...]:
    return SHIPPED + tuple(PRESETS)


def cache_dir() -> Path:
    return Path(os.environ.get("DLMJAX_CACHE", Path.home() / ".cache" / "dlmjax"))


def _build(name: str, out_dir: Path) -> Path:
    tmp = out_dir.with_name(f"{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    ids = save_char_tokenizer(tmp)
    cfg = ModelConfig(vocab_size=ids["vocab_size"], mask_token_id=ids["mask"], eos_token_ids=(ids["eos"],),
                      pad_token_id=ids["pad"], **PRESETS[name])
    export_model(init_model(cfg, seed=0), tmp)
    try:
        tmp.rename(out_dir)  # atomic: a half-built preset is never picked up
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_model(name_or_dir: str | os.PathLike) -> Path:
    """A checkpoint directory for a path or a preset name."""
    path = Path(name_or_dir)
    if path.is_dir():
        return path
    if str(name_or_dir) in SHIPPED:
        shipped = SHIPPED_DIR / str(name_or_dir)
        if not (shipped / "config.json").is_file():
            raise FileNotFoundError(f"the shipped model {name_or_dir} is missing from {shipped}; reinstall dlmjax "
                                    f"or rebuild it with scripts/train_toy.sh")
        return shipped
    if str(name_or_dir) in PRESETS:
        target = cache_dir() / "presets" / str(name_or_dir)
        return target if (target / "config.json").is_file() else _build(str(name_or_dir), target)
    raise FileNotFoundError(
        f"--model {name_or_dir!r} is neither a checkpoint directory nor a preset; presets: {', '.join(preset_names())}"
    )


def load_checkpoint(name_or_dir: str | os.PathLike, *, dtype: str | None = None,
                    head_from: str | os.PathLike | None = None) -> tuple[Path, Transformer, Tokenizer, MRPHead | None]:
    """(checkpoint dir, model, tokenizer, MRP head or None) for a path or preset name. The head
    comes from `head_from` (a path or preset), else from the model's own directory if it holds one."""
    path = resolve_model(name_or_dir)
    model = load_model(path, dtype=dtype)
    head_dir = resolve_model(head_from) if head_from else path
    head = load_head(head_dir, model.config) if head_from or has_head(path) else None
    return path, model, load_tokenizer(path, model.config), head
