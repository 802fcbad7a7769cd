"""`residual_argmax`: greedy scores of positions straight from their hidden states, without the
[M, V] logits. Dispatches to a Pallas kernel (`kernel.py` on GPU and in interpret mode: a loop over
vocabulary tiles; `kernel_tpu.py` on TPU: vocabulary tiles on the grid, streamed through VMEM) or
the reference (`reference.py`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dlmjax import kernels
from dlmjax.kernels.residual_argmax import kernel as _kernel
from dlmjax.kernels.residual_argmax import kernel_tpu as _kernel_tpu
from dlmjax.kernels.residual_argmax.kernel import STAGES, WARPS
from dlmjax.kernels.residual_argmax.reference import ArgmaxScores, logits
from dlmjax.kernels.residual_argmax.reference import residual_argmax as reference

__all__ = ["ArgmaxScores", "logits", "reference", "residual_argmax", "residual_argmax_tpu"]

# GPU tiles, from benchmarks/decode_gpu.py's tiles section on an H100 (V 151,936, hidden 2,048): 64 x 128
# dots over 64 of the hidden size on 8 warps, 3 stages, in 1024-column slices ran 0.72 ms at 256 positions
# where 16 x 128 x 128 on 4 warps, 2 stages had run 1.55 ms (H200) and XLA's path 0.86 ms
TILE_M, TILE_V, TILE_D, SPLIT_V = 64, 128, 64, 1024
TPU_TILE_M, TPU_TILE_V = 256, 256  # a [D, 256] lm_head block double-buffered: 4 MiB of VMEM at D = 4096


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _unsupported(x_md, w_dv, interpret: bool) -> str | None:
    d, vocab = w_dv.shape
    if vocab < 2:
        return f"vocabulary of {vocab}"
    if not interpret and jax.default_backend() != "tpu" and (d & (d - 1) or d < 16 or vocab < 16):
        return f"hidden size {d} not a power of two >= 16, or vocabulary {vocab} < 16"
    return None


def residual_argmax(x_md, w_dv, *, mask_id: int | None, norm=None, residual=None, tile_m: int = TILE_M,
                    tile_v: int = TILE_V, tile_d: int = TILE_D, split_v: int = SPLIT_V, warps: int = WARPS,
                    stages: int = STAGES) -> ArgmaxScores:
    """Per position m: the argmax of lm_head(norm(x_m)) (+ s * lm_head(h_p_m)) over the vocabulary
    without `mask_id` (None: over all of it, as an autoregressive model's greedy pick), its
    probability, the entropy and the top-1 minus top-2 probability.

    x_md [M, D] (final-normed already unless `norm` = (scale [D], eps)); w_dv [D, V] the lm_head;
    residual = (h_p [M, D], s): MRP's residual in logit space. Greedy only (no sampling). Tiles:
    `tile_m` positions x `tile_v` columns, dots over `tile_d` of the hidden size, one program per
    `split_v` columns (all powers of two on GPU; shrunk to fit small shapes), on `warps` warps with
    `stages` pipelining stages on GPU (benchmarks/decode_gpu.py's tiles section times choices)."""
    how = kernels.choose("residual_argmax", _unsupported(x_md, w_dv, kernels.current() == "interpret"))
    if how is None:
        return reference(x_md, w_dv, mask_id=mask_id, norm=norm, residual=residual)
    if how == "kernel" and jax.default_backend() == "tpu":
        return residual_argmax_tpu(x_md, w_dv, mask_id=mask_id, norm=norm, residual=residual, tile_m=TPU_TILE_M,
                                   tile_v=TPU_TILE_V, interpret=False)
    d, vocab = w_dv.shape
    tile_m = min(tile_m, max(16, 1 << (x_md.shape[0] - 1).bit_length()))  # a decode block is not padded to 64
    tile_v = min(tile_v, _floor_pow2(vocab))  # the last tile of a slice shifts left
    tile_d = min(tile_d, d) if d % min(tile_d, d) == 0 else d
    split_v = max(split_v // tile_v, 1) * tile_v
    call = functools.partial(_kernel.residual_argmax_stats, mask_id=mask_id, **_static(norm, residual), tile_m=tile_m,
                             tile_v=tile_v, tile_d=tile_d, split_v=split_v, interpret=how == "interpret",
                             triton=how == "kernel" and jax.default_backend() == "gpu", warps=warps, stages=stages)
    return _probed(call, _inputs(x_md, w_dv, norm, residual, tile_m), how == "interpret", x_md, w_dv,
                   mask_id=mask_id, norm=norm, residual=residual)


def _static(norm, residual) -> dict:
    """The kernels' static options: the norm's eps and the residual's scale (None: not applied)."""
    return dict(eps=None if norm is None else float(norm[1]),
                residual_scale=None if residual is None else float(residual[1]))


def _inputs(x_md, w_dv, norm, residual, tile_m: int) -> tuple:
    """The kernels' arguments (x, w, norm scale, h_p), rows padded to a multiple of `tile_m`."""
    pad = ((0, -x_md.shape[0] % tile_m), (0, 0))
    h_p = None if residual is None else jnp.pad(residual[0].astype(x_md.dtype), pad)
    return jnp.pad(x_md, pad), w_dv, None if norm is None else norm[0], h_p


def _probed(call, args, interpret: bool, x_md, w_dv, **options) -> ArgmaxScores:
    """The kernel `call`'s scores of the first M rows, compile-probed first when real (not
    interpret): the reference runs, with the reason logged, where the device refuses it."""
    error = None if interpret else kernels.compile_error("residual_argmax", call, *args)
    if error is not None:
        kernels.fallback("residual_argmax", error)
        return reference(x_md, w_dv, **options)
    return ArgmaxScores(*(a[: x_md.shape[0]] for a in _kernel.finish(*call(*args))))


def residual_argmax_tpu(x_md, w_dv, *, mask_id: int | None, norm=None, residual=None, tile_m: int = TPU_TILE_M,
                        tile_v: int = TPU_TILE_V, interpret: bool) -> ArgmaxScores:
    """`residual_argmax` through the Mosaic-shaped kernel (`kernel_tpu`): positions in one whole
    tile when they fit, else padded to tiles of `tile_m`; the vocabulary in tiles of `tile_v`
    (one whole tile when smaller)."""
    tile_m = min(tile_m, x_md.shape[0])
    call = functools.partial(_kernel_tpu.residual_argmax_stats, mask_id=mask_id, **_static(norm, residual),
                             tile_m=tile_m, tile_v=min(tile_v, w_dv.shape[1]), interpret=interpret)
    return _probed(call, _inputs(x_md, w_dv, norm, residual, tile_m), interpret, x_md, w_dv, mask_id=mask_id,
                   norm=norm, residual=residual)
