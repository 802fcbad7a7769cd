"""The sharded forward on 8 fake CPU devices (2 x 4 mesh) equals the single-device forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dlmjax
from dlmjax.decoding.api import generate
from dlmjax.models.fused import split_gate_up, split_qkv
from dlmjax.sharding import ShardingRules, batch_sharding, make_mesh, unsplit_weights

pytestmark = pytest.mark.devices(8)


def tiny_model(tmp_path):
    cfg = dlmjax.ModelConfig(
        family="sdar", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, attention="block_causal", block_size=4, qk_norm=True, mask_token_id=63,
    )
    return dlmjax.export_model(dlmjax.init_model(cfg, seed=2), tmp_path / "ckpt")


def forward(model, tokens):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)(state, tokens)


def test_eight_devices_are_visible():
    assert len(jax.devices()) == 8, "tests/conftest.py must set the XLA flag before jax starts"


def test_sharded_forward_equals_single_device(tmp_path, caplog):
    path = tiny_model(tmp_path)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (4, 12)), jnp.int32)
    expected = forward(dlmjax.load_model(path), tokens)

    mesh = make_mesh(model=4, data=2)
    sharded = dlmjax.load_model(path, mesh=mesh)
    # what the mesh's model/expert axes leave unsplit is said, with the sizes that do not divide
    assert "leave these weights unsplit over them" in caplog.text
    assert "attention (2 KV heads, model=4)" in caplog.text and "attention output" not in caplog.text
    assert unsplit_weights(sharded.config, make_mesh(model=2, data=4)) == []
    moe = dlmjax.ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=8, attention="causal", qk_norm=True, num_experts=6,
                             num_experts_per_tok=2, moe_intermediate_size=16, moe_layers=(0, 1))
    assert unsplit_weights(moe, make_mesh(expert=4, model=2)) == [
        "routed experts (6 experts: model=2 never splits them; split them over expert=N or fsdp=N)",
        "experts (6 experts, expert=4)"]
    assert unsplit_weights(moe, make_mesh(expert=2, data=4)) == []
    # a dense model on an expert axis: every weight is copied there (it was said nowhere)
    assert unsplit_weights(sharded.config, make_mesh(expert=8)) == [
        "every weight (a dense model has no experts to split over expert=8: put those devices on data)"]
    qkv = sharded.layers[0].attn.qkv.kernel[...]
    assert qkv.sharding.spec == P(None, None)  # 2 KV groups do not split over 4: replicated
    assert sharded.layers[0].attn.o.kernel[...].sharding.spec == P("model", None)  # 4 heads over 4 devices
    assert sharded.embed[...].sharding.spec == P("model", None)
    tokens_sharded = jax.device_put(tokens, batch_sharding(mesh, 2))
    with jax.set_mesh(mesh):
        got = forward(sharded, tokens_sharded)
    assert got.sharding.spec[0] == "data"
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=0)


def test_invariant_mode_splits_its_row_tiles_over_data_and_keeps_every_row_bitwise(tmp_path):
    """The invariant mode's tile loops run on each device's own rows: a forward on 8 data-parallel
    devices comes out split over 'data', its compiled program gathers nothing, and every row's
    logits are bitwise one device's (a row's result never depends on its batch). Decoding over the
    mesh (no mesh context: the layers find it in the arrays) gives one device's tokens."""
    path = tiny_model(tmp_path)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (8, 12)), jnp.int32)
    mesh = make_mesh(data=8)
    sharded = dlmjax.load_model(path, mesh=mesh)
    placed = jax.device_put(tokens, batch_sharding(mesh, 2))
    prompts = [[5, 9, 13], [7, 2], [11, 3, 4, 8], [1], [6, 6], [10, 12, 14], [2, 3], [9]]
    with dlmjax.numerics(invariant=True):
        single = dlmjax.load_model(path)
        expected = forward(single, tokens)
        graphdef, state = nnx.split(sharded)
        run = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)
        with jax.set_mesh(mesh):
            got = run(state, placed)
            program = run.lower(state, placed).compile().as_text()
        one_device = generate(single, prompts, decoder="psd", max_new_tokens=8)
        on_mesh = generate(sharded, prompts, decoder="psd", max_new_tokens=8, mesh=mesh)
    assert got.sharding.spec[0] == "data"
    assert "all-gather" not in program and "all-reduce" not in program
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert [r.tokens for r in on_mesh.rows] == [r.tokens for r in one_device.rows]
    assert any(r.tokens for r in on_mesh.rows)


def test_invariant_mode_keeps_rows_bitwise_on_fsdp_meshes_and_batches_that_do_not_divide(tmp_path):
    """Every batch axis of the mesh ('fsdp' too) is split by hand, rows that do not divide over
    them padded: XLA, given an axis, would split the tiles' reductions by the batch's size. A
    row's logits are one device's whatever the batch and the mesh."""
    path = tiny_model(tmp_path)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (12, 12)), jnp.int32)
    with dlmjax.numerics(invariant=True):
        expected = np.asarray(forward(dlmjax.load_model(path), tokens))
        for axes in (dict(data=4, fsdp=2), dict(fsdp=8), dict(data=8)):
            mesh = make_mesh(**axes)
            graphdef, state = nnx.split(dlmjax.load_model(path, mesh=mesh))
            run = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)
            for batch in (1, 3, 4, 12):
                got = run(state, jax.device_put(tokens[:batch], batch_sharding(mesh, 2, rows=batch)))
                np.testing.assert_array_equal(np.asarray(got), expected[:batch], err_msg=f"{axes} batch {batch}")


def test_lossless_decoders_score_each_devices_rows_on_that_device(monkeypatch):
    """`generate(mesh=...)` traces its decode on the mesh: PSD's and mrp-spec's verification scores
    (row-wise over packed copies' logits, whose type names no mesh) run on each device's rows, so
    the compiled step gathers no logits [.., vocab] across devices."""
    from dlmjax.decoding import api, engine
    from dlmjax.evaluation.runner import replicate_on
    from dlmjax.presets import load_checkpoint

    mesh = make_mesh(data=8)
    programs = []
    decode = engine.decode

    def compiled_then_run(*args, **kwargs):
        programs.append(decode.lower(*args, **kwargs).compile().as_text())
        return decode(*args, **kwargs)

    monkeypatch.setattr(api.engine, "decode", compiled_then_run)
    prompts = [[15, 19, 13], [17, 12], [11, 13, 14, 18], [11], [16, 16], [10, 12, 14], [12, 13], [19]]
    with dlmjax.numerics(invariant=True):
        _, model, _, head = load_checkpoint("toy-sdar", mesh=mesh)
        model, head = replicate_on(model, mesh), replicate_on(head, mesh)
        vocab = model.config.vocab_size
        for decoder in ("psd", "mrp-spec"):
            generate(model, prompts, decoder=decoder, max_new_tokens=8, mesh=mesh, head=head)
            gathers = [line for line in programs.pop().splitlines() if " all-gather(" in line]
            assert not [g for g in gathers if f",{vocab}]" in g.split("all-gather(")[0]], decoder


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_invariant_mode_trains_on_a_mesh_as_on_one_device(tmp_path, family):
    """Gradients through the invariant mode's per-device tiles (the weights enter the shard_map as
    arguments, so their gradients are summed over the devices) equal one device's."""
    cfg = dlmjax.ModelConfig(family=family, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=8, attention="causal", qk_norm=True,
                             **(dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                                     moe_layers=(0, 1)) if family == "qwen3_moe" else {}))
    path = dlmjax.export_model(dlmjax.init_model(cfg, seed=4), tmp_path / "ckpt")
    tokens = jnp.asarray(np.random.RandomState(2).randint(0, 64, (8, 6)), jnp.int32)
    mesh = make_mesh(data=8)

    def gradients(model, tokens):
        graphdef, state = nnx.split(model, nnx.Param)
        loss = lambda s, t: jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, s)(t).logits) ** 2)
        return jax.jit(jax.grad(loss))(state, tokens)

    with dlmjax.numerics(invariant=True):
        expected = gradients(dlmjax.load_model(path), tokens)
        got = gradients(dlmjax.load_model(path, mesh=mesh), jax.device_put(tokens, batch_sharding(mesh, 2)))
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("model_axis", [2, 4])
def test_fused_projections_split_into_whole_kv_groups_and_gate_up_pairs(tmp_path, model_axis):
    """The fused qkv splits over 'model' into whole KV groups (their query heads, k and v) and
    gate_up into whole (gate, up) column pairs; the tensor-parallel logits equal one device's."""
    cfg = dlmjax.ModelConfig(
        family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=12, num_layers=2, num_heads=8,
        num_kv_heads=4, head_dim=4, attention="causal", qkv_bias=True,
    )
    path = dlmjax.export_model(dlmjax.init_model(cfg, seed=3), tmp_path / "ckpt")
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 64, (8, 10)), jnp.int32)
    single = dlmjax.load_model(path)
    expected = forward(single, tokens)

    mesh = make_mesh(model=model_axis)
    sharded = dlmjax.load_model(path, mesh=mesh)
    qkv, gate_up = sharded.layers[0].attn.qkv.kernel[...], sharded.layers[0].mlp.gate_up.kernel[...]
    assert qkv.sharding.spec == P(None, "model") and gate_up.sharding.spec == P(None, "model")
    assert sharded.layers[0].attn.qkv.bias[...].sharding.spec == P("model")
    full_q, full_k, full_v = split_qkv(np.asarray(single.layers[0].attn.qkv.kernel[...]), 4, 4)
    groups = 4 // model_axis  # KV groups per device
    first = next(s.data for s in qkv.addressable_shards if s.index[1].start in (0, None))
    q, k, v = split_qkv(np.asarray(first), groups, 4)  # device 0 holds groups 0..groups-1 whole
    np.testing.assert_array_equal(q, full_q[:, : groups * 2 * 4])
    np.testing.assert_array_equal(k, full_k[:, : groups * 4])
    np.testing.assert_array_equal(v, full_v[:, : groups * 4])
    full_gate, full_up = split_gate_up(np.asarray(single.layers[0].mlp.gate_up.kernel[...]))
    first = next(s.data for s in gate_up.addressable_shards if s.index[1].start in (0, None))
    gate, up = split_gate_up(np.asarray(first))  # device 0 holds columns 0..F/n-1 of both
    np.testing.assert_array_equal(gate, full_gate[:, : 12 // model_axis])
    np.testing.assert_array_equal(up, full_up[:, : 12 // model_axis])
    with jax.set_mesh(mesh):
        got = forward(sharded, jax.device_put(tokens, batch_sharding(mesh, 2)))
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
    for data in (0, -1):  # 0 used to mean every device, -1 failed inside jax
        with pytest.raises(ValueError, match=f"data={data}: the data axis needs at least one device"):
            make_mesh(data=data)
