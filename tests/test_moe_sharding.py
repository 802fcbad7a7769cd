"""Expert parallelism on 8 fake CPU devices: experts split over the 'expert' mesh axis give the
single-device logits and decoded tokens (expert=4 x data=2, and expert=8)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dlmjax
from dlmjax.decoding.api import generate
from dlmjax.sharding import batch_sharding, make_mesh

pytestmark = pytest.mark.devices(8)

VOCAB = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = dlmjax.ModelConfig(
        family="sdar_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, attention="block_causal", block_size=4, qk_norm=True, mask_token_id=VOCAB - 1,
        eos_token_ids=(VOCAB - 2,), pad_token_id=0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_layers=(0, 1), norm_topk_prob=True,
    )
    return dlmjax.export_model(dlmjax.init_model(cfg, seed=4), tmp_path_factory.mktemp("moe") / "ckpt")


def logits(model, tokens):
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)(state, tokens))


@pytest.mark.parametrize("expert, data", [(4, 2), (8, 1)])
def test_expert_parallel_logits_and_tokens_equal_one_device(checkpoint, expert, data):
    tokens = jnp.asarray(np.random.RandomState(0).randint(1, VOCAB - 2, (4, 12)), jnp.int32)
    prompts = [[5, 9, 11, 3, 7], [8, 2, 4, 6, 10, 12, 14], [3, 3, 5], [20, 21, 22, 23]]
    single = dlmjax.load_model(checkpoint)
    expected_logits = logits(single, tokens)
    expected_tokens = generate(single, prompts, decoder="threshold:tau=0.6", max_new_tokens=8)

    mesh = make_mesh(model=1, expert=expert, data=data)
    sharded = dlmjax.load_model(checkpoint, mesh=mesh)
    experts = sharded.layers[0].mlp.experts_gate_up[...]
    assert experts.sharding.spec == P("expert", None, None)
    assert experts.addressable_shards[0].data.shape[0] == 8 // expert, "each device holds its experts only"
    with jax.set_mesh(mesh):
        got = logits(sharded, jax.device_put(tokens, batch_sharding(mesh, 2)))
    np.testing.assert_allclose(got, expected_logits, atol=1e-5, rtol=0)
    decoded = generate(sharded, prompts, decoder="threshold:tau=0.6", max_new_tokens=8, mesh=mesh)
    assert [r.tokens for r in decoded.rows] == [r.tokens for r in expected_tokens.rows]
    assert any(r.tokens for r in decoded.rows)
