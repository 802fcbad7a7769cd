"""Decode and prefill on one accelerator, kernels on and off (issue 13), SDAR shapes with random weights,
and the MoE shapes of issue 21 (LLaDA-MoE-7B-A1B, LLaDA2.0-mini, or any checkpoint's config.json).

Sections (each a markdown table; all go to benchmarks/results/decode_gpu/<device>-<shape>.{json,md}):
1. bandwidth: a device copy (read + write) of --copy-mib MiB, the roofline's bytes/s;
2. step: one decode-step forward (a block of --block tokens against --prompt-len cached tokens, as
   benchmarks/exactness.py times it) at each batch, median ms per kernel mode, against the HBM
   roofline = (weights + KV cache read) / measured bandwidth, where an MoE layer reads only the experts
   that random routing of the step's tokens hits (`experts_read`; LLaDA-MoE's block is 32: --block 32);
3. prefill: one forward writing the KV cache of L tokens (batch 1), TFLOP/s and % of --peak-tflops
   (default: the device's bf16 dense peak when known) per kernel mode; OOM is recorded as such,
   with the bytes the device reports as its peak use;
4. argmax: residual_argmax's kernel (mode "on", whatever "auto" picks) vs the XLA path (full logits,
   then scoring) at M positions;
5. tiles: the GPU kernels' tile, warp and pipelining-stage choices (--attention-tiles,
   --argmax-tiles), each kernel alone: flash attention over a block-causal prefill of each --prefill
   length (batch 1, the shape's heads; TFLOP/s of the visible half) and residual_argmax at each
   --argmax-positions, against the XLA path; a choice the device refuses to compile is recorded so.
   The dispatchers' defaults (TILE_*, WARPS, STAGES) are what these tables chose. On CPU the
   kernels run in interpret mode (proves the section runs; the times mean nothing);
6. decoders: tokens/s of each decoder at each batch (benchmarks/decode_throughput.run_batches),
   and the wall time of its first call (compile included: on the H200 a 1.7B decoder's compile
   was too long to print a row in 120 s);
7. transformers: the eager forward of the same shape (Qwen3ForCausalLM, random weights) for the
   same block against the same cache, per-step ms, on the same device (torch CUDA when present);
   SDAR shapes only (the MoE diffusion families have no transformers class).

    PYTHONPATH=. python benchmarks/decode_gpu.py --shape sdar-1.7b          # on a GPU or TPU
    PYTHONPATH=. python benchmarks/decode_gpu.py --shape sdar-8b --prefill 512 2048 8192 32768
    PYTHONPATH=. python benchmarks/decode_gpu.py --shape llada-moe-7b-a1b --block 32 --skip tiles argmax
    PYTHONPATH=. python benchmarks/decode_gpu.py --tiny                     # CPU, seconds: proves the script runs
    PYTHONPATH=. python benchmarks/decode_gpu.py --tiny --shape tiny-moe    # the same through an MoE

Set XLA_PYTHON_CLIENT_PREALLOCATE=false when the transformers section shares the GPU. On CPU the
kernel modes both run the references (dlmjax.kernels), so "auto" and "off" time the same code.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, as `python benchmarks/X.py`

import dlmjax
from benchmarks.common import median_ms, random_prompt, torch_cache_name, write_results, written_when_done_or_stopped
from benchmarks.decode_throughput import SHAPES, random_sdar, run_batches
from benchmarks.exactness import _prefill, step_inputs, step_ms
from dlmjax import kernels
from dlmjax.config import from_hf_config
from dlmjax.decoding.api import generate
from dlmjax.heads.mrp import init_head
from dlmjax.kernels.attention import attention
from dlmjax.kernels.residual_argmax import residual_argmax
from dlmjax.models.layers import Visibility
from dlmjax.models.moe import EXPERT_IMPLEMENTATIONS, MoE, set_expert_implementation

# dense, by the first key that is a substring of device_kind (a v5e reports "TPU v5 lite" or "TPU v5e", a v5p
# "TPU v5" or "TPU v5p": the lite and e names come first)
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0,
                    "TPU v6 lite": 918.0, "TPU v6e": 918.0, "TPU v5": 459.0, "TPU v4": 275.0}
# Triton tile choices to time (GPU): the dispatchers' defaults first, then the shapes Hopper flash kernels use
ATTENTION_TILES = ["tile_q=64,tile_k=64,warps=4,stages=3", "tile_q=64,tile_k=128,warps=4,stages=2",
                   "tile_q=128,tile_k=64,warps=8,stages=3", "tile_q=128,tile_k=128,warps=8,stages=2",
                   "tile_q=128,tile_k=64,warps=4,stages=3"]
# residual_argmax: more positions per program re-read the lm_head fewer times (16 read it 4 times at 64)
ARGMAX_TILES = ["tile_m=64,tile_v=128,tile_d=64,warps=8,stages=3", "tile_m=64,tile_v=128,tile_d=64,warps=8,stages=2",
                "tile_m=16,tile_v=128,tile_d=128,warps=4,stages=2", "tile_m=128,tile_v=64,tile_d=64,warps=8,stages=3",
                "tile_m=64,tile_v=256,tile_d=64,warps=8,stages=3"]
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1)
# Issue 21's MoE shapes: the checkpoints' published config.json fields that set the shape (random bf16 weights),
# read through dlmjax's own config translation. `--shape path/to/config.json` takes a checkpoint's own file instead.
MOE_CONFIGS = {
    # inclusionAI/LLaDA-MoE-7B-A1B-Instruct: 7.4B parameters, 1.4B active (64 experts of 1,024, top-8, every layer)
    "llada-moe-7b-a1b": {"model_type": "llada", "architectures": ["LLaDAMoEModelLM"], "vocab_size": 157184,
                         "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
                         "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
                         "expert_intermediate_size": 1024, "dense_intermediate_size": 8192, "qk_layernorm": True,
                         "rope_theta": 50000, "max_position_embeddings": 8192},
    # inclusionAI/LLaDA2.0-mini: 16B parameters, 1.4B active (256 experts of 512 in groups of 32, top-8 of the
    # top-4 groups, one shared expert; layer 0 dense), block diffusion in blocks of 32
    "llada2.0-mini": {"model_type": "llada2_moe", "vocab_size": 157184, "hidden_size": 2048,
                      "intermediate_size": 5120, "num_hidden_layers": 20, "num_attention_heads": 16,
                      "num_key_value_heads": 4, "head_dim": 128, "num_experts": 256, "num_shared_experts": 1,
                      "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                      "moe_intermediate_size": 512, "first_k_dense_replace": 1, "partial_rotary_factor": 0.5,
                      "block_size": 32, "use_bias": False, "use_qkv_bias": False, "max_position_embeddings": 32768},
    # the CPU stand-in (`--tiny --shape tiny-moe`): LLaDA2's router and layout at a few thousand parameters
    "tiny-moe": {"model_type": "llada2_moe", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                 "num_experts": 8, "num_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
                 "moe_intermediate_size": 32, "first_k_dense_replace": 1, "block_size": 4, "use_bias": False,
                 "max_position_embeddings": 4096, "mask_token_id": 1023},
}
SHAPE_CHOICES = sorted(SHAPES) + sorted(set(MOE_CONFIGS) - {"tiny-moe"})


def shape_name(shape: str) -> str:
    """A shape's name in titles and file names: a config.json's by its checkpoint folder."""
    return Path(shape).parent.name if shape.endswith(".json") else shape


def build_model(shape: str):
    """(model, MRP head, name): random weights of an SDAR shape (bf16), an MoE shape (`MOE_CONFIGS` or a
    config.json path; bf16), or the tiny CPU shapes (fp32)."""
    if shape in SHAPES:
        model, head = random_sdar(shape)
        return model, head, f"random {shape} (bf16)"
    if shape == "tiny":
        cfg = dlmjax.ModelConfig(family="sdar", head_dim=32, attention="block_causal", block_size=4, qk_norm=True,
                                 mask_token_id=TINY["vocab_size"] - 1, eos_token_ids=(), pad_token_id=0,
                                 max_position_embeddings=4096, **TINY)
    else:
        raw = MOE_CONFIGS.get(shape) or json.loads(Path(shape).read_text())
        cfg = from_hf_config(raw)
        cfg = replace(cfg, dtype="float32" if shape == "tiny-moe" else "bfloat16", pad_token_id=cfg.pad_token_id or 0)
    name = f"random {shape_name(shape)} ({cfg.dtype})"
    head_layers = 1 if shape in ("tiny", "tiny-moe") else 3
    return dlmjax.init_model(cfg, seed=0), init_head(cfg, num_layers=head_layers, init_std=0.02, seed=0), name


def bandwidth(mib: int, repeats: int) -> float:
    """Bytes/s of a device copy (x + 1 reads and writes every byte)."""
    x = jnp.ones((mib * 2**20 // 2,), jnp.bfloat16)
    add = jax.jit(lambda a: a + 1)
    return 2 * x.nbytes / (median_ms(lambda: add(x), repeats) / 1e3)


def experts_read(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts an MoE layer reads for `tokens` tokens when each picks `top_k` of `num_experts` at random
    (the expected number hit at least once)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def weight_bytes(model, tokens: int | None = None) -> int:
    """Bytes one forward of `tokens` tokens reads of the weights: all but the embedding table (of which
    it reads B x L rows) unless the head is tied to it; of an MoE layer's experts, the share that
    random routing hits (`experts_read`; all of them when `tokens` is None)."""
    _, state = nnx.split(model)
    total = sum(x.nbytes for x in jax.tree.leaves(state))
    total -= 0 if model.lm_head is None else model.embed[...].nbytes
    cfg = model.config
    if tokens is not None and cfg.num_experts:
        unread = 1 - experts_read(cfg.num_experts, cfg.num_experts_per_tok, tokens) / cfg.num_experts
        total -= sum(unread * (m.experts_gate_up[...].nbytes + m.experts_down[...].nbytes)
                     for _, m in nnx.iter_graph(model) if isinstance(m, MoE))
    return int(total)


def kv_bytes(cfg, batch: int, length: int) -> int:
    return 2 * cfg.num_layers * batch * length * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def mlp_widths(cfg) -> list[int]:
    """Per layer, the MLP width one token runs through: the dense MLP's, or the top-k experts' and the
    shared expert's of an MoE layer."""
    moe = cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size
    return [moe if i in cfg.moe_layers else cfg.intermediate_size for i in range(cfg.num_layers)]


def prefill_flops(cfg, length: int) -> float:
    """Matmul FLOPs of a prefill of `length` tokens (no lm_head): projections and MLP (an MoE layer's
    router and the experts each token runs) 2 x params x tokens, attention scores and values
    4 x tokens x visible keys x heads x head_dim (about half the square when block-causal)."""
    d, h, hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attention_params = d * (h + 2 * hkv) * hd + h * hd * d
    mlp_params = sum(3 * d * width for width in mlp_widths(cfg)) + d * cfg.num_experts * len(cfg.moe_layers)
    return (2 * length * (cfg.num_layers * attention_params + mlp_params)
            + cfg.num_layers * 4 * visible_pairs(cfg, length) * h * hd)


def prefill_memory_gib(cfg, length: int) -> dict:
    """The device memory a batch-1 prefill of `length` tokens needs, computed (GiB): the weights,
    the KV cache, the largest layer's activations with flash attention (hidden and residual,
    q/k/v, the MLP's gate, up and product, the kernel's f32 accumulator), and for comparison the
    f32 scores and exponentials the XLA einsum materialises per layer."""
    from dlmjax.models import abstract_model

    item = jnp.dtype(cfg.dtype).itemsize
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.split(abstract_model(cfg))[1]))
    d, f, h, hkv, hd = cfg.hidden_size, max(mlp_widths(cfg)), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    activations = length * (2 * d + 3 * f + (h + 2 * hkv) * hd) * item + length * h * hd * 4
    gib = {"weights": weights, "kv_cache": kv_bytes(cfg, 1, length), "activations_flash": activations}
    gib = {k: v / 2**30 for k, v in gib.items()}
    gib["total_flash"] = sum(gib.values())
    gib["einsum_scores"] = 2 * h * length * length * 4 / 2**30
    return gib


def peak_tflops(device, given: float | None) -> float | None:
    return given or next((v for k, v in PEAK_BF16_TFLOPS.items() if k.lower() in device.device_kind.lower()), None)


def path_of(kernel: str, refused_before: int) -> str:
    """What ran for `kernel` in the current mode, asked after the call: kernel / interpret /
    reference, or "reference (refused)" where the call added a refusal (the dispatcher chose the
    kernel but the device would not compile it; the reason is logged). `refused_before`: the
    kernel's refusal count before the call (an earlier call's refusal says nothing of this one)."""
    if len(kernels.refusals(kernel)) > refused_before:
        return "reference (refused)"
    return kernels.choose(kernel) or "reference"


def variants(model, args, modes):
    """(kernel mode, expert implementation, label) of each timed row: an MoE model's rows once per
    --moe-experts (`experts_path`), other models' once."""
    if not any(isinstance(m, MoE) for _, m in nnx.iter_graph(model)):
        return [(mode, None, mode) for mode in modes]
    return [(mode, experts, f"{mode}, experts {experts}") for mode in modes for experts in args.moe_experts]


@contextlib.contextmanager
def experts_path(model, experts: str | None):
    """An MoE model's layers on the `experts` implementation (a split inside compiles that path),
    back to "auto" after; nothing for None."""
    if experts is None:
        yield
        return
    set_expert_implementation(model, experts)
    try:
        yield
    finally:
        set_expert_implementation(model, "auto")


def section_step(model, args, bw, modes, lines, records):
    cfg = model.config
    experts = "" if not cfg.num_experts else ("; of each MoE layer's experts, those that random routing of the "
                                              "step's tokens hits")
    start = len(lines)  # this section's first line (lines holds the sections before it)
    lines += [f"Decode step: {args.block} tokens against {args.prompt_len} cached, median of {args.repeats} "
             f"(roofline = (weights + KV read) / {bw / 1e9:.0f} GB/s{experts}):", "",
             "| batch | kernels | attention path | ms | roofline ms | % of roofline |", "|---:|---|---|---:|---:|---:|"]
    print("\n".join(lines[start:]), flush=True)
    for batch in args.batches:
        roof = 1e3 * (weight_bytes(model, tokens=batch * args.block) + kv_bytes(cfg, batch, args.prompt_len)) / bw
        block_bk, cache = step_inputs(model, batch, args.prompt_len, args.block)
        for mode, experts, label in variants(model, args, modes):
            with experts_path(model, experts), kernels.use(mode):
                name = f"step-batch{batch}-{mode}" + (f"-{experts}" if experts else "")
                trace = None if args.profile is None else str(Path(args.profile) / name)
                before = len(kernels.refusals("attention"))
                ms = step_ms(model, block_bk, cache, args.repeats, trace_dir=trace)
                path = path_of("attention", before)
            records.append(dict(batch=batch, kernels=mode, experts=experts, path=path, ms=ms, roofline_ms=roof))
            lines.append(f"| {batch} | {label} | {path} | {ms:.3f} | {roof:.3f} | {100 * roof / ms:.0f}% |")
            print(lines[-1], flush=True)


def section_prefill(model, args, peak, modes, lines, records):
    cfg = model.config
    start = len(lines)  # this section's first line (lines holds the sections before it)
    lines += [f"Prefill (batch 1, one forward writing the KV cache), peak {peak or '?'} TFLOP/s; memory budget "
             "(computed, GiB): weights + KV cache + largest layer's activations with flash attention, and the XLA "
             "einsum's per-layer scores for comparison:", "",
             "| tokens | budget GiB (flash) | einsum scores GiB |", "|---:|---:|---:|"]
    budgets = []
    for length in args.prefill:
        budget = prefill_memory_gib(cfg, length)
        budgets.append(dict(tokens=length, **budget))
        lines.append(f"| {length} | {budget['total_flash']:.3g} | {budget['einsum_scores']:.3g} |")
    lines += ["", "| tokens | kernels | attention path | ms | TFLOP/s | % of peak | device peak GiB |",
              "|---:|---|---|---:|---:|---:|---:|"]
    print("\n".join(lines[start:]), flush=True)
    records += [dict(budget=b) for b in budgets]
    for length in args.prefill:
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size - 2, (1, length)), jnp.int32)
        for mode, experts, label in variants(model, args, modes):
            with experts_path(model, experts), kernels.use(mode):
                graphdef, state = nnx.split(model)
                before = len(kernels.refusals("attention"))
                try:
                    ms = median_ms(lambda: _prefill(graphdef, state, tokens, jnp.zeros(length)),
                                   max(1, args.repeats // 4))
                except Exception as error:  # RESOURCE_EXHAUSTED: out of device memory
                    ms, status = None, f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
                else:
                    status = "ok"
                path = path_of("attention", before)
            peak_gib = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30
            tflops = None if ms is None else prefill_flops(cfg, length) / (ms / 1e3) / 1e12
            records.append(dict(tokens=length, kernels=mode, experts=experts, path=path, ms=ms, tflops=tflops,
                                status=status, device_peak_gib=peak_gib))
            if ms is None:
                lines.append(f"| {length} | {label} | {path} | {status} | | | {peak_gib:.1f} |")
            else:
                share = f"{100 * tflops / peak:.0f}%" if peak else "?"
                lines.append(f"| {length} | {label} | {path} | {ms:.1f} | {tflops:.3g} | {share} | {peak_gib:.1f} |")
            print(lines[-1], flush=True)


def section_argmax(model, args, modes, lines, records):
    cfg = model.config
    w = model.lm_head_weight()
    start = len(lines)  # this section's first line (lines holds the sections before it)
    lines += [f"Greedy scores of M positions from hidden states (V = {cfg.vocab_size}): residual_argmax vs "
             "full logits + scoring:", "", "| positions | kernels | path | ms |", "|---:|---|---|---:|"]
    print("\n".join(lines[start:]), flush=True)
    for m in args.argmax_positions:
        x = jax.random.normal(jax.random.key(0), (m, cfg.hidden_size)).astype(cfg.dtype)
        for mode in modes:
            with kernels.use(mode):
                fn = jax.jit(lambda h: residual_argmax(h, w, mask_id=cfg.mask_token_id))
                before = len(kernels.refusals("residual_argmax"))
                ms = median_ms(lambda: fn(x), args.repeats)
                path = path_of("residual_argmax", before)
            records.append(dict(positions=m, kernels=mode, path=path, ms=ms))
            lines.append(f"| {m} | {mode} | {path} | {ms:.3f} |")
            print(lines[-1], flush=True)


ATTENTION_OPTIONS = ("tile_q", "tile_k", "split_k", "warps", "stages")  # kernels.attention.attention's
ARGMAX_OPTIONS = ("tile_m", "tile_v", "tile_d", "split_v", "warps", "stages")  # residual_argmax's


def parse_tiles(text: str, allowed: tuple[str, ...]) -> dict:
    """"tile_q=128,tile_k=64,warps=8" -> {"tile_q": 128, "tile_k": 64, "warps": 8}, names from `allowed`."""
    try:
        options = {key.strip(): int(value) for key, value in (item.split("=") for item in text.split(","))}
    except ValueError:
        options = None
    if options is None or not set(options) <= set(allowed):
        raise argparse.ArgumentTypeError(f"{text!r}: give name=int pairs from {', '.join(allowed)}, "
                                         f"e.g. {allowed[0]}=64,warps=8")
    return options


def tiles_arg(allowed: tuple[str, ...]):
    """An argparse type: the text itself, once `parse_tiles` accepts it."""
    return lambda text: parse_tiles(text, allowed) and text


def tile_rows(baseline: str, choices: list[str], allowed: tuple[str, ...], kernel_mode: str) -> list[tuple]:
    """(label, kernel mode, options) of each row of a tiles table: the XLA path, then each choice."""
    return [(baseline, "off", {})] + [(text, kernel_mode, parse_tiles(text, allowed)) for text in choices]


def visible_pairs(cfg, length: int) -> float:
    """(query, key) pairs a prefill of `length` tokens attends: all of them when bidirectional,
    about half when block-causal or causal."""
    return length * length if cfg.attention == "bidirectional" else length * (length + (cfg.block_size or 1)) / 2


def prefill_parts(cfg, length: int):
    """q [1, L, H, hd] and the one self part of a prefill of `length` tokens in the shape's own
    attention (bf16 random values at its heads), and the attention FLOPs of what it sees."""
    k = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k[0], (1, length, cfg.num_heads, cfg.head_dim)).astype(cfg.dtype)
    keys, values = (jax.random.normal(x, (1, length, cfg.num_kv_heads, cfg.head_dim)).astype(cfg.dtype) for x in k[1:])
    pos = jnp.arange(length, dtype=jnp.int32)[None]
    vis = Visibility(pos, jnp.zeros_like(pos), pos, jnp.zeros_like(pos), jnp.ones((1, length), bool),
                     attention=cfg.attention, block_size=cfg.block_size)
    return q, [(keys, values, vis)], 4 * visible_pairs(cfg, length) * cfg.num_heads * cfg.head_dim


def _timed_choice(kernel: str, mode: str, fn, repeats: int) -> tuple[float | None, str]:
    """(median ms, path) of a kernel call under `mode`; a choice the device refuses is not timed."""
    refused = len(kernels.refusals(kernel))
    with kernels.use(mode):
        jax.block_until_ready(fn())  # traced (and compile-probed) under the mode
        if len(kernels.refusals(kernel)) > refused:  # this call's refusal, not an earlier one's
            return None, "reference (refused)"
        return median_ms(fn, repeats), path_of(kernel, refused)


def section_tiles(model, args, peak, lines, records):
    cfg = model.config
    kernel_mode = "on" if jax.default_backend() in kernels.ACCELERATORS else "interpret"
    start = len(lines)  # this section's first line (lines holds the sections before it)
    lines += [f"Kernel tiles ({kernel_mode}), each kernel alone. Flash attention over a block-causal prefill (batch 1, "
             f"{cfg.num_heads} heads over {cfg.num_kv_heads}, head dim {cfg.head_dim}; TFLOP/s of the visible half, "
             f"peak {peak or '?'}):", "", "| tokens | tiles | path | ms | TFLOP/s | % of peak |",
             "|---:|---|---|---:|---:|---:|"]
    print("\n".join(lines[start:]), flush=True)
    for length in args.prefill:
        q, parts, flops = prefill_parts(cfg, length)
        for tiles, mode, options in tile_rows("XLA einsum", args.attention_tiles, ATTENTION_OPTIONS, kernel_mode):
            fn = jax.jit(functools.partial(attention, **options))
            try:
                ms, path = _timed_choice("attention", mode, lambda: fn(q, parts), args.repeats)
            except Exception as error:  # RESOURCE_EXHAUSTED: the einsum's scores at long prefills
                ms, path = None, f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
            tflops = None if ms is None else flops / (ms / 1e3) / 1e12
            records.append(dict(kernel="attention", tokens=length, tiles=tiles, path=path, ms=ms, tflops=tflops))
            share = f"{100 * tflops / peak:.0f}%" if tflops and peak else ""
            lines.append(f"| {length} | {tiles} | {path} | " +
                         ("| | |" if ms is None else f"{ms:.3f} | {tflops:.3g} | {share} |"))
            print(lines[-1], flush=True)
    w = model.lm_head_weight()
    lines += ["", f"residual_argmax (V = {cfg.vocab_size}, hidden {cfg.hidden_size}):", "",
              "| positions | tiles | path | ms |", "|---:|---|---|---:|"]
    print("\n".join(lines[-5:]), flush=True)
    for m in args.argmax_positions:
        x = jax.random.normal(jax.random.key(0), (m, cfg.hidden_size)).astype(cfg.dtype)
        for tiles, mode, options in tile_rows("XLA logits + scoring", args.argmax_tiles, ARGMAX_OPTIONS, kernel_mode):
            fn = jax.jit(functools.partial(residual_argmax, w_dv=w, mask_id=cfg.mask_token_id, **options))
            ms, path = _timed_choice("residual_argmax", mode, lambda: fn(x), args.repeats)
            records.append(dict(kernel="residual_argmax", positions=m, tiles=tiles, path=path, ms=ms))
            lines.append(f"| {m} | {tiles} | {path} | {'' if ms is None else f'{ms:.3f}'} |")
            print(lines[-1], flush=True)


def section_decoders(model, head, args, lines, records):
    rng = np.random.RandomState(0)
    prompts = [random_prompt(rng, model.config, args.prompt_len) for _ in range(args.prompts)]
    start = len(lines)  # this section's first line (lines holds the sections before it)
    lines += [f"Decoders ({len(prompts)} prompts of {args.prompt_len} tokens, {args.max_new} new tokens, fixed batches, "
             f"kernels {args.decoder_kernels}):", "",
             "| decoder | batch | first call s (compile) | forwards | tokens/s | wall s |",
             "|---|---:|---:|---:|---:|---:|"]
    print("\n".join(lines[start:]), flush=True)
    with kernels.use(args.decoder_kernels):
        for spec in args.decoders:
            for batch in args.batches:
                options = dict(decoder=spec, max_new_tokens=args.max_new, head=head)
                start = time.perf_counter()
                generate(model, prompts[:batch], **options)  # compiles this decoder at this batch
                first = time.perf_counter() - start
                rows, forwards, _, wall = run_batches(model, prompts, batch, **options)
                rate = sum(row.num_tokens for row in rows) / wall
                records.append(dict(decoder=spec, batch=batch, first_call_s=first, forwards=forwards,
                                    tokens_per_s=rate, wall_s=wall))
                lines.append(f"| `{spec}` | {batch} | {first:.1f} | {forwards} | {rate:.0f} | {wall:.2f} |")
                print(lines[-1], flush=True)


def section_transformers(model, args, lines, records):
    """transformers' eager Qwen3 forward of the same shape: `block` tokens against `prompt_len` cached."""
    import torch
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    cfg = model.config
    if cfg.family != "sdar":  # transformers has no class for the MoE diffusion families (remote code only)
        line = f"transformers' eager forward skipped: {cfg.family} has no transformers class (Qwen3 layout only)"
        print(line, flush=True)
        lines.append(line)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and jax.default_backend() != "cpu":  # a TPU host: torch has no kernel on jax's device
        line = f"transformers' eager forward skipped: torch has no {jax.default_backend()} device here"
        print(line, flush=True)
        lines.append(line)
        return
    start = len(lines)  # this section's first line (lines holds the sections before it)
    lines += [f"transformers {__import__('transformers').__version__} eager forward on {device} "
             f"({args.block} tokens against {args.prompt_len} cached):", "", "| batch | ms |", "|---:|---:|"]
    print("\n".join(lines[start:]), flush=True)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[str(jnp.dtype(cfg.dtype))]
    hf = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                     num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (on the host, 2B weights take minutes)
        net = Qwen3ForCausalLM(hf).to(dtype=dtype).eval()
    cache_name = torch_cache_name(net)
    for batch in args.batches:
        ids = torch.randint(0, cfg.vocab_size - 2, (batch, args.prompt_len + args.block), device=device)
        with torch.no_grad():
            cache = DynamicCache()
            net(ids[:, : args.prompt_len], **{cache_name: cache}, use_cache=True)

            def step():
                net(ids[:, args.prompt_len:], **{cache_name: cache}, use_cache=True)
                cache.crop(-args.block)  # back to the prompt's cache
                if device == "cuda":
                    torch.cuda.synchronize()

            step()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                step()
                times.append(1e3 * (time.perf_counter() - start))
        ms = statistics.median(times)
        records.append(dict(batch=batch, ms=ms, device=device))
        lines.append(f"| {batch} | {ms:.2f} |")
        print(lines[-1], flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="sdar-1.7b", type=shape_arg,
                   help=f"{', '.join(SHAPE_CHOICES)}, or a checkpoint's config.json (random weights of its shape); "
                        "with --tiny: tiny (default) or tiny-moe")
    p.add_argument("--tiny", action="store_true", help="a tiny fp32 shape and sizes that run on CPU in seconds")
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prefill", type=int, nargs="+", default=[512, 2048, 8192, 16384, 32768])
    p.add_argument("--argmax-positions", type=int, nargs="+", default=[64, 256])
    p.add_argument("--kernels", nargs="+", default=["auto", "off"], choices=kernels.MODES)
    p.add_argument("--attention-tiles", nargs="+", default=ATTENTION_TILES, type=tiles_arg(ATTENTION_OPTIONS),
                   help="flash-attention choices for the tiles section: tile_q=..,tile_k=..,warps=..,stages=..")
    p.add_argument("--argmax-tiles", nargs="+", default=ARGMAX_TILES, type=tiles_arg(ARGMAX_OPTIONS),
                   help="residual_argmax choices for the tiles section: tile_m=..,tile_v=..,tile_d=..,split_v=..,"
                        "warps=..,stages=..")
    p.add_argument("--decoders", nargs="+",
                   default=["static", "threshold:tau=0.9", "psd:policy=threshold,tau=0.9,depth=3", "mrp-spec:drafts=3"])
    p.add_argument("--decoder-kernels", default="auto", choices=kernels.MODES)
    p.add_argument("--moe-experts", nargs="+", default=["auto"], choices=["auto", *EXPERT_IMPLEMENTATIONS],
                   help="an MoE shape's step and prefill rows once per expert implementation (dlmjax.models.moe."
                        "resolve_implementation: auto is dense on GPU, grouped elsewhere; grouped runs through the "
                        "grouped_matmul kernel where --kernels on or interpret); decoders run auto")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--copy-mib", type=int, default=2048)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["step", "prefill", "argmax", "tiles", "decoders", "transformers"])
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="the step section also writes a jax profiler trace of one call (8 steps) per batch and kernel "
                        "mode under DIR (step-batch<B>-<mode>/plugins/profile/...; a lent machine returns files at "
                        "most 2 folders down: tar DIR into its output)")
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results/decode_gpu)")
    if p.parse_args(argv).tiny:  # tiny defaults; options given explicitly still win
        p.set_defaults(prompt_len=32, batches=[1, 2], prefill=[64], argmax_positions=[8], prompts=2, max_new=8,
                       repeats=2, copy_mib=16, decoders=["threshold:tau=0.9"],
                       attention_tiles=["tile_q=16,tile_k=16", "tile_q=32,tile_k=16"],
                       argmax_tiles=["tile_m=8,tile_v=128", "tile_m=16,tile_v=256"])
    args = p.parse_args(argv)
    if args.tiny and args.shape != "tiny-moe":
        args.shape = "tiny"
    return args


def shape_arg(value: str) -> str:
    if value in SHAPES or value in MOE_CONFIGS or (value.endswith(".json") and Path(value).is_file()):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: choose one of {', '.join(SHAPE_CHOICES)}, or give the path of "
                                     "an existing config.json")


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("dlmjax.kernels").setLevel(logging.INFO)  # each fallback's reason, once
    device = jax.devices()[0]
    command = " ".join([sys.executable.rsplit("/", 1)[-1], *(sys.argv if argv is None else ["decode_gpu.py", *argv])])
    model, head, name = build_model(args.shape)
    peak = peak_tflops(device, args.peak_tflops)
    header = [f"`{command}`", "", f"jax {jax.__version__}, {device.platform} {device.device_kind}, "
              f"{platform.processor() or platform.machine()}, model {name}", ""]
    print("\n".join(header), flush=True)
    bw = bandwidth(args.copy_mib, args.repeats)
    bandwidth_line = f"Measured copy bandwidth: {bw / 1e9:.1f} GB/s"
    print(bandwidth_line, flush=True)
    lines, results = header + [bandwidth_line, ""], dict(bandwidth_bytes_per_s=bw)
    # each section appends its lines and records as it measures them, so a stopped run writes its rows so far
    sections = dict(step=lambda *out: section_step(model, args, bw, args.kernels, *out),
                    prefill=lambda *out: section_prefill(model, args, peak, args.kernels, *out),
                    argmax=lambda *out: section_argmax(model, args, ["on", "off"], *out),  # the kernel itself vs XLA
                    tiles=lambda *out: section_tiles(model, args, peak, *out),
                    decoders=lambda *out: section_decoders(model, head, args, *out),
                    transformers=lambda *out: section_transformers(model, args, *out))

    def write(finished: bool):
        write_results(Path(args.out or Path(__file__).parent / "results" / "decode_gpu"),
                      f"{device.platform}-{shape_name(args.shape)}",
                      dict(command=command, jax=jax.__version__, model=name,
                           device=f"{device.platform} {device.device_kind}", finished=finished, **results), lines)

    stopped = ["", "Stopped before the end: the last section holds the rows measured before the stop."]
    with written_when_done_or_stopped(write, lines, stopped):
        for key, run in sections.items():
            if key in args.skip:
                continue
            results[key] = []
            run(lines, results[key])
            lines.append("")
    return results


if __name__ == "__main__":
    main()
