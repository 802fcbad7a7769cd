"""The definition of `grouped_matmul`, and the tile layout it reads: rows sorted by expert into
tiles of `tile_m` rows, each tile one expert's (the MoE layer's rows, `dlmjax.models.moe`)."""

from __future__ import annotations

import jax.numpy as jnp


def tile_layout(expert_m, num_experts: int, tile_m: int):
    """(row_it [I, tile_m], tiles_end_e [E]) for rows whose experts are `expert_m` [M] (an id of E:
    a padding row, in no tile): expert e owns tiles [tiles_end_e[e-1], tiles_end_e[e]) in expert
    order, its rows in their order (stable), the last tile part empty; row_it holds each tile
    slot's row, M where none. I = ceil(M / tile_m) + min(E, M) tiles, enough for any routing; the
    tiles past tiles_end_e[-1] are unused."""
    m = expert_m.shape[0]
    max_tiles = tile_count(m, num_experts, tile_m)
    order_m = jnp.argsort(expert_m, stable=True)
    sizes_e = jnp.bincount(expert_m, length=num_experts).astype(jnp.int32)
    tiles_e = -(-sizes_e // tile_m)
    tiles_end_e = jnp.cumsum(tiles_e).astype(jnp.int32)
    tile_i = jnp.arange(max_tiles, dtype=jnp.int32)
    expert_i = tile_expert(tiles_end_e, max_tiles)
    within_it = (tile_i - (tiles_end_e - tiles_e)[expert_i])[:, None] * tile_m + jnp.arange(tile_m, dtype=jnp.int32)
    valid_it = used_tiles(tiles_end_e, max_tiles)[:, None] & (within_it < sizes_e[expert_i][:, None])
    sorted_it = (jnp.cumsum(sizes_e) - sizes_e)[expert_i][:, None] + within_it
    return jnp.where(valid_it, order_m[jnp.where(valid_it, sorted_it, 0)], m), tiles_end_e


def tile_count(num_rows: int, num_experts: int, tile_m: int) -> int:
    """Tiles of `tile_layout` for `num_rows` rows: ceil(rows / tile_m) + min(E, rows), enough for any
    routing (each expert's last tile may be part empty)."""
    return -(-num_rows // tile_m) + min(num_experts, num_rows)


def used_tiles(tiles_end_e, num_tiles: int):
    """[I] whether each tile holds an expert's rows (the tiles past the last expert's end do not)."""
    return jnp.arange(num_tiles) < tiles_end_e[-1]


def tile_expert(tiles_end_e, num_tiles: int):
    """[I] the expert that owns each tile (the last expert for the unused tiles past the end)."""
    # searchsorted(side="right") as a count, which jax 0.10 also differentiates inside a shard_map
    owner = jnp.sum(tiles_end_e[None, :] <= jnp.arange(num_tiles, dtype=tiles_end_e.dtype)[:, None], axis=1)
    return jnp.minimum(owner, tiles_end_e.shape[0] - 1).astype(jnp.int32)


def grouped_matmul(x_rk, tiles_end_e, w_ekn, *, tile_m: int):
    """[I * tile_m, N] float32: each tile's rows of x [I * tile_m, K] times its expert's w [E, K, N];
    the unused tiles' rows are 0."""
    num_tiles = x_rk.shape[0] // tile_m
    expert_i = tile_expert(tiles_end_e, num_tiles)
    out = jnp.einsum("itk,ikn->itn", x_rk.reshape(num_tiles, tile_m, -1), w_ekn[expert_i],
                     preferred_element_type=jnp.float32)
    return jnp.where(used_tiles(tiles_end_e, num_tiles)[:, None, None], out, 0.0).reshape(num_tiles * tile_m, -1)
