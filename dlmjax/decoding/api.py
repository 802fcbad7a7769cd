"""`dlmjax.generate`: prompts in, text and metrics out, for every decoder and family."""

from __future__ import annotations

import operator
import time
from dataclasses import asdict, dataclass

import jax
import numpy as np
from flax import nnx

from dlmjax.decoding import engine
from dlmjax.decoding.ar import batch_row_ids, generate_ar
from dlmjax.decoding.spec import AR, CAUSAL_DECODERS, DecoderSpecError, DiffusionDecoder, decoder_spec, parse_decoder
from dlmjax.decoding.speculative import generate_with_drafter
from dlmjax.heads.mrp import MRPHead, check_compatible
from dlmjax.io.tokenizer import Tokenizer, decode_stop_ids
from dlmjax.models.transformer import Transformer
from dlmjax.sharding import on_mesh, shard_batch, to_host
from dlmjax.validation import InputError, check_seed, positive_int

DEFAULT_BIDIRECTIONAL_BLOCK = 32


@dataclass
class RowResult:
    """One prompt's output. Any max_new_tokens works: diffusion decoders decode the whole blocks
    that hold it and keep the first max_new_tokens, so `tokens` / `num_tokens` are the tokens
    kept, while `tpf` counts every token the decoder committed (whole blocks)."""

    text: str | None
    tokens: list[int]  # the tokens kept: at most max_new_tokens, up to and including EOS
    nfe: int  # denoising forwards this row used (AR: decode steps)
    tpf: float  # committed tokens / NFE
    num_tokens: int  # len(tokens)
    mean_accepted_length: float | None = None  # speculative decoders: tokens per verifying target forward

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class GenerationResult:
    rows: list[RowResult]
    decoder: str
    forwards: int  # model forwards run for the batch, of any kind
    tpf: float  # committed tokens / row NFE over all rows (what one row gains per forward it takes)
    batch_tpf: float  # committed tokens / (forwards x batch size) (what the batch gains per forward)
    wall_s: float  # the decode call, compilation included on a first call
    tokens_per_s: float  # generated tokens (up to EOS) / wall_s


def verifies_drafts(decoder) -> bool:
    """Speculative decoders (they report mean_accepted_length): mrp-spec, drafter, and PSD or the
    TSPD/CE policies with draft depth > 1."""
    return decoder.name in ("mrp-spec", "drafter") or getattr(decoder, "depth", 1) > 1


def _resolve_decoder(decoder) -> DiffusionDecoder | AR:
    if isinstance(decoder, str):
        return parse_decoder(decoder)
    if not isinstance(decoder, (DiffusionDecoder, *CAUSAL_DECODERS)):
        raise InputError(f"decoder={decoder!r} is neither a spec string nor a decoder; pass a spec ('threshold:tau=0.9') "
                         "or an instance (Threshold(tau=0.9)), not the class")
    return decoder


def _encode(prompts, tokenizer: Tokenizer | None, vocab_size: int) -> list[list[int]]:
    """Prompts (a list of texts, or of token-id lists) as token ids, each in [0, vocab_size)."""
    if isinstance(prompts, (str, bytes, bytearray)):
        raise InputError("prompts must be a list (of texts or of token-id lists); pass one prompt as [prompt]")
    if isinstance(prompts, np.ndarray):  # texts [B] (an object array: pandas' .to_numpy()), or ids [B, L]
        if prompts.dtype.kind in "USO" and prompts.ndim == 1 or prompts.dtype.kind in "iu" and prompts.ndim == 2:
            prompts = prompts.tolist()
        elif prompts.dtype.kind in "iu" and prompts.ndim == 1:
            raise InputError("a 1-d array of token ids is one prompt; pass one prompt as [prompt] (or a 2-d array of "
                             "[prompts, tokens])")
        else:
            raise InputError(f"a numpy array of prompts is [prompts] of texts or [prompts, tokens] of ids, not "
                             f"{prompts.ndim}-d {prompts.dtype}")
    try:
        prompts = list(prompts)  # read once: a generator's items would be used up by the checks below
    except TypeError:
        raise InputError(f"prompts must be a list (of texts or of token-id lists), not {type(prompts).__name__}"
                         ) from None
    if not prompts:
        raise InputError("no prompts given")
    if all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise InputError("text prompts need a tokenizer: pass tokenizer=load_tokenizer(checkpoint_dir)")
        ids = [tokenizer.encode_prompt(p) for p in prompts]
    else:
        ids = [_token_ids(i, p) for i, p in enumerate(prompts)]
    for i, p in enumerate(ids):
        if not p:
            raise InputError(f"prompt {i} is empty; every prompt needs at least one token")
        if min(p) < 0 or max(p) >= vocab_size:
            raise InputError(f"prompt {i} holds token ids outside the model's vocabulary [0, {vocab_size}); "
                             "encode it with the model's own tokenizer")
    return ids


def _token_ids(index: int, prompt) -> list[int]:
    try:
        if isinstance(prompt, (str, bytes, bytearray)):  # bytes would read as ids of their byte values
            raise TypeError
        prompt = list(prompt)
        if any(isinstance(t, bool) for t in prompt):
            raise TypeError
        return [operator.index(t) for t in prompt]
    except TypeError:
        raise InputError(f"prompt {index} is neither text nor a list of token ids; give every prompt the same "
                         "kind") from None


def mask_token_id(cfg, tokenizer: Tokenizer | None) -> int:
    """The mask id diffusion decoding writes into the canvas: config.json's, else the tokenizer's; it
    must be a token of the model's vocabulary (the decoders wait for the model to replace it)."""
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else (tokenizer.mask_id if tokenizer else None)
    if mask_id is None:
        raise InputError(
            "no mask token: diffusion decoding needs one; set mask_token_id in config.json or add a mask "
            "token (e.g. '<|mask|>') to the tokenizer"
        )
    if not 0 <= mask_id < cfg.vocab_size:
        raise InputError(f"mask token id {mask_id} is not in the model's vocabulary [0, {cfg.vocab_size}); set "
                         "the checkpoint's own mask id (mask_token_id in its config.json)")
    return int(mask_id)


def _special_ids(model: Transformer, tokenizer: Tokenizer | None, *, need_mask: bool):
    cfg = model.config
    mask_id = mask_token_id(cfg, tokenizer) if need_mask else None
    eos = decode_stop_ids(cfg, tokenizer)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (tokenizer.pad_id if tokenizer else None)
    pad = pad if pad is not None else (eos[0] if eos else 0)
    return mask_id, eos, int(pad)


def _block_size(decoder: DiffusionDecoder, model: Transformer) -> int:
    """The block `decoder` decodes in on `model`; refuses per-forward step counts it cannot hold."""
    cfg = model.config
    if cfg.attention == "block_causal":
        if decoder.block not in (None, cfg.block_size):
            raise DecoderSpecError(
                f"block={decoder.block}: a block-causal model decodes in its own block size {cfg.block_size}"
            )
        block = cfg.block_size
    else:
        block = decoder.block or DEFAULT_BIDIRECTIONAL_BLOCK
    # options that commit one more token per step of a forward: past the block they only cost time
    for option, beyond in (("depth", 0), ("drafts", 0), ("mrp_steps", 1)):  # psd/tspd/ce, mrp-spec, mrp-direct
        value = getattr(decoder, option, 0)
        if value + beyond > block:
            raise DecoderSpecError(f"{decoder.name}: {option}={value} cannot fit a block of {block} tokens (each step "
                                   f"commits at least one more); choose {option} <= {block - beyond}")
    return block


def _cache_mode(decoder: DiffusionDecoder, model: Transformer) -> str:
    cfg = model.config
    if decoder.name == "fast-dllm-v2" and not (cfg.attention == "block_causal" and cfg.shift_logits):
        raise DecoderSpecError(
            f"fast-dllm-v2 is Fast-dLLM v2's own procedure, for its block-causal, shifted-logit models; this "
            f"{cfg.family} model would take each block's first token from its own masked logits, alone, one forward "
            "more per block: use threshold:tau=0.9 (or another decoder of the README's table) here")
    if cfg.attention == "block_causal":
        if decoder.cache != "none":
            raise DecoderSpecError(
                f"cache={decoder.cache}: block-causal models always use the exact KV cache; drop the option"
            )
        if cfg.shift_logits and decoder.name != "fast-dllm-v2":
            # engine.BlockForwards.shifted_blocks: only the forward that starts a block scores its position 0
            raise DecoderSpecError(
                f"decoder {decoder.name!r} does not fit a block-causal shifted-logit model ({cfg.family}): it must "
                "take each block's first token in the block's first step, as Fast-dLLM v2 does; use --decoder "
                "fast-dllm-v2 (block 32, sub-blocks of 8, tau 0.9; options tau, sub_block)")
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


def check_length(model: Transformer, prompt_len: int, max_new_tokens: int):
    limit = model.config.max_position_embeddings
    if prompt_len >= limit:
        raise InputError(
            f"a prompt of {prompt_len} tokens leaves no room in the model's maximum length {limit}: no "
            "max_new_tokens fits; shorten the prompt (in eval: a task with shorter prompts, or a model with a "
            "longer context)"
        )
    if prompt_len + max_new_tokens > limit:
        raise InputError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's maximum "
            f"length {limit}; lower max_new_tokens to at most {limit - prompt_len} or shorten the prompt"
        )


@dataclass
class _Request:
    """A validated request: prompts as ids, the decoder, the special ids and, for diffusion
    decoders, the layout of every prompt and the engine's static arguments."""

    model: Transformer
    tokenizer: Tokenizer | None
    decoder: DiffusionDecoder | AR
    ids: list[list[int]]
    eos: tuple[int, ...]
    pad: int
    mask_id: int | None
    max_new_tokens: int
    head_split: tuple
    row_ids: np.ndarray  # [N] int32, each row's sampling-stream id
    fill: int = 0  # the last `fill` rows are copies of the last prompt that fill the batch to whole data shards
    layout: tuple | None = None  # (Geometry, canvas [N, T], Rows) of every prompt (diffusion decoders)

    @property
    def causal(self) -> bool:
        return self.model.config.attention == "causal"

    def engine_args(self) -> dict:
        geometry = self.layout[0]
        return dict(decoder=self.decoder, geometry=geometry, cache_mode=_cache_mode(self.decoder, self.model),
                    mask_id=int(self.mask_id), pad_id=self.pad, eos_ids=self.eos, head_graphdef=self.head_split[0])

    def row(self, tokens, count: int, nfe: int, committed: int, accepted_length: float | None = None) -> RowResult:
        """A row's result. The `drafter` decoder gives its own accepted length (rounds counted
        without the prefill; None for a row that verified no draft: its only token came from the
        prefill); another speculative decoder's is its TPF (tokens per forward, the prefill and
        the forwards that move the row to its next block included, though those verify nothing)."""
        row_tokens = np.asarray(tokens)[:count].tolist()
        text = self.tokenizer.decode(row_tokens) if self.tokenizer is not None else None
        tpf = float(committed) / max(int(nfe), 1)
        if self.decoder.name != "drafter" and verifies_drafts(self.decoder):
            accepted_length = tpf
        return RowResult(text=text, tokens=row_tokens, nfe=int(nfe), tpf=tpf, num_tokens=len(row_tokens),
                         mean_accepted_length=accepted_length)


def _prepare(model, prompts, *, tokenizer, decoder, max_new_tokens, row_ids, head, shards: int = 1,
             drafter=None) -> _Request:
    """The request for `prompts`, with copies of the last prompt (and of its sampling stream) added
    to fill the batch to a multiple of `shards` rows."""
    max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
    decoder = _resolve_decoder(decoder)
    check_kind(type(decoder), model)  # first: a drafter or a head would not make it fit
    if decoder.name == "drafter" and drafter is None:
        raise DecoderSpecError("decoder `drafter` needs a drafter: pass drafter=resolve_drafter(...) (CLI: a model "
                               "directory with drafter/ inside, or --drafter DIR); train one with "
                               "`dlmjax train configs/drafter/toy-ar.yaml`")
    ids = _encode(prompts, tokenizer, model.config.vocab_size)
    check_length(model, max(len(p) for p in ids), max_new_tokens)
    causal = model.config.attention == "causal"
    mask_id, eos, pad = _special_ids(model, tokenizer, need_mask=not causal)
    for i, p in enumerate(ids):  # the canvas's masks are the positions to generate: a prompt holds none
        if mask_id is not None and mask_id in p:
            raise InputError(f"prompt {i} holds the mask token (id {mask_id}) at position {p.index(mask_id)}; diffusion "
                             "decoders would take it for a position to generate: remove it from the prompt")
    row_ids_b = batch_row_ids(row_ids, len(ids))  # checks one id per prompt
    fill = -len(ids) % shards
    row_ids_b = np.asarray(row_ids_b)
    ids, row_ids_b = ids + [ids[-1]] * fill, np.concatenate([row_ids_b, np.repeat(row_ids_b[-1:], fill)])
    request = _Request(model, tokenizer, decoder, ids, eos, pad, mask_id, max_new_tokens, _head_for(decoder, model, head),
                       row_ids_b, fill)
    if not causal:
        geometry, canvas, rows = engine.plan_layout(
            ids, block=_block_size(decoder, model), max_new_tokens=max_new_tokens,
            block_causal=model.config.attention == "block_causal", pad_id=pad, mask_id=mask_id,
        )
        rows = rows.replace(row_ids=np.asarray(row_ids_b))
        check_canvas_length(model, geometry, rows)
        request.layout = (geometry, canvas, rows)
    return request


def check_kind(decoder_class: type, model: Transformer) -> None:
    """Refuse a causal decoder (ar, drafter) on a diffusion model and a diffusion one on a causal
    model (a class, so a spec can be checked before it is built: `spec.parse_options`)."""
    causal = model.config.attention == "causal"
    if issubclass(decoder_class, CAUSAL_DECODERS) != causal:
        kind = "causal" if causal else model.config.attention
        fix = "use --decoder ar (or drafter)" if causal else "use a diffusion decoder (static, threshold, entropy)"
        raise DecoderSpecError(f"decoder {decoder_class.name!r} does not fit a {kind} {model.config.family} model; "
                               f"{fix}")


def check_decoder(decoder: DiffusionDecoder, model: Transformer, head: MRPHead | None = None) -> None:
    """Refuse, before any prompt, what the diffusion `decoder` cannot do on `model` (the checks a
    decode makes as it lays out its batch): its block, cache mode and MRP head."""
    _block_size(decoder, model)
    _cache_mode(decoder, model)
    _head_for(decoder, model, head)


def check_canvas_length(model: Transformer, geometry, rows):
    """A bidirectional row decodes whole blocks after its prompt: refuse a canvas whose masks would
    sit past the model's maximum length (positions it never saw, which every other position
    attends to). Block-causal rows end where their model's own blocks end, as their reference's."""
    limit = model.config.max_position_embeddings
    end = int(np.max(np.asarray(rows.positions))) + 1
    if model.config.attention != "bidirectional" or end <= limit:
        return
    prompt, new = end - int(np.max(np.asarray(rows.blocks_needed))) * geometry.block, geometry.max_new_tokens
    room = limit - prompt  # >= max_new_tokens (check_length)
    fits = max(b for b in range(1, min(room, geometry.block) + 1) if -(-new // b) * b <= room)
    raise engine.LayoutError(
        f"whole blocks of {geometry.block} after a prompt of {prompt} tokens reach position {end}, past the model's "
        f"maximum length {limit}: use a block whose whole blocks hold max_new_tokens={new} within {room} positions "
        f"(decoder option block=, e.g. block={fits})"
        + (f", or max_new_tokens={shorter}" if (shorter := room // geometry.block * geometry.block) else ""))


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
    drafter=None,
    prompt_width: int | None = None,
) -> GenerationResult:
    """Decode a batch of prompts (text with a tokenizer, or token-id lists).

    decoder: a spec string (`static`, `static:k=2`, `threshold:tau=0.9`, `ar`, ...) or config.
    row_ids: each row's sampling-stream id (default: its index); give dataset indices to make a
      sampled output independent of which batch a prompt lands in.
    mesh: split the batch over the mesh's 'data' axis (data-parallel decoding; copies of the last
      prompt fill the last device's share, and are dropped from the result). Place the model's
      params on the same mesh.
    head: the MRP head the mrp-* decoders run (`dlmjax.heads.mrp.load_head(checkpoint_dir)`).
    drafter: the DFlash drafter the `drafter` decoder runs (`dlmjax.io.dflash.resolve_drafter`).
    prompt_width: causal models (`ar`, `drafter`) left-pad the prompts to at least this many
      tokens, so that batches of different prompt lengths run one compiled program (`Stream`
      passes its longest prompt's length).

    Every prompt is one row of one batch; `Stream` runs more prompts than a batch holds.
    """
    seed = check_seed(seed)
    req = _prepare(model, prompts, tokenizer=tokenizer, decoder=decoder, max_new_tokens=max_new_tokens,
                   row_ids=row_ids, head=head, shards=1 if mesh is None else mesh.shape["data"], drafter=drafter)
    decoder = req.decoder
    accepted = None
    start = time.perf_counter()
    with on_mesh(mesh):  # traced on the mesh: every row-wise step runs split over its batch axes
        if decoder.name == "drafter":
            out = generate_with_drafter(model, drafter, req.ids, max_new_tokens=max_new_tokens, block=decoder.block,
                                        temperature=decoder.temperature, top_p=decoder.top_p, seed=seed,
                                        eos_ids=req.eos, pad_id=req.pad, row_ids=req.row_ids, mesh=mesh,
                                        width=prompt_width)
            out = to_host(out)
            counts = np.asarray(out.num_generated)
            lengths = out.accepted_lengths()
            # Every token comes from a target forward; the prefill gives the first. NFE = target forwards.
            nfe_rows, committed, forwards = np.asarray([len(a) + 1 for a in lengths]), counts, int(out.nfe)
            accepted = [sum(a) / len(a) if a else None for a in lengths]  # None: no round (runs' means skip it)
        elif req.causal:
            out = generate_ar(model, req.ids, max_new_tokens=max_new_tokens, temperature=decoder.temperature,
                              top_p=decoder.top_p, seed=seed, eos_ids=req.eos, pad_id=req.pad, row_ids=req.row_ids,
                              mesh=mesh, width=prompt_width)
            out = to_host(out)
            # Each token comes from one forward (the prefill gives the first): TPF is 1 by definition.
            counts = np.asarray(out.num_generated)
            nfe_rows, committed, forwards = counts, counts, int(out.nfe)
        else:
            _, canvas, rows = req.layout
            if mesh is not None:
                canvas, rows = shard_batch((canvas, rows), mesh)
            graphdef, params = nnx.split(model)
            out = engine.decode(graphdef, params, canvas, rows, jax.random.key(seed), req.head_split[1],
                                **req.engine_args())
            out = to_host(out)
            counts, nfe_rows, committed = map(np.asarray, (out.num_generated, out.nfe, out.committed))
            forwards = int(out.forwards)
    wall = time.perf_counter() - start

    n = len(req.ids) - req.fill  # the copies that filled the last shard are dropped
    tokens, counts, nfe_rows, committed = (np.asarray(a)[:n] for a in (out.tokens, counts, nfe_rows, committed))
    rows_out = [req.row(tokens[i], counts[i], nfe_rows[i], committed[i], None if accepted is None else accepted[i])
                for i in range(n)]
    return GenerationResult(
        rows=rows_out,
        decoder=decoder_spec(decoder),
        forwards=forwards,
        tpf=float(np.sum(committed)) / max(int(np.sum(nfe_rows)), 1),
        batch_tpf=float(np.sum(committed)) / max(forwards * n, 1),
        wall_s=wall,
        tokens_per_s=float(np.sum(counts)) / max(wall, 1e-9),
    )


# Stream(stop=...) looks at the rows after at most this many forwards of the batch: a host sync
# and a few decodes per look, against forwards of a whole batch
STOP_CHECK_FORWARDS = 8


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


class Stream:
    """Continuous batching: decode any number of prompts through `batch_size` slots; when a row
    is done, the next prompt takes its slot, so the slots stay busy: a run's step forwards come
    near mean-row-NFE x N / batch instead of the sum of every batch's longest row, plus one
    forward per refill (README: fixed batches vs continuous batching).

        stream = Stream(model, prompts, batch_size=64, tokenizer=tok, decoder="threshold:tau=0.9")
        for index, row in stream:      # as rows finish, not in prompt order
            ...
        stream.forwards, stream.batch_tpf, stream.wall_s

    Each row's tokens are the ones `generate` gives for that prompt alone (with `stop`, the first
    of them; rows never see each other; `row_ids`, default the prompt's index, keys its sampling
    stream); in fast numerics a speculative decoder's NFE for a row can move by a forward with its
    batch (invariant mode: no). New prompts are started `refill` at a time (default batch/8), by
    one forward of their own that yields their first block's logits. Causal models (`ar`,
    `drafter`) run batch after batch. `limit` decodes only the first prompts with the layout of
    all (compiles what the full run needs: a warm-up).

    `stop(index, tokens) -> bool` ends a row early, at a block boundary: every STOP_CHECK_FORWARDS
    forwards it is asked about each row's tokens in finished blocks (final: decoders write only the
    current block), and a row it says yes to is done with those tokens, its slot freed. A stop that
    says yes only once the tokens fix the caller's cut (lm-eval's stop strings:
    `lm_eval.model.cut_is_settled`) gives the cut the whole decode gives, for fewer forwards; where
    a row stops moves with the batch (it is looked at every STOP_CHECK_FORWARDS forwards of the
    batch). Causal models decode to EOS or max_new_tokens.
    """

    def __init__(self, model: Transformer, prompts, *, batch_size: int = 64, refill: int | None = None,
                 tokenizer: Tokenizer | None = None, decoder="static", max_new_tokens: int = 64, seed: int = 0,
                 row_ids=None, mesh=None, head: MRPHead | None = None, drafter=None, limit: int | None = None,
                 stop=None):
        batch_size = positive_int("batch_size", batch_size)
        refill, limit = (None if value is None else positive_int(name, value)
                         for name, value in (("refill", refill), ("limit", limit)))
        seed = check_seed(seed)
        self.request = _prepare(model, prompts, tokenizer=tokenizer, decoder=decoder, max_new_tokens=max_new_tokens,
                                row_ids=row_ids, head=head, drafter=drafter)
        self.decoder = decoder_spec(self.request.decoder)
        self.count = len(self.request.ids) if limit is None else min(limit, len(self.request.ids))
        data = mesh.shape["data"] if mesh is not None else 1
        self.batch = _round_up(min(batch_size, self.count), data)
        self.refill = min(self.batch, _round_up(refill or max(1, self.batch // 8), data))
        self.seed, self.mesh, self.drafter, self.stop = seed, mesh, drafter, stop
        self.row_ids = list(range(len(self.request.ids))) if row_ids is None else list(row_ids)
        self.forwards = 0  # model forwards run
        self.start_forwards = 0  # of which forwards that started new rows (prefills yielding block 0)
        self.slot_forwards = 0  # rows carried by those forwards, summed (batch x forwards for full batches)
        self.committed = 0  # tokens committed for the prompts
        self.generated = 0  # tokens generated up to EOS
        self.wall_s = 0.0  # time spent decoding (not in the caller's loop body)

    @property
    def batch_tpf(self) -> float:
        """Committed tokens per row slot of every forward run."""
        return self.committed / max(self.slot_forwards, 1)

    def __iter__(self):
        self.forwards = self.start_forwards = self.slot_forwards = self.committed = self.generated = 0
        self.wall_s = 0.0
        clock = time.perf_counter()
        for index, row, forwards, slots, starts in (self._batches() if self.request.causal else self._continuous()):
            self.forwards += forwards
            self.start_forwards += starts
            self.slot_forwards += slots
            if row is not None:
                self.committed += round(row.tpf * row.nfe)
                self.generated += row.num_tokens
                self.wall_s += time.perf_counter() - clock
                yield index, row
                clock = time.perf_counter()
        self.wall_s += time.perf_counter() - clock

    def _batches(self):
        """Causal models (`ar`, `drafter`), one batch after another, each left-padded to the longest
        prompt of all: one compiled program, which the untimed warm-up slice compiles."""
        req = self.request
        width = max(len(ids) for ids in req.ids)
        for start in range(0, self.count, self.batch):
            chunk = list(range(start, min(start + self.batch, self.count)))
            padded = chunk + [chunk[-1]] * (self.batch - len(chunk))
            result = generate(req.model, [req.ids[i] for i in padded], tokenizer=req.tokenizer, decoder=req.decoder,
                              max_new_tokens=req.max_new_tokens, seed=self.seed,
                              row_ids=[self.row_ids[i] for i in padded], mesh=self.mesh, drafter=self.drafter,
                              prompt_width=width)
            yield None, None, result.forwards, result.forwards * self.batch, 1
            for i, row in zip(chunk, result.rows):
                yield i, row, 0, 0, 0

    def _place(self, tree):
        return tree if self.mesh is None else shard_batch(tree, self.mesh)

    def _stopped(self, out, done, block, slot_prompt, seen) -> dict[int, int]:
        """{slot: tokens in its finished blocks} for the running rows `self.stop` ends now; `seen`
        [B]: the finished tokens each slot's row was last asked about (updated)."""
        geometry, _, rows_all = self.request.layout
        stopped = {}
        for slot, prompt in enumerate(slot_prompt):
            if prompt is None or done[slot]:
                continue
            end = geometry.prefix + int(block[slot]) * geometry.block - int(rows_all.out_start[prompt])
            final = min(max(end, 0), int(out.num_generated[slot]), geometry.max_new_tokens)
            if final > seen[slot]:
                seen[slot] = final
                if self.stop(prompt, out.tokens[slot][:final].tolist()):
                    stopped[slot] = final
        return stopped

    def _continuous(self):
        req, b, r = self.request, self.batch, self.refill
        _, canvas_all, rows_all = req.layout
        graphdef, params = nnx.split(req.model)
        args = req.engine_args()
        start_args = {k: args[k] for k in ("decoder", "geometry", "cache_mode", "mask_id", "head_graphdef")}
        key = jax.random.key(self.seed)

        def admit(state, rows, prompts, slots, size):
            picked = prompts + [prompts[0]] * (size - len(prompts))
            canvas_r, rows_r = self._place((canvas_all[picked], jax.tree.map(lambda x: x[picked], rows_all)))
            slots_r = np.asarray(slots + [b] * (size - len(slots)), np.int32)
            with on_mesh(self.mesh):
                return engine.admit(graphdef, params, state, rows, canvas_r, rows_r, slots_r, req.head_split[1],
                                    **start_args)

        queue = list(range(self.count))
        first, queue = queue[:b], queue[b:]
        state, rows = admit(None, None, first, list(range(b)), b)
        slot_prompt = first + [None] * (b - len(first))
        if len(first) < b:  # more slots than prompts: the extra rows are done from the start
            state = state.replace(done=state.done | (np.arange(b) >= len(first)))
        yield None, None, 1, b, 1
        seen = [0] * b
        while any(p is not None for p in slot_prompt):
            before = int(state.forwards)
            stop_at = min(r, len(queue)) if queue else b
            limit = before + STOP_CHECK_FORWARDS if self.stop else np.iinfo(np.int32).max
            with on_mesh(self.mesh):
                state, out = engine.decode_until(graphdef, params, state, rows, key, stop_at, limit,
                                                 req.head_split[1], **args)
            out, done, block = to_host((out, state.done, state.block))
            yield None, None, int(out.forwards) - before, (int(out.forwards) - before) * b, 0
            stopped = self._stopped(out, done, block, slot_prompt, seen) if self.stop else {}
            if stopped:
                done = done | np.isin(np.arange(b), list(stopped))
                with on_mesh(self.mesh):
                    state = state.replace(done=state.done | done)
            for slot in np.flatnonzero(done):
                if slot_prompt[slot] is not None:
                    yield slot_prompt[slot], req.row(out.tokens[slot], stopped.get(slot, out.num_generated[slot]),
                                                     out.nfe[slot], out.committed[slot]), 0, 0, 0
                    slot_prompt[slot] = None
                    seen[slot] = 0
            free = [s for s in range(b) if slot_prompt[s] is None]
            while queue and free:  # `refill` rows per forward: one compiled shape
                take = min(r, len(queue), len(free))
                prompts, queue = queue[:take], queue[take:]
                slots, free = free[:take], free[take:]
                state, rows = admit(state, rows, prompts, slots, r)
                for s, i in zip(slots, prompts):
                    slot_prompt[s] = i
                yield None, None, 1, r, 1
