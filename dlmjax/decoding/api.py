"""`dlmjax.generate`: prompts in, text and metrics out, for every decoder and family."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import jax
import numpy as np
from flax import nnx

from dlmjax.decoding import engine
from dlmjax.decoding.ar import generate_ar
from dlmjax.decoding.spec import AR, DecoderSpecError, DiffusionDecoder, decoder_spec, parse_decoder
from dlmjax.heads.mrp import MRPHead, check_compatible
from dlmjax.io.tokenizer import Tokenizer
from dlmjax.models.transformer import Transformer
from dlmjax.sharding import shard_batch

DEFAULT_BIDIRECTIONAL_BLOCK = 32


@dataclass
class RowResult:
    text: str | None
    tokens: list[int]  # generated ids up to and including EOS
    nfe: int  # denoising forwards this row used (AR: decode steps)
    tpf: float  # committed tokens / NFE
    num_tokens: int  # len(tokens)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class GenerationResult:
    rows: list[RowResult]
    decoder: str
    nfe: int  # denoising forwards run for the batch
    prefill_forwards: int
    store_forwards: int
    tpf: float  # committed tokens / row NFE over all rows
    wall_s: float  # the decode call, compilation included on a first call
    tokens_per_s: float  # generated tokens (up to EOS) / wall_s


def _resolve_decoder(decoder) -> DiffusionDecoder | AR:
    return parse_decoder(decoder) if isinstance(decoder, str) else decoder


def _encode(prompts, tokenizer: Tokenizer | None) -> list[list[int]]:
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer: pass tokenizer=load_tokenizer(checkpoint_dir)")
        ids = [tokenizer.encode(p) for p in prompts]
    else:
        ids = [list(map(int, p)) for p in prompts]
    for i, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    return ids


def _special_ids(model: Transformer, tokenizer: Tokenizer | None, *, need_mask: bool):
    cfg = model.config
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else (tokenizer.mask_id if tokenizer else None)
    if need_mask and mask_id is None:
        raise ValueError(
            "no mask token: diffusion decoding needs one; set mask_token_id in config.json or add a mask "
            "token (e.g. '<|mask|>') to the tokenizer"
        )
    eos = tuple(cfg.eos_token_ids) or ((tokenizer.eos_id,) if tokenizer and tokenizer.eos_id is not None else ())
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (tokenizer.pad_id if tokenizer else None)
    pad = pad if pad is not None else (eos[0] if eos else 0)
    return mask_id, eos, int(pad)


def _block_size(decoder: DiffusionDecoder, model: Transformer) -> int:
    cfg = model.config
    if cfg.attention == "block_causal":
        if decoder.block not in (None, cfg.block_size):
            raise DecoderSpecError(
                f"block={decoder.block}: a block-causal model decodes in its own block size {cfg.block_size}"
            )
        return cfg.block_size
    return decoder.block or DEFAULT_BIDIRECTIONAL_BLOCK


def _cache_mode(decoder: DiffusionDecoder, model: Transformer) -> str:
    cfg = model.config
    if cfg.attention == "block_causal":
        if decoder.cache != "none":
            raise DecoderSpecError(
                f"cache={decoder.cache}: block-causal models always use the exact KV cache; drop the option"
            )
        if cfg.shift_logits:
            raise DecoderSpecError("block-causal decoding of a shifted-logit model is not supported")
        return "exact"
    return decoder.cache


def _head_for(decoder, model: Transformer, head: MRPHead | None):
    """(graphdef, params) of the head an mrp-* decoder needs, or (None, None)."""
    if not getattr(decoder, "needs_head", False):
        return None, None
    if model.config.attention != "block_causal":
        raise DecoderSpecError(f"{decoder.name} needs a block-causal backbone (SDAR); this model is "
                               f"{model.config.attention}")
    if head is None:
        raise DecoderSpecError(
            f"{decoder.name} needs an MRP head: pass head=load_head(checkpoint_dir) (CLI: a model directory "
            "with mrp_modules.* tensors, or --mrp-head DIR); train one with `dlmjax train configs/mrp/toy-sdar.yaml`"
        )
    check_compatible(head, model.config)
    return nnx.split(head)


def _check_length(model: Transformer, prompt_len: int, max_new_tokens: int):
    limit = model.config.max_position_embeddings
    if prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's maximum "
            f"length {limit}; shorten the prompt or lower max_new_tokens"
        )


def generate(
    model: Transformer,
    prompts,
    *,
    tokenizer: Tokenizer | None = None,
    decoder="static",
    max_new_tokens: int = 64,
    seed: int = 0,
    row_ids=None,
    mesh=None,
    head: MRPHead | None = None,
) -> GenerationResult:
    """Decode a batch of prompts (text with a tokenizer, or token-id lists).

    decoder: a spec string (`static`, `static:k=2`, `threshold:tau=0.9`, `ar`, ...) or config.
    row_ids: each row's sampling-stream id (default: its index); give dataset indices to make a
      sampled output independent of which batch a prompt lands in.
    mesh: split the batch over the mesh's 'data' axis (data-parallel decoding; the batch size
      must divide by it). Place the model's params on the same mesh.
    head: the MRP head the mrp-* decoders run (`dlmjax.heads.mrp.load_head(checkpoint_dir)`).
    """
    decoder = _resolve_decoder(decoder)
    ids = _encode(prompts, tokenizer)
    _check_length(model, max(len(p) for p in ids), max_new_tokens)
    causal = model.config.attention == "causal"
    if isinstance(decoder, AR) != causal:
        kind = "causal" if causal else model.config.attention
        fix = "use --decoder ar" if causal else "use a diffusion decoder (static, threshold, entropy)"
        raise DecoderSpecError(f"decoder {decoder.name!r} does not fit a {kind} {model.config.family} model; {fix}")
    mask_id, eos, pad = _special_ids(model, tokenizer, need_mask=not causal)
    head_split = _head_for(decoder, model, head)

    start = time.perf_counter()
    if causal:
        out = generate_ar(model, ids, max_new_tokens=max_new_tokens, temperature=decoder.temperature,
                          top_p=decoder.top_p, seed=seed, eos_ids=eos, pad_id=pad, mesh=mesh)
        out = jax.device_get(out)
        # Each token comes from one forward (the prefill gives the first): TPF is 1 by definition.
        counts = np.asarray(out.num_generated)
        nfe_rows, committed, batch_nfe, prefill, stores = counts, counts, int(out.nfe), 0, 0
    else:
        block = _block_size(decoder, model)
        geometry, canvas, rows = engine.plan_layout(
            ids, block=block, max_new_tokens=max_new_tokens, block_causal=model.config.attention == "block_causal",
            pad_id=pad, mask_id=mask_id,
        )
        if row_ids is not None:
            if len(row_ids) != len(ids):
                raise ValueError(f"row_ids has {len(row_ids)} entries for {len(ids)} prompts; give one per prompt")
            rows = rows.replace(row_ids=np.asarray(row_ids, np.int32))
        if mesh is not None:
            canvas, rows = shard_batch((canvas, rows), mesh)
        graphdef, params = nnx.split(model)
        head_graphdef, head_params = head_split
        out = engine.decode(
            graphdef, params, canvas, rows, jax.random.key(seed), head_params, decoder=decoder, geometry=geometry,
            cache_mode=_cache_mode(decoder, model), mask_id=int(mask_id), pad_id=pad, eos_ids=eos,
            head_graphdef=head_graphdef,
        )
        out = jax.device_get(out)
        counts, nfe_rows, committed = map(np.asarray, (out.num_generated, out.nfe, out.committed))
        batch_nfe, prefill, stores = int(out.batch_nfe), int(out.prefill_forwards), int(out.store_forwards)
    wall = time.perf_counter() - start

    tokens = np.asarray(out.tokens)
    rows_out = []
    for i in range(len(ids)):
        row_tokens = tokens[i, : counts[i]].tolist()
        text = tokenizer.decode(row_tokens) if tokenizer is not None else None
        nfe = int(nfe_rows[i])
        rows_out.append(RowResult(text=text, tokens=row_tokens, nfe=nfe,
                                  tpf=float(committed[i]) / max(nfe, 1), num_tokens=len(row_tokens)))
    return GenerationResult(
        rows=rows_out,
        decoder=decoder_spec(decoder),
        nfe=batch_nfe,
        prefill_forwards=prefill,
        store_forwards=stores,
        tpf=float(np.sum(committed)) / max(int(np.sum(nfe_rows)), 1),
        wall_s=wall,
        tokens_per_s=float(np.sum(counts)) / max(wall, 1e-9),
    )
