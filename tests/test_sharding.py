"""The sharded forward on 8 fake CPU devices (2 x 4 mesh) equals the single-device forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dlmjax
from dlmjax.sharding import ShardingRules, batch_sharding, make_mesh

pytestmark = pytest.mark.devices(8)


def tiny_model(tmp_path):
    cfg = dlmjax.ModelConfig(
        family="sdar", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, attention="block_causal", block_size=4, qk_norm=True,
    )
    return dlmjax.export_model(dlmjax.init_model(cfg, seed=2), tmp_path / "ckpt")


def forward(model, tokens):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)(state, tokens)


def test_eight_devices_are_visible():
    assert len(jax.devices()) == 8, "tests/conftest.py must set the XLA flag before jax starts"


def test_sharded_forward_equals_single_device(tmp_path):
    path = tiny_model(tmp_path)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (4, 12)), jnp.int32)
    expected = forward(dlmjax.load_model(path), tokens)

    mesh = make_mesh(model=4, data=2)
    sharded = dlmjax.load_model(path, mesh=mesh)
    q = sharded.layers[0].attn.q.kernel[...]
    k = sharded.layers[0].attn.k.kernel[...]
    assert q.sharding.spec == P(None, "model")  # 4 heads over 4 devices: tensor parallel
    assert k.sharding.spec == P(None, None)  # 2 KV heads do not split over 4: replicated
    assert sharded.embed[...].sharding.spec == P("model", None)
    tokens_sharded = jax.device_put(tokens, batch_sharding(mesh, 2))
    with jax.set_mesh(mesh):
        got = forward(sharded, tokens_sharded)
    assert got.sharding.spec[0] == "data"
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=0)


def test_rules_reject_two_dims_on_one_axis():
    rules = ShardingRules(embed="model")
    with pytest.raises(ValueError, match="two dimensions onto mesh axis 'model'"):
        rules.spec(("embed", "heads"))


def test_rules_reject_unknown_mesh_axis():
    with pytest.raises(ValueError, match="mesh axes are"):
        ShardingRules(vocab="tensor")


def test_mesh_shape_must_fit_devices():
    with pytest.raises(ValueError, match="must divide"):
        make_mesh(model=3)
