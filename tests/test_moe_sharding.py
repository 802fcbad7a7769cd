"""Expert parallelism on 8 fake CPU devices: experts split over the 'expert' mesh axis give the
single-device logits and decoded tokens (expert=4 x data=2, and expert=8), with tokens sent to
their experts all-to-all (`expert_dispatch="all_to_all"`), with the experts all-gathered
("gather"), and with XLA partitioning the layer ("xla"); dropless under any routing (experts that
get no token, every token on one device or one expert)."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import dlmjax
from dlmjax.decoding.api import generate
from dlmjax.models import moe
from dlmjax.sharding import batch_sharding, make_mesh

pytestmark = pytest.mark.devices(8)

VOCAB = 64
MESHES = [(4, 2), (8, 1)]  # (expert, data)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = dlmjax.ModelConfig(
        family="sdar_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, attention="block_causal", block_size=4, qk_norm=True, mask_token_id=VOCAB - 1,
        eos_token_ids=(VOCAB - 2,), pad_token_id=0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_layers=(0, 1), norm_topk_prob=True,
    )
    return dlmjax.export_model(dlmjax.init_model(cfg, seed=4), tmp_path_factory.mktemp("moe") / "ckpt")


@functools.cache
def logits_fn(graphdef):
    return jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens).logits)


def logits(model, tokens):
    """(logits, the lowered program's text): one compile per graphdef and input placement."""
    graphdef, state = nnx.split(model)
    fn = logits_fn(graphdef)
    return np.asarray(fn(state, tokens)), fn.lower(state, tokens).as_text()


def route_everything_to_experts_5_and_4(model, placement):
    """Every token's first choice becomes expert 5 and its second expert 4: one device of expert=4
    (two of expert=8) receives every assignment, the others none."""
    for layer in model.layers:
        router = np.asarray(layer.mlp.router[...]) * 0.01
        router[:, 5] += 3.0
        router[:, 4] += 2.0
        layer.mlp.router.set_value(jax.device_put(jnp.asarray(router), placement))


@pytest.mark.parametrize("expert, data", MESHES)
def test_all_to_all_logits_and_tokens_equal_one_device(checkpoint, expert, data):
    """Tokens sent to their experts all-to-all: the single-device logits (fp32, 1e-5) and decoded
    tokens (exact), with the checkpoint's routing, then with every token on experts 5 and 4."""
    tokens = jnp.asarray(np.random.RandomState(0).randint(1, VOCAB - 2, (4, 12)), jnp.int32)
    prompts = [[5, 9, 11, 3, 7], [8, 2, 4, 6, 10, 12, 14], [3, 3, 5], [20, 21, 22, 23]]
    mesh = make_mesh(model=1, expert=expert, data=data)
    single = dlmjax.load_model(checkpoint)
    sharded = moe.set_expert_dispatch(dlmjax.load_model(checkpoint, mesh=mesh), "all_to_all")
    experts = sharded.layers[0].mlp.experts_gate_up[...]
    assert experts.sharding.spec == P("expert", None, None)
    assert experts.addressable_shards[0].data.shape[0] == 8 // expert, "each device holds its experts only"
    placed = jax.device_put(tokens, batch_sharding(mesh, 2))
    for routing in ("checkpoint", "all on experts 5 and 4"):
        if routing != "checkpoint":
            route_everything_to_experts_5_and_4(single, None)
            route_everything_to_experts_5_and_4(sharded, NamedSharding(mesh, P()))
        expected_logits, _ = logits(single, tokens)
        with jax.set_mesh(mesh):
            got, program = logits(sharded, placed)
        assert "all_to_all" in program
        np.testing.assert_allclose(got, expected_logits, atol=1e-5, rtol=0, err_msg=routing)
        expected = generate(single, prompts, decoder="threshold:tau=0.6", max_new_tokens=8)
        # decoding runs without a mesh context: the layer finds the mesh in the experts' sharding
        decoded = generate(sharded, prompts, decoder="threshold:tau=0.6", max_new_tokens=8, mesh=mesh)
        assert [r.tokens for r in decoded.rows] == [r.tokens for r in expected.rows], routing
        assert any(r.tokens for r in decoded.rows)


def _layer_config(router="softmax", top_k=2):
    return dlmjax.ModelConfig(
        family="llada_moe" if router == "softmax" else "llada2_moe", vocab_size=16, hidden_size=32,
        intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=4, head_dim=8, attention="bidirectional",
        num_experts=8, num_experts_per_tok=top_k, moe_intermediate_size=16, moe_layers=(0,), router=router,
        norm_topk_prob=router != "softmax", router_expert_bias=router != "softmax",
        router_groups=2 if router != "softmax" else 1, router_topk_groups=1 if router != "softmax" else 1,
        routed_scaling_factor=2.5 if router != "softmax" else 1.0)


ROUTINGS = {
    "random": lambda r: r,
    "one_device": lambda r: r.at[:, 2].add(50.0).at[:, 3].add(40.0),  # every token on experts 2 and 3
}


@functools.cache
def layer_fn(cfg, dispatch):
    return jax.jit(lambda *args: moe.moe_forward(*args, cfg, dispatch=dispatch))


@pytest.mark.parametrize("expert, data", MESHES)
@pytest.mark.parametrize("case", ["random", "one_device", "one_expert_top1", "sigmoid"])
def test_layer_dispatch_paths_equal_one_device(expert, data, case):
    cfg = _layer_config("sigmoid" if case == "sigmoid" else "softmax", 1 if case == "one_expert_top1" else 2)
    rng = np.random.default_rng(0)
    d, e, f = 32, 8, 16
    router = jnp.asarray(rng.normal(size=(d, e)), jnp.float32)
    router = ROUTINGS.get(case, ROUTINGS["random"])(router)
    if case == "one_expert_top1":
        router = router.at[:, 6].add(50.0)
    bias = jnp.asarray(rng.normal(size=(e,)) * 0.1, jnp.float32) if case == "sigmoid" else None
    gate_up = jnp.asarray(rng.normal(size=(e, d, 2 * f)) * 0.2, jnp.float32)
    down = jnp.asarray(rng.normal(size=(e, f, d)) * 0.2, jnp.float32)
    x = jnp.asarray(rng.normal(size=(10, d)), jnp.float32)  # 10 tokens: 5 per data shard, padded to the split
    expected = np.asarray(layer_fn(cfg, "auto")(x, router, bias, gate_up, down))

    mesh = make_mesh(model=1, expert=expert, data=data)
    on_experts = NamedSharding(mesh, P("expert", None, None))
    args = (jax.device_put(x, NamedSharding(mesh, P("data", None))), router, bias,
            jax.device_put(gate_up, on_experts), jax.device_put(down, on_experts))
    for dispatch in ("all_to_all", "gather"):
        fn = layer_fn(cfg, dispatch)
        np.testing.assert_allclose(np.asarray(fn(*args)), expected, atol=1e-6, rtol=0, err_msg=f"{case} {dispatch}")
        program = fn.lower(*args).as_text()
        assert ("all_to_all" in program) == (dispatch == "all_to_all"), dispatch


def test_auto_moves_fewer_bytes_and_refuses_what_it_cannot_split():
    """"auto" sends tokens all-to-all for decode-sized slices and gathers experts for long prefills;
    a mesh without an expert axis (or experts that do not divide it) runs the layer locally."""
    cfg = _layer_config()
    mesh = make_mesh(model=1, expert=4, data=2).abstract_mesh
    assert moe.resolve_dispatch("auto", 8, cfg, mesh) == "all_to_all"
    assert moe.resolve_dispatch("auto", 1 << 16, cfg, mesh) == "gather"
    for tokens in (8, 1 << 16):
        moved = moe.dispatch_bytes(tokens, cfg, mesh)
        assert moe.resolve_dispatch("auto", tokens, cfg, mesh) == min(moved, key=moved.get)
    assert moe.resolve_dispatch("all_to_all", 8, cfg, make_mesh(model=1, data=8).abstract_mesh) == "local"
    assert moe.resolve_dispatch("auto", 8, cfg.replace(num_experts=6), mesh) == "local"
    with pytest.raises(ValueError, match="divide"):
        moe.resolve_dispatch("all_to_all", 8, cfg.replace(num_experts=6), mesh)
    with pytest.raises(ValueError, match="choose one of"):
        moe.resolve_dispatch("ragged", 8, cfg, mesh)


def test_all_to_all_batch_invariant_with_a_model_axis():
    """Batch-invariant numerics through the all-to-all (expert=2 x data=2 x model=2, tokens also
    split over 'model'): a token among 12 sharded ones is bitwise the same token alone on one device."""
    cfg = _layer_config()
    rng = np.random.default_rng(1)
    d, e, f = 32, 8, 16
    router = jnp.asarray(rng.normal(size=(d, e)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(e, d, 2 * f)) * 0.2, jnp.float32)
    down = jnp.asarray(rng.normal(size=(e, f, d)) * 0.2, jnp.float32)
    x = jnp.asarray(rng.normal(size=(12, d)), jnp.float32)
    mesh = make_mesh(model=2, expert=2, data=2)
    on_experts = NamedSharding(mesh, P("expert", None, None))
    with dlmjax.numerics(invariant=True):
        alone = np.asarray(jax.jit(lambda *a: moe.moe_forward(*a, cfg))(x[:1], router, None, gate_up, down))
        fn = jax.jit(lambda *a: moe.moe_forward(*a, cfg, dispatch="all_to_all"))
        args = (jax.device_put(x, NamedSharding(mesh, P("data", None))), router, None,
                jax.device_put(gate_up, on_experts), jax.device_put(down, on_experts))
        batch = np.asarray(fn(*args))
        assert "all_to_all" in fn.lower(*args).as_text()
    np.testing.assert_array_equal(batch[:1], alone)
    np.testing.assert_allclose(batch, np.asarray(moe.moe_forward(x, router, None, gate_up, down, cfg)), atol=1e-5)


def test_all_to_all_gradients_equal_one_device():
    """Training through the layer (heads on MoE backbones, fine-tuning): gradients with respect to
    tokens, router and experts through the all-to-all equal the one-device ones."""
    cfg = _layer_config()
    rng = np.random.default_rng(2)
    d, e, f = 32, 8, 16
    params = (jnp.asarray(rng.normal(size=(16, d)), jnp.float32), jnp.asarray(rng.normal(size=(d, e)), jnp.float32),
              jnp.asarray(rng.normal(size=(e, d, 2 * f)) * 0.2, jnp.float32),
              jnp.asarray(rng.normal(size=(e, f, d)) * 0.2, jnp.float32))

    def loss(x, router, gate_up, down, dispatch="auto"):
        return (moe.moe_forward(x, router, None, gate_up, down, cfg, dispatch=dispatch) ** 2).sum()

    expected = jax.grad(loss, argnums=(0, 1, 2, 3))(*params)
    mesh = make_mesh(model=1, expert=4, data=2)
    on_experts = NamedSharding(mesh, P("expert", None, None))
    placed = (jax.device_put(params[0], NamedSharding(mesh, P("data", None))), params[1],
              jax.device_put(params[2], on_experts), jax.device_put(params[3], on_experts))
    got = jax.jit(jax.grad(lambda *a: loss(*a, dispatch="all_to_all"), argnums=(0, 1, 2, 3)))(*placed)
    for name, g, want in zip(("x", "router", "gate_up", "down"), got, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), atol=1e-5, rtol=1e-5, err_msg=name)


def test_cli_expert_dispatch_on_an_expert_mesh_equals_one_device(tmp_path, monkeypatch, capsys):
    """`dlmjax generate --mesh expert=4,data=2 --expert-dispatch all_to_all|gather`: the tokens of
    one device; a mesh that does not fit and an unknown dispatch are refused in one line (exit 2)."""
    from dlmjax.cli import main

    monkeypatch.setenv("DLMJAX_CACHE", str(tmp_path))
    common = ["generate", "--model", "random-sdar-moe", "--prompt", "ab", "--prompt", "cd", "--max-new-tokens", "8",
              "--json"]

    def rows(*extra):
        assert main([*common, *extra]) == 0, capsys.readouterr().err
        return [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]

    single = rows("--mesh", "data=1")
    assert len(single) == 2
    for dispatch in ("all_to_all", "gather"):
        assert rows("--mesh", "expert=4,data=2", "--expert-dispatch", dispatch) == single
    assert main([*common, "--mesh", "expert=3,data=2", "--expert-dispatch", "gather"]) == 2
    assert ("--expert-dispatch gather would be ignored: the 8 experts do not divide over expert=3, so every device "
            "holds them all; choose --mesh expert=N with N dividing 8") in capsys.readouterr().err
    assert main([*common, "--mesh", "data=2", "--expert-dispatch", "all_to_all"]) == 2
    assert ("--expert-dispatch all_to_all would be ignored: without an expert axis every device holds all 8 experts "
            "and runs them locally; split them with --mesh expert=N") in capsys.readouterr().err
    dense = ["generate", "--model", "random-sdar", "--prompt", "ab", "--expert-dispatch", "xla"]
    assert main(dense) == 2
    assert "the model is dense, with no experts to dispatch to" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # argparse names the choices
        main([*common, "--expert-dispatch", "ragged"])
    assert exit_.value.code == 2
    assert "choose from 'auto', 'all_to_all', 'gather', 'xla'" in capsys.readouterr().err
