"""KV cache: prefill + cached chunk forwards equal the full forward (causal and block-causal)."""

import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import KVCache, ModelConfig, init_model

TOL = 1e-5


def tiny_config(family: str, **overrides) -> ModelConfig:
    attention = {"qwen3": "causal", "sdar": "block_causal"}[family]
    base = dict(
        family=family, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, attention=attention, block_size=4 if attention == "block_causal" else None,
        qk_norm=True, max_position_embeddings=128,
    )
    return ModelConfig(**{**base, **overrides})


def positions(start: int, length: int, batch: int = 2):
    return jnp.broadcast_to(jnp.arange(start, start + length, dtype=jnp.int32), (batch, length))


def tokens(length: int, batch: int = 2, seed: int = 0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, 64, (batch, length)), jnp.int32)


def max_diff(a, b):
    return float(jnp.max(jnp.abs(a - b)))


def test_causal_prefill_then_single_tokens_equal_full_forward():
    model = init_model(tiny_config("qwen3"))
    seq = tokens(10)
    full = model(seq).logits
    cache = KVCache.init(model.config, 2, 16)
    out = model(seq[:, :6], positions(0, 6), cache=cache, write_cache=True)
    assert int(out.cache.length) == 6
    assert max_diff(out.logits, full[:, :6]) <= TOL
    cache = out.cache
    for t in range(6, 10):
        out = model(seq[:, t : t + 1], positions(t, 1), cache=cache, write_cache=True)
        cache = out.cache
        assert max_diff(out.logits[:, 0], full[:, t]) <= TOL


def test_block_causal_denoise_does_not_write_and_store_appends():
    model = init_model(tiny_config("sdar"))
    seq = tokens(16)
    full = model(seq).logits
    cache = KVCache.init(model.config, 2, 16)
    prefill = model(seq[:, :8], positions(0, 8), cache=cache, write_cache=True)
    assert max_diff(prefill.logits, full[:, :8]) <= TOL
    # Denoising forward of block 2 against the cache: exact, and the cache is unchanged.
    denoise = model(seq[:, 8:12], positions(8, 4), cache=prefill.cache)
    assert max_diff(denoise.logits, full[:, 8:12]) <= TOL
    assert int(denoise.cache.length) == 8
    # Store forward of the finished block, then block 3 sees it.
    stored = model(seq[:, 8:12], positions(8, 4), cache=prefill.cache, write_cache=True, compute_logits=False)
    assert stored.logits is None and int(stored.cache.length) == 12
    block3 = model(seq[:, 12:16], positions(12, 4), cache=stored.cache)
    assert max_diff(block3.logits, full[:, 12:16]) <= TOL


def test_left_padding_is_invisible():
    """A row with left padding (invalid keys, positions from 0 at the first real token) gives
    the logits of the same tokens without padding, with and without a cache."""
    for family in ("qwen3", "sdar"):
        model = init_model(tiny_config(family), seed=3)
        seq = tokens(8, batch=1)
        alone = model(seq).logits
        padded = jnp.concatenate([jnp.full((1, 3), 7, jnp.int32), seq], axis=1)
        valid = jnp.asarray([[False] * 3 + [True] * 8])
        pos = jnp.asarray([[0, 0, 0] + list(range(8))], jnp.int32)
        out = model(padded, pos, valid_bl=valid)
        assert max_diff(out.logits[:, 3:], alone) <= TOL, family
        cache = KVCache.init(model.config, 1, 16)
        pre = model(padded[:, :7], pos[:, :7], valid_bl=valid[:, :7], cache=cache, write_cache=True)
        rest = model(padded[:, 7:], pos[:, 7:], cache=pre.cache)
        assert max_diff(rest.logits, alone[:, 4:]) <= TOL, family


def test_packed_copies_equal_separate_forwards():
    """Segments pack candidate copies of one block in a forward: each copy sees the cached
    prefix and itself only, so its logits equal a forward of that copy alone."""
    model = init_model(tiny_config("sdar"), seed=1)
    prefix = tokens(8, batch=1)
    cache = model(prefix, positions(0, 8, 1), cache=KVCache.init(model.config, 1, 8), write_cache=True).cache
    copies = [tokens(4, batch=1, seed=s) for s in range(3)]
    packed = jnp.concatenate(copies, axis=1)
    pos = jnp.tile(positions(8, 4, 1), (1, 3))
    seg = jnp.repeat(jnp.arange(1, 4, dtype=jnp.int32), 4)[None]
    out = model(packed, pos, segments_bl=seg, cache=cache)
    for i, copy in enumerate(copies):
        alone = model(copy, positions(8, 4, 1), cache=cache).logits
        assert max_diff(out.logits[:, 4 * i : 4 * i + 4], alone) <= TOL


def test_hidden_layers_follow_transformers_indexing():
    model = init_model(tiny_config("qwen3"))
    out = model(tokens(5), hidden_layers=(0, 2))
    assert len(out.layer_hidden) == 2
    assert max_diff(out.layer_hidden[0], model.embed_tokens(tokens(5))) == 0.0
    last = model.config.num_layers  # before the final norm (transformers' last entry has it applied)
    assert max_diff(model.final_norm(model(tokens(5), hidden_layers=(last,)).layer_hidden[0]), out.hidden) == 0.0
    for bad in ((last + 1,), (-1,), (2, 0), (1, 1)):  # would come back shorter or in another order
        with pytest.raises(ValueError, match=rf"hidden_layers=.*increasing indices in 0..{last}"):
            model(tokens(5), hidden_layers=bad)


def test_cache_requires_explicit_positions():
    model = init_model(tiny_config("qwen3"))
    with pytest.raises(ValueError, match="positions_bl"):
        model(tokens(2), cache=KVCache.init(model.config, 2, 4))
