"""Dropless mixture-of-experts layer: a router scored in float32, SiLU-gated experts, an optional shared expert.

    y = sum_k weight_tk * expert_{e_tk}(x_t)  (+ shared(x_t))

Routers (`ModelConfig.router`), each as its family's modeling code computes it:
- "softmax": the gate's logits in the model's dtype (its Linear in bf16 for a bf16 model, as
  transformers' Qwen3-MoE, LLaDA-MoE's and SDAR's code run it), then softmax over all experts in
  float32 and top-k; `norm_topk_prob` renormalises the k weights to sum to 1 (Qwen3-MoE,
  SDAR-MoE), or not (LLaDA-MoE);
- "sigmoid": DeepSeek-V3's router (LLaDA2), logits in float32 (its gate casts both operands):
  sigmoid scores; a per-expert bias is added for the
  choice only; experts form `router_groups` groups, a group scored by the sum of its two best
  experts, and a token picks its experts inside its `router_topk_groups` best groups; the weights
  are the unbiased sigmoids of the chosen experts, renormalised (`norm_topk_prob`), times
  `routed_scaling_factor`.

Experts are computed grouped on CPU and TPU: the T*k (token, expert) assignments are sorted by
expert and each expert's rows go through one `jax.lax.ragged_dot` against the stacked expert
weights on TPU, and in tiles through a scan that reads only the chosen experts on CPU
(`grouped_rows`). On GPU every expert runs on every token (`dense_expert_outputs`, in chunks of
tokens), which costs k times fewer FLOPs there than XLA's rewrite of ragged_dot
(`resolve_implementation`). Nothing is dropped and there is no capacity: a token's output depends
on its own hidden state only, never on which or how many tokens share the batch.

In the batch-invariant numerics mode (`dlmjax.numerics(invariant=True)`) tokens go through the
experts in fixed tiles of `row_tile` tokens, one compiled shape whatever the batch.

Expert parallelism: with the experts split over a mesh 'expert' axis, `MoE.expert_dispatch` says
how tokens meet them: "all_to_all" (tokens sent to their experts' devices and back under
shard_map, in padded buffers that can never overflow), "gather" (experts all-gathered, tokens
stay), "xla" (the layer as written, XLA partitioning it) or "auto" (whichever of the first two
moves fewer bytes for the token count at hand; `resolve_dispatch`, `dispatch_bytes`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dlmjax import arithmetic, kernels
from dlmjax.config import ModelConfig
from dlmjax.kernels import grouped_matmul
from dlmjax.sharding import DEFAULT_RULES, mesh_of, mesh_sizes
from dlmjax.validation import InputError

_INIT_STD = 0.02


# ----------------------------------------------------------------------------------------------
# Routers (pure, float32)


def route_softmax(logits_te, top_k: int, normalize: bool):
    """(weights [T, k] float32, experts [T, k] int32): top-k of the softmax over all experts.
    Ties go to the lower expert index."""
    probs_te = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    weights_tk, experts_tk = jax.lax.top_k(probs_te, top_k)
    if normalize:
        weights_tk = weights_tk / weights_tk.sum(axis=-1, keepdims=True)
    return weights_tk, experts_tk.astype(jnp.int32)


def route_sigmoid(logits_te, bias_e, top_k: int, *, groups: int, topk_groups: int, normalize: bool,
                  scale: float):
    """DeepSeek-V3 / LLaDA2 routing (see the module docstring); bias_e may be None."""
    scores_te = jax.nn.sigmoid(logits_te.astype(jnp.float32))
    choice_te = scores_te if bias_e is None else scores_te + bias_e.astype(jnp.float32)
    t, e = choice_te.shape
    if groups > 1:
        grouped_tgs = choice_te.reshape(t, groups, e // groups)
        group_score_tg = jax.lax.top_k(grouped_tgs, 2)[0].sum(axis=-1)
        _, best_groups = jax.lax.top_k(group_score_tg, topk_groups)
        keep_tg = jax.nn.one_hot(best_groups, groups, dtype=jnp.int32).sum(axis=1) > 0
        keep_te = jnp.repeat(keep_tg, e // groups, axis=-1)
        choice_te = jnp.where(keep_te, choice_te, -jnp.inf)
    _, experts_tk = jax.lax.top_k(choice_te, top_k)
    weights_tk = jnp.take_along_axis(scores_te, experts_tk, axis=-1)
    if normalize:
        weights_tk = weights_tk / (weights_tk.sum(axis=-1, keepdims=True) + 1e-20)
    return weights_tk * scale, experts_tk.astype(jnp.int32)


def route(cfg: ModelConfig, logits_te, bias_e=None):
    if cfg.router == "softmax":
        return route_softmax(logits_te, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    return route_sigmoid(logits_te, bias_e, cfg.num_experts_per_tok, groups=cfg.router_groups,
                         topk_groups=cfg.router_topk_groups, normalize=cfg.norm_topk_prob,
                         scale=cfg.routed_scaling_factor)


# ----------------------------------------------------------------------------------------------
# Experts (pure)


def _swiglu(h_m2f):
    gate, up = jnp.split(h_m2f, 2, axis=-1)
    return jax.nn.silu(gate) * up


def grouped_rows(x_md, expert_m, gate_up_ed2f, down_efd):
    """Each row's output [M, D] through its own expert (unweighted), rows kept in their order. A
    row whose expert id is E (one past the last) is padding: it falls in no group and gives zeros.
    Through the grouped_matmul kernel where it runs (`kernel_serves`), else on CPU `tiled_rows`
    (jax lowers ragged_dot there to a dense dot over every expert), elsewhere `ragged_rows`."""
    if kernel_serves(x_md.shape[0], x_md.dtype, gate_up_ed2f, down_efd):
        return kernel_rows(x_md, expert_m, gate_up_ed2f, down_efd)
    rows_fn = tiled_rows if jax.default_backend() == "cpu" else ragged_rows
    return rows_fn(x_md, expert_m, gate_up_ed2f, down_efd)


def kernel_serves(num_rows: int, dtype, gate_up_ed2f, down_efd) -> bool:
    """Whether the grouped_matmul kernel runs both of the experts' matmuls for `num_rows` rows (the
    kernel mode, device, numerics and widths allow it and the device compiles it;
    `grouped_matmul.runs` logs why not)."""
    num_experts, d, f2 = gate_up_ed2f.shape
    tile = _kernel_tile(num_rows, num_experts)
    rows = grouped_matmul.tile_count(num_rows, num_experts, tile) * tile  # `tile_layout`'s rows
    return all(grouped_matmul.runs(rows, k, n, num_experts, tile, dtype) is not None
               for k, n in ((d, f2), (down_efd.shape[1], d)))


def _kernel_tile(num_rows: int, num_experts: int) -> int:
    return max(grouped_matmul.MIN_TILE, expert_tile(num_rows, num_experts))


def kernel_rows(x_md, expert_m, gate_up_ed2f, down_efd):
    """`grouped_rows` through the grouped_matmul kernel: the rows gathered into tiles of one expert
    each (`tile_layout`), both projections computed by the kernel for the chosen experts only, the
    rows put back in their order."""
    m, num_experts = expert_m.shape[0], gate_up_ed2f.shape[0]
    tile = _kernel_tile(m, num_experts)
    row_it, tiles_end_e = grouped_matmul.tile_layout(expert_m, num_experts, tile)
    row_r = row_it.reshape(-1)
    x_rd = jnp.where((row_r < m)[:, None], x_md[jnp.minimum(row_r, m - 1)], 0)
    h_r2f = grouped_matmul.grouped_matmul(x_rd, tiles_end_e, gate_up_ed2f, tile_m=tile)
    y_rd = grouped_matmul.grouped_matmul(_swiglu(h_r2f).astype(x_md.dtype), tiles_end_e, down_efd, tile_m=tile)
    return jnp.zeros((m, y_rd.shape[-1]), jnp.float32).at[row_r].set(y_rd, mode="drop").astype(x_md.dtype)


def ragged_rows(x_md, expert_m, gate_up_ed2f, down_efd):
    """`grouped_rows` by the rows sorted by expert, one ragged_dot per projection over the experts'
    row groups, then put back (padding rows sort last, past every group)."""
    order_m, sizes_e = _expert_groups(expert_m, gate_up_ed2f.shape[0])
    h_m2f = jax.lax.ragged_dot(x_md[order_m], gate_up_ed2f, sizes_e, preferred_element_type=jnp.float32)
    y_md = jax.lax.ragged_dot(_swiglu(h_m2f).astype(x_md.dtype), down_efd, sizes_e,
                              preferred_element_type=jnp.float32)
    return jnp.zeros_like(y_md).at[order_m].set(y_md).astype(x_md.dtype)  # back to row order


def _expert_groups(expert_m, num_experts: int):
    """(order [M]: sorted row -> row, rows sorted by expert (stable); sizes [E]: rows per expert).
    Padding rows (id E) sort last and count in no expert."""
    order_m = jnp.argsort(expert_m, stable=True)
    return order_m, jnp.bincount(expert_m, length=num_experts).astype(jnp.int32)


def expert_tile(num_rows: int, num_experts: int) -> int:
    """Rows per tile of `tiled_rows`: about the mean rows per expert, a power of two in [8, 128]; 8
    in the batch-invariant mode, where a row's matmul must not change shape with the batch."""
    if arithmetic.current().invariant:
        return 8
    mean = -(-num_rows // num_experts)
    return min(max(8, 1 << (mean - 1).bit_length()), 128)


def tiled_rows(x_md, expert_m, gate_up_ed2f, down_efd):
    """`grouped_rows` reading only the chosen experts: each expert's rows cut into tiles of
    `expert_tile` rows (its last tile part empty; `tile_layout`), and a scan over the tiles that
    computes a used tile against its one expert's weights and skips the unused ones. At most
    ceil(M / t) + min(E, M) tiles exist, so the work is about the assignments', not every expert's
    on every row."""
    m, num_experts = expert_m.shape[0], gate_up_ed2f.shape[0]
    row_it, tiles_end_e = grouped_matmul.tile_layout(expert_m, num_experts, expert_tile(m, num_experts))
    num_tiles = row_it.shape[0]
    expert_i = grouped_matmul.tile_expert(tiles_end_e, num_tiles)
    used_i = grouped_matmul.used_tiles(tiles_end_e, num_tiles)

    def tile_output(x_td, expert):
        h_t2f = jnp.dot(x_td, gate_up_ed2f[expert], preferred_element_type=jnp.float32)
        return jnp.dot(_swiglu(h_t2f).astype(x_td.dtype), down_efd[expert], preferred_element_type=jnp.float32)

    def step(_, tile):
        row_t, expert, used = tile
        x_td = x_md[jnp.minimum(row_t, m - 1)]
        y_td = jax.lax.cond(used, tile_output, lambda x, e: jnp.zeros_like(x, jnp.float32), x_td, expert)
        return None, y_td

    _, y_itd = jax.lax.scan(step, None, (row_it, expert_i, used_i))
    y_md = jnp.zeros((m, x_md.shape[-1]), jnp.float32).at[row_it.reshape(-1)].set(
        y_itd.reshape(-1, x_md.shape[-1]), mode="drop")
    return y_md.astype(x_md.dtype)


def grouped_expert_outputs(x_td, experts_tk, gate_up_ed2f, down_efd):
    """Each assignment's expert output [T, k, D] (unweighted): the T*k assignments' rows through
    `grouped_rows`."""
    t, k = experts_tk.shape
    y_md = grouped_rows(jnp.repeat(x_td, k, axis=0), experts_tk.reshape(-1), gate_up_ed2f, down_efd)
    return y_md.reshape(t, k, -1)


DENSE_CHUNK_BYTES = 256 << 20  # `dense_expert_outputs`' float32 intermediates per chunk of tokens


def dense_expert_outputs(x_td, experts_tk, gate_up_ed2f, down_efd):
    """Every expert on every token, then each assignment's own output [T, k, D] (unweighted): the
    reference in tests, and what "auto" runs on GPU (`resolve_implementation`). Tokens go through in
    chunks that hold its float32 intermediates, [tokens, E, 2F] and [tokens, E, D], to about
    DENSE_CHUNK_BYTES, in the backward pass too (a chunk's are recomputed there). Chunk c holds
    tokens c, c + n, c + 2n, ... (n chunks), so tokens split over devices stay split: each device
    computes its own tokens' share of every chunk."""
    num_experts, d, f2 = gate_up_ed2f.shape
    chunk = max(1, DENSE_CHUNK_BYTES // (num_experts * (f2 + d) * 4))
    t = x_td.shape[0]
    if t <= chunk:
        return _every_expert(x_td, experts_tk, gate_up_ed2f, down_efd)
    n = -(-t // chunk)
    pad = ((0, n * chunk - t), (0, 0))
    strided = lambda a: jnp.pad(a, pad).reshape(chunk, n, -1).swapaxes(0, 1)  # noqa: E731  [n, chunk, .]
    y_nckd = jax.lax.map(jax.checkpoint(lambda xe: _every_expert(*xe, gate_up_ed2f, down_efd)),
                         (strided(x_td), strided(experts_tk)))
    return y_nckd.swapaxes(0, 1).reshape(n * chunk, *y_nckd.shape[2:])[:t]


def _every_expert(x_td, experts_tk, gate_up_ed2f, down_efd):
    # XLA:CPU has no bf16 x bf16 -> f32 batched dot: float32 operands there (the products of bf16
    # values are exact in float32, so only the summation order can differ)
    operands = jnp.float32 if jax.default_backend() == "cpu" else x_td.dtype
    h_te2f = jnp.einsum("td,edf->tef", x_td.astype(operands), gate_up_ed2f.astype(operands),
                        preferred_element_type=jnp.float32)
    y_ted = jnp.einsum("tef,efd->ted", _swiglu(h_te2f).astype(x_td.dtype).astype(operands),
                       down_efd.astype(operands), preferred_element_type=jnp.float32)
    return jnp.take_along_axis(y_ted, experts_tk[:, :, None], axis=1).astype(x_td.dtype)


EXPERT_IMPLEMENTATIONS = {"grouped": grouped_expert_outputs, "dense": dense_expert_outputs}


def check_implementation(implementation: str) -> str:
    """`implementation` if it names one ("auto", "grouped" or "dense"), else an InputError."""
    if implementation != "auto" and implementation not in EXPERT_IMPLEMENTATIONS:
        raise InputError(f"expert implementation {implementation!r}: choose one of auto, "
                         f"{', '.join(EXPERT_IMPLEMENTATIONS)}")
    return implementation


def resolve_implementation(implementation: str, num_rows: int, dtype, gate_up_ed2f, down_efd) -> str:
    """"grouped" or "dense" as named; "auto" picks at trace time, for `num_rows` assignment rows: on
    GPU "grouped" where the grouped_matmul kernel runs them (`kernel_serves`: `dlmjax.kernels` "on"
    today, "auto" once a GPU measures it faster), else "dense"; elsewhere "grouped". XLA's GPU
    backend (jax 0.11) rewrites ragged_dot into a dot of every row against every expert, so grouped
    through it costs k times dense's FLOPs (k rows per token, each against all E experts, where
    dense runs each token once against all E): on an H100 at LLaDA-MoE-7B-A1B's shape its timings
    matched that rewrite's FLOPs at ~700 TFLOP/s (benchmarks/results/decode_gpu/gpu-h100.md)."""
    if check_implementation(implementation) != "auto":
        return implementation
    if jax.default_backend() != "gpu":
        return "grouped"
    return "grouped" if kernel_serves(num_rows, dtype, gate_up_ed2f, down_efd) else "dense"


def combine(y_tkd, weights_tk):
    """sum_k weight * output, in float32, slot by slot in a fixed order."""
    out = y_tkd[:, 0].astype(jnp.float32) * weights_tk[:, :1]
    for slot in range(1, y_tkd.shape[1]):
        out = out + y_tkd[:, slot].astype(jnp.float32) * weights_tk[:, slot:slot + 1]
    return out.astype(y_tkd.dtype)


def router_logits(rows_td, router_de, cfg: ModelConfig):
    """[T, E] gate logits as the family computes them (module docstring): in the rows' dtype for
    the softmax routers (float32 accumulation, rounded like the reference's Linear), in float32
    for the sigmoid router."""
    if cfg.router == "sigmoid":
        return arithmetic.matmul(rows_td.astype(jnp.float32), router_de.astype(jnp.float32))
    logits = arithmetic.matmul(rows_td, router_de.astype(rows_td.dtype), preferred_element_type=jnp.float32)
    return logits.astype(rows_td.dtype)


def _routed(rows_td, router_de, bias_e, gate_up, down, cfg: ModelConfig, experts_fn):
    """rows -> router -> experts_fn(rows, experts, gate_up, down) [T, k, D] -> combined [T, D]."""
    weights_tk, experts_tk = route(cfg, router_logits(rows_td, router_de, cfg), bias_e)
    return combine(experts_fn(rows_td, experts_tk, gate_up, down), weights_tk)


def moe_forward(x_td, router_de, bias_e, gate_up_ed2f, down_efd, cfg: ModelConfig, implementation: str = "auto",
                dispatch: str = "auto"):
    """The routed experts' contribution [T, D] for tokens x [T, D] (no shared expert).

    dispatch (only matters where the experts' mesh has an 'expert' axis > 1; see `resolve_dispatch`):
    "all_to_all", "gather", "xla" or "auto". `implementation` ("auto", "grouped" or "dense";
    `resolve_implementation`) applies to the local, "xla" and "gather" paths; the all-to-all path
    always runs its experts grouped."""
    rows = x_td.shape[0] * cfg.num_experts_per_tok
    experts_fn = EXPERT_IMPLEMENTATIONS[resolve_implementation(implementation, rows, x_td.dtype, gate_up_ed2f,
                                                               down_efd)]
    mesh = _expert_mesh(gate_up_ed2f)
    mode = resolve_dispatch(dispatch, x_td.shape[0], cfg, mesh)
    if mode in ("local", "xla"):
        def routed(rows_td, weights):
            return _routed(rows_td, *weights, cfg, experts_fn)

        # invariant mode: fixed tiles of rows, one shape whatever T
        return arithmetic.rowwise(routed, x_td, weights=((router_de, bias_e, gate_up_ed2f, down_efd),))
    return _shard_mapped(mode, x_td, router_de, bias_e, gate_up_ed2f, down_efd, cfg, mesh, experts_fn)


# ----------------------------------------------------------------------------------------------
# Expert parallelism: how tokens meet experts split over the mesh's 'expert' axis

EXPERT_DISPATCH = ("auto", "all_to_all", "gather", "xla")
EXPERT_AXIS = "expert"
# "auto" picks, at trace time, the path that moves fewer bytes per device per layer (see
# `dispatch_bytes`): all-to-all for decode-like token counts, all-gathered experts once a device's
# token slice is large enough that the padded dropless buffers outweigh the experts.


def _expert_mesh(experts):
    """The (abstract) mesh the experts live on (`sharding.mesh_of`) if it has an expert axis, else None."""
    mesh = mesh_of(experts)
    return mesh if mesh is not None and EXPERT_AXIS in mesh.axis_names else None


def _token_axes(num_tokens: int, mesh):
    """(batch axes the tokens arrive split over, the other axes (size > 1) each slice is split over
    inside the layer)."""
    sizes = mesh_sizes(mesh)
    batch = DEFAULT_RULES.spec(("batch", None), (num_tokens, 1), sizes)[0]
    batch = () if batch is None else (batch,) if isinstance(batch, str) else tuple(batch)
    split = tuple(a for a in mesh.axis_names if sizes[a] > 1 and a not in batch)
    return batch, split


def dispatch_bytes(num_tokens: int, cfg: ModelConfig, mesh, itemsize: int = 4) -> dict[str, int]:
    """Bytes each path's collectives deliver to one device for one layer (what the compiled HLO's
    all-to-all / all-gather ops produce; benchmarks/moe_ep_cpu.py reads them back):
    - all_to_all: rows out and back, n buffers of C = S * min(k, E/n) rows of D, plus C ids each,
      for a slice of S tokens per device;
    - gather: the stacked experts, E x D x 3F, all-gathered."""
    sizes = mesh_sizes(mesh)
    n = sizes[EXPERT_AXIS]
    batch, split = _token_axes(num_tokens, mesh)
    s = -(-num_tokens // math.prod(sizes[a] for a in batch + split))
    cap = s * min(cfg.num_experts_per_tok, cfg.num_experts // n)
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    return {"all_to_all": n * cap * (2 * d * itemsize + 4), "gather": cfg.num_experts * d * 3 * f * itemsize}


def resolve_dispatch(dispatch: str, num_tokens: int, cfg: ModelConfig, mesh) -> str:
    """The path for `num_tokens` tokens: "local" without an expert axis > 1 (or experts that do not
    divide over it: they are then replicated); else the setting, "auto" being whichever of
    "all_to_all" and "gather" moves fewer bytes (`dispatch_bytes`; ties go to all-to-all)."""
    if dispatch not in EXPERT_DISPATCH:
        raise InputError(f"expert_dispatch {dispatch!r}: choose one of {', '.join(EXPERT_DISPATCH)}")
    n = 1 if mesh is None else mesh_sizes(mesh)[EXPERT_AXIS]
    if n == 1:
        return "local"
    if cfg.num_experts % n:
        if dispatch in ("auto", "xla", "gather"):
            return "local"  # the experts are replicated (load_model splits only what divides)
        raise InputError(f"expert_dispatch 'all_to_all' needs the {cfg.num_experts} experts to divide over the "
                         f"{n} devices of the 'expert' axis; choose an expert axis size that divides them")
    if dispatch != "auto":
        return dispatch
    moved = dispatch_bytes(num_tokens, cfg, mesh, jnp.dtype(cfg.dtype).itemsize)
    return "all_to_all" if moved["all_to_all"] <= moved["gather"] else "gather"


def dispatch_mismatch(dispatch: str, cfg: ModelConfig, mesh, expert_option: str) -> str | None:
    """Why an explicit `dispatch` would be ignored for this model on `mesh` (None where it applies):
    only an MoE model whose experts divide over an 'expert' axis > 1 meets them by a dispatch;
    elsewhere `resolve_dispatch` runs the experts locally whatever is asked. `expert_option` is how
    the caller's user sizes that axis (e.g. "--mesh expert=N")."""
    if dispatch == "auto":
        return None
    if not cfg.num_experts:
        return "the model is dense, with no experts to dispatch to; leave the dispatch at auto"
    n = 1 if mesh is None else mesh_sizes(mesh).get(EXPERT_AXIS, 1)
    if n == 1:
        return (f"without an expert axis every device holds all {cfg.num_experts} experts and runs them locally; "
                f"split them with {expert_option} (N dividing {cfg.num_experts}) or leave the dispatch at auto")
    if cfg.num_experts % n:
        return (f"the {cfg.num_experts} experts do not divide over expert={n}, so every device holds them all; "
                f"choose {expert_option} with N dividing {cfg.num_experts}")
    return None


def _shard_mapped(mode, x_td, router_de, bias_e, gate_up_ed2f, down_efd, cfg, mesh, experts_fn):
    """Tokens stay split over the batch axes; each device then takes its slice of its tokens (over
    the other axes: 'expert', 'model', ...), routes it, and either
    - "all_to_all": sends each assignment's row to the device holding its expert
      (`_all_to_all_expert_outputs`), which computes its local experts grouped and sends the
      outputs back; or
    - "gather": computes all experts itself on weights all-gathered over 'expert';
    then the slices are all-gathered, so the layer's output is laid out as its input."""
    batch, split = _token_axes(x_td.shape[0], mesh)
    split_size = math.prod(mesh_sizes(mesh)[a] for a in split)
    token_spec = P(batch if len(batch) > 1 else (batch[0] if batch else None), None)
    expert_spec = P(EXPERT_AXIS, None, None) if mode == "all_to_all" else P(None, None, None)
    args = (x_td, router_de, gate_up_ed2f, down_efd) + (() if bias_e is None else (bias_e,))

    if mode == "all_to_all":
        n = mesh_sizes(mesh)[EXPERT_AXIS]

        def experts_fn_local(rows_sd, experts_sk, gate_up, down):
            return _all_to_all_expert_outputs(rows_sd, experts_sk, gate_up, down, n)
    else:
        experts_fn_local = experts_fn

    def body(x_local, router, gate_up, down, *bias):
        t = x_local.shape[0]
        s = -(-t // split_size)
        padded = jnp.pad(x_local, ((0, s * split_size - t), (0, 0)))
        mine = jax.lax.dynamic_slice_in_dim(padded, jax.lax.axis_index(split) * s, s)
        y = arithmetic.rowwise(lambda rows: _routed(rows, router, bias[0] if bias else None, gate_up, down, cfg,
                                                    experts_fn_local), mine)
        return jax.lax.all_gather(y, split, tiled=True)[:t]

    in_specs = (token_spec, P(None, None), expert_spec, expert_spec) + (() if bias_e is None else (P(None),))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=token_spec,
                         check_vma=False)(*args)  # all_gather leaves the output the same on the split axes


def _all_to_all_expert_outputs(x_sd, experts_sk, gate_up_ld2f, down_lfd, n: int):
    """Each assignment's expert output [S, k, D] (unweighted), inside shard_map, for this device's S
    tokens, with this device's L = E / n experts (device j holds experts j*L .. j*L+L-1).

    Dropless with fixed shapes: a token's k experts are distinct, so it sends at most min(k, L) rows
    to one device, and a buffer of C = S * min(k, L) rows per destination holds every assignment
    whatever the routing (all S tokens to one expert included). Assignments sorted by expert fill
    each destination's buffer from slot 0; one all_to_all over 'expert' moves rows and their local
    expert ids (L marks an empty slot), the receiver runs `grouped_rows` over everything it got,
    and the reverse all_to_all brings each output back to the slot it left from."""
    s, k = experts_sk.shape
    local = gate_up_ld2f.shape[0]
    cap = s * min(k, local)
    flat_m = experts_sk.reshape(-1)
    order_m = jnp.argsort(flat_m, stable=True)  # sorted position -> assignment
    expert_m = flat_m[order_m]
    dest_m = expert_m // local
    count_n = jnp.bincount(dest_m, length=n)
    slot_m = jnp.arange(s * k, dtype=jnp.int32) - (jnp.cumsum(count_n) - count_n)[dest_m]
    send_ncd = jnp.zeros((n, cap, x_sd.shape[-1]), x_sd.dtype).at[dest_m, slot_m].set(x_sd[order_m // k])
    send_ids_nc = jnp.full((n, cap), local, jnp.int32).at[dest_m, slot_m].set(expert_m % local)
    recv_ncd = jax.lax.all_to_all(send_ncd, EXPERT_AXIS, 0, 0, tiled=True)  # [source, slot, D]
    recv_ids_nc = jax.lax.all_to_all(send_ids_nc, EXPERT_AXIS, 0, 0, tiled=True)
    out_ncd = grouped_rows(recv_ncd.reshape(n * cap, -1), recv_ids_nc.reshape(-1), gate_up_ld2f, down_lfd)
    back_ncd = jax.lax.all_to_all(out_ncd.reshape(n, cap, -1), EXPERT_AXIS, 0, 0, tiled=True)  # [dest, slot, D]
    y_md = jnp.zeros((s * k, x_sd.shape[-1]), x_sd.dtype).at[order_m].set(back_ncd[dest_m, slot_m])
    return y_md.reshape(s, k, -1)


# ----------------------------------------------------------------------------------------------
# Module


def _normal(rngs: nnx.Rngs, shape, dtype):
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * _INIT_STD).astype(dtype)


def set_expert_dispatch(model: nnx.Module, dispatch: str) -> nnx.Module:
    """Set every MoE layer's `expert_dispatch` ("auto", "all_to_all", "gather" or "xla") in place;
    returns the model."""
    if dispatch not in EXPERT_DISPATCH:
        raise InputError(f"expert_dispatch {dispatch!r}: choose one of {', '.join(EXPERT_DISPATCH)}")
    for _, module in nnx.iter_graph(model):
        if isinstance(module, MoE):
            module.expert_dispatch = dispatch
    return model


def set_expert_implementation(model: nnx.Module, implementation: str) -> nnx.Module:
    """Set every MoE layer's `implementation` ("auto", "grouped" or "dense") in place; returns the model."""
    check_implementation(implementation)
    for _, module in nnx.iter_graph(model):
        if isinstance(module, MoE):
            module.implementation = implementation
    return model


class MoE(nnx.Module):
    """Router [D, E] and expert bias [E] (float32, as the families keep them), stacked experts
    gate_up [E, D, 2F] (gate columns first) and down [E, F, D], and `shared` (an MLP or None)."""

    implementation = "auto"  # "grouped" or "dense" (every expert on every token): `resolve_implementation`
    expert_dispatch = "auto"  # with experts split over a mesh 'expert' axis: see `resolve_dispatch`

    def __init__(self, cfg: ModelConfig, *, shared: nnx.Module | None, rngs: nnx.Rngs):
        d, e, f, dt = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.dtype
        self.config = cfg
        self.router = nnx.Param(_normal(rngs, (d, e), jnp.float32))
        self.expert_bias = nnx.Param(jnp.zeros((e,), jnp.float32)) if cfg.router_expert_bias else None
        self.experts_gate_up = nnx.Param(_normal(rngs, (e, d, 2 * f), dt))
        self.experts_down = nnx.Param(_normal(rngs, (e, f, d), dt))
        self.shared = shared

    def __call__(self, x):
        lead, d = x.shape[:-1], x.shape[-1]
        x_td = x.reshape(math.prod(lead), d)
        bias = None if self.expert_bias is None else self.expert_bias[...]
        y = moe_forward(x_td, self.router[...], bias, self.experts_gate_up[...], self.experts_down[...],
                        self.config, self.implementation, self.expert_dispatch).reshape(x.shape)
        return y if self.shared is None else y + self.shared(x)
