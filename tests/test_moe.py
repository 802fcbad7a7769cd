"""The dropless MoE layer (dlmjax.models.moe): routers, grouped experts == all experts, batch invariance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dlmjax
from dlmjax.config import ConfigError
from dlmjax.models import moe
from dlmjax.validation import InputError

E, D, F = 16, 24, 12


def expert_weights(seed=0, experts=E):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(experts, D, 2 * F)) * 0.3, jnp.float32),
            jnp.asarray(rng.normal(size=(experts, F, D)) * 0.3, jnp.float32))


def moe_config(**overrides):
    base = dict(family="qwen3", vocab_size=64, hidden_size=D, intermediate_size=32, num_layers=1, num_heads=2,
                num_kv_heads=2, head_dim=12, num_experts=E, num_experts_per_tok=4, moe_intermediate_size=F,
                moe_layers=(0,))
    return dlmjax.ModelConfig(**{**base, **overrides})


ROUTERS = {
    "softmax, renormalised": dict(router="softmax", norm_topk_prob=True),
    "softmax, raw (LLaDA-MoE)": dict(router="softmax", norm_topk_prob=False),
    "sigmoid, groups, bias, scale (LLaDA2)": dict(router="sigmoid", norm_topk_prob=True, router_groups=4,
                                                  router_topk_groups=2, router_expert_bias=True,
                                                  routed_scaling_factor=2.5),
}


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_grouped_experts_equal_all_experts(router, tokens):
    """3 tokens x 4 picks leave most of the 16 experts without a token; 37 tokens fill them unevenly.
    The router's columns 0 and 1 are equal, so every token sees a tie in its scores."""
    cfg = moe_config(**ROUTERS[router])
    rng = np.random.default_rng(tokens)
    router_de = rng.normal(size=(D, E)).astype(np.float32)
    router_de[:, 1] = router_de[:, 0]
    bias = jnp.asarray(rng.normal(size=E) * 0.1, jnp.float32) if cfg.router_expert_bias else None
    x = jnp.asarray(rng.normal(size=(tokens, D)), jnp.float32)
    gate_up, down = expert_weights()
    grouped = moe.moe_forward(x, jnp.asarray(router_de), bias, gate_up, down, cfg, "grouped")
    dense = moe.moe_forward(x, jnp.asarray(router_de), bias, gate_up, down, cfg, "dense")
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(dense), atol=2e-6, rtol=1e-5)
    _, experts = moe.route(cfg, x @ router_de, bias)
    used = set(np.asarray(experts).ravel().tolist())
    if tokens < 4:
        assert len(used) < E, "some expert must receive no token"


def kernel_rows_interpreted(*args):
    """`moe.kernel_rows` with the grouped_matmul kernel in Pallas interpret mode (CPU)."""
    with dlmjax.kernels.use("interpret"):
        return moe.kernel_rows(*args)


@pytest.mark.parametrize("rows_fn", [moe.tiled_rows, moe.ragged_rows, kernel_rows_interpreted],
                         ids=["tiled", "ragged", "kernel"])
@pytest.mark.parametrize("rows", [1, 9, 70, 300])
def test_grouped_rows_equal_each_row_through_its_own_expert(rows_fn, rows):
    """The grouped implementations against one row at a time: experts with no row, expert 2 with
    more rows than a tile (so its rows span tiles, the last one part empty), padding rows (id E)."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.normal(size=(rows, D)), jnp.float32)
    expert_m = rng.integers(0, E // 2, size=rows)
    expert_m[rng.random(rows) < 0.4] = 2
    expert_m[rng.random(rows) < 0.1] = E
    gate_up, down = expert_weights()
    y = rows_fn(x, jnp.asarray(expert_m, jnp.int32), gate_up, down)
    for row, expert in enumerate(expert_m):
        want = (np.zeros(D) if expert == E else
                moe.dense_expert_outputs(x[row:row + 1], jnp.asarray([[expert]], jnp.int32), gate_up, down)[0, 0])
        np.testing.assert_allclose(np.asarray(y[row]), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_tiled_rows_use_only_the_chosen_experts():
    """The CPU path computes a tile against its own expert only: experts no row chose may hold NaN."""
    gate_up, down = expert_weights()
    expert_m = jnp.asarray([5, 1, 5, 5, 9, 1], jnp.int32)
    unused = np.setdiff1d(np.arange(E), np.asarray(expert_m))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, D)), jnp.float32)
    poisoned = moe.tiled_rows(x, expert_m, gate_up.at[unused].set(jnp.nan), down.at[unused].set(jnp.nan))
    np.testing.assert_array_equal(np.asarray(poisoned), np.asarray(moe.tiled_rows(x, expert_m, gate_up, down)))


def test_dense_experts_in_chunks_equal_one_chunk(monkeypatch):
    """GPU's path: every expert on every token, in chunks of tokens (here 3 tokens a chunk, the last
    part padding) that hold its float32 intermediates to DENSE_CHUNK_BYTES, equals one chunk."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(11, D)), jnp.float32)
    experts_tk = jnp.asarray(rng.integers(0, E, size=(11, 4)), jnp.int32)
    gate_up, down = expert_weights()
    whole = moe.dense_expert_outputs(x, experts_tk, gate_up, down)
    monkeypatch.setattr(moe, "DENSE_CHUNK_BYTES", 3 * E * (gate_up.shape[2] + D) * 4)
    chunked = jax.jit(moe.dense_expert_outputs)(x, experts_tk, gate_up, down)
    assert "while" in jax.jit(moe.dense_expert_outputs).lower(x, experts_tk, gate_up, down).as_text()
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), atol=2e-6, rtol=1e-5)
    to_bf16 = lambda a: a.astype(jnp.bfloat16)  # noqa: E731  a bf16 model's experts run on CPU too
    bf16 = jax.jit(moe.dense_expert_outputs)(to_bf16(x), experts_tk, to_bf16(gate_up), to_bf16(down))
    np.testing.assert_allclose(np.asarray(bf16, np.float32), np.asarray(whole), atol=0.1, rtol=0.05)


@pytest.mark.usefixtures("kernel_numerics")  # the fast numerics, where the kernel may run
def test_auto_runs_experts_grouped_on_cpu_and_tpu_and_dense_on_gpu(monkeypatch):
    """XLA's GPU backend rewrites ragged_dot into every row against every expert (k times dense's
    FLOPs): "auto" runs dense there, unless the grouped_matmul kernel runs the rows; where it is
    asked for but refused, dense, not ragged_dot. Unknown names are refused, by the setter too."""
    gate_up, down = expert_weights()
    shapes = (64, jnp.float32, gate_up, down)  # 64 assignment rows
    assert moe.resolve_implementation("auto", *shapes) == "grouped"  # this CPU
    for backend, want in (("gpu", "dense"), ("tpu", "grouped"), ("cpu", "grouped")):
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        assert moe.resolve_implementation("auto", *shapes) == want
        assert moe.resolve_implementation("grouped", *shapes) == "grouped"
        with dlmjax.kernels.use("interpret"):  # the kernel runs: grouped, through it
            assert moe.resolve_implementation("auto", *shapes) == "grouped"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with dlmjax.kernels.use("on"):  # asked for on "gpu", but widths 24 -> 24 are refused (and this CPU
        assert moe.resolve_implementation("auto", *shapes) == "dense"  # compiles no Triton): dense
    with dlmjax.kernels.use("interpret"), dlmjax.numerics(invariant=True):  # kernels keep out of the invariant
        assert moe.resolve_implementation("auto", *shapes) == "dense"  # numerics: dense on "gpu"
    with pytest.raises(InputError, match="choose one of auto, grouped, dense"):
        moe.resolve_implementation("ragged", *shapes)
    layer = moe.MoE(moe_config(), shared=None, rngs=nnx.Rngs(0))
    assert layer.implementation == "auto"
    assert moe.set_expert_implementation(layer, "dense") is layer and layer.implementation == "dense"
    with pytest.raises(InputError, match="expert implementation 'fast'"):
        moe.set_expert_implementation(layer, "fast")


def test_dense_chunks_keep_tokens_split_over_devices_and_bound_the_backward_pass(monkeypatch):
    """Chunk c takes tokens c, c + n, ...: with the tokens split over 8 devices (data parallel), the
    compiled chunked path gathers no tokens and leaves the output split (each device computes its
    own tokens). Under grad each chunk's intermediates are recomputed, not all held at once."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    gate_up, down = expert_weights()
    rng = np.random.default_rng(0)
    chunk = 16
    monkeypatch.setattr(moe, "DENSE_CHUNK_BYTES", chunk * E * (gate_up.shape[2] + D) * 4)
    x = jnp.asarray(rng.normal(size=(200, D)), jnp.float32)
    experts_tk = jnp.asarray(rng.integers(0, E, (200, 4)), jnp.int32)
    if len(jax.devices()) >= 8:
        split = NamedSharding(Mesh(np.array(jax.devices()[:8]), ("data",)), P("data", None))
        xs, es = jax.device_put(x, split), jax.device_put(experts_tk, split)
        compiled = jax.jit(moe.dense_expert_outputs).lower(xs, es, gate_up, down).compile()
        assert "all-gather" not in compiled.as_text()
        assert compiled.output_shardings.spec[0] == "data"
        np.testing.assert_allclose(np.asarray(compiled(xs, es, gate_up, down)),
                                   np.asarray(moe._every_expert(x, experts_tk, gate_up, down)), atol=2e-6, rtol=1e-5)

    def temp_bytes(fn):
        loss = lambda x: jnp.sum(fn(x, experts_tk, gate_up, down))  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(x).compile().memory_analysis().temp_size_in_bytes

    whole = temp_bytes(moe._every_expert)
    assert temp_bytes(moe.dense_expert_outputs) < whole / 2, "the backward pass holds every chunk's intermediates"


def test_router_ties_go_to_the_lower_expert_and_routing_is_per_token():
    cfg = moe_config(router="softmax", num_experts_per_tok=2)
    logits = jnp.zeros((3, E)).at[:, 5].set(1.0).at[:, 9].set(1.0).at[1, 2].set(1.0)
    weights, experts = moe.route(cfg, logits)
    assert np.asarray(experts).tolist() == [[5, 9], [2, 5], [5, 9]]
    np.testing.assert_allclose(np.asarray(weights[0, 0]), np.asarray(weights[0, 1]))


def test_grouped_experts_weight_each_assignment_by_its_own_expert():
    """One token, an expert that maps x to 0 and one that does not: the weights land on the right one."""
    gate_up, down = expert_weights()
    down = down.at[3].set(0.0)
    x = jnp.ones((1, D))
    y = moe.grouped_expert_outputs(x, jnp.asarray([[3, 7]], jnp.int32), gate_up, down)
    assert np.all(np.asarray(y[0, 0]) == 0) and np.abs(np.asarray(y[0, 1])).max() > 0


def test_sigmoid_router_equals_transformers_deepseek_v3():
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    for norm in (True, False):
        hf_cfg = DeepseekV3Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=4, n_group=4, topk_group=2,
                                  routed_scaling_factor=2.5, norm_topk_prob=norm)
        router = DeepseekV3TopkRouter(hf_cfg)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            router.weight.copy_(torch.randn(E, D, generator=gen))
            router.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.1)
        x = torch.randn(50, D, generator=gen)
        _, hf_weights, hf_experts = router(x)
        cfg = moe_config(router="sigmoid", norm_topk_prob=norm, router_groups=4, router_topk_groups=2,
                         router_expert_bias=True, routed_scaling_factor=2.5)
        logits = jnp.asarray(x.numpy()) @ jnp.asarray(router.weight.detach().numpy().T)
        weights, experts = moe.route(cfg, logits, jnp.asarray(router.e_score_correction_bias.numpy()))
        hf_experts, hf_weights = hf_experts.numpy(), hf_weights.detach().numpy()
        order = np.argsort(hf_experts, axis=1)  # transformers returns the top-k unsorted
        ours = np.argsort(np.asarray(experts), axis=1)
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), ours, 1),
                                      np.take_along_axis(hf_experts, order, 1))
        np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), ours, 1),
                                   np.take_along_axis(hf_weights, order, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, message", [
    (dict(num_experts_per_tok=17), "cannot pick more experts"),
    (dict(moe_layers=(3,)), "distinct layer indices"),
    (dict(router_groups=3, router="sigmoid"), "equal groups"),
    (dict(router_groups=4, router="softmax"), "sigmoid router"),
    (dict(router_expert_bias=True), "sigmoid"),
])
def test_bad_moe_configs_name_the_problem(bad, message):
    with pytest.raises(ConfigError, match=message):
        moe_config(**bad)


# ----------------------------------------------------------------------------------------------
# Batch invariance: a row alone == in a batch of 7 == as a packed PSD copy


def moe_block_model():
    """The layouts() model of test_numerics with MoE layers: 8 experts, top-2, a shared expert."""
    from test_numerics import BLOCK, VOCAB

    cfg = dlmjax.ModelConfig(
        family="sdar", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, attention="block_causal", block_size=BLOCK, qk_norm=True,
        mask_token_id=VOCAB - 1, eos_token_ids=(VOCAB - 2,), pad_token_id=0, max_position_embeddings=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        moe_layers=(0, 1), norm_topk_prob=True,
    )
    return dlmjax.init_model(cfg, seed=5)


def moe_layouts(model):
    """Row 0's block logits alone, in a batch of 7 and as copy 3 of 4 packed copies (PSD verification)."""
    from test_numerics import BLOCK, PROMPT_LEN, VOCAB, block_logits

    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(1, VOCAB - 2, (7, PROMPT_LEN)), jnp.int32)
    copies = jnp.asarray(rng.integers(1, VOCAB - 2, (7, 4, BLOCK)), jnp.int32)
    return {
        "alone": block_logits(model, prompts[:1], copies[:1, 2:3])[0, 0],
        "batch 7": block_logits(model, prompts, copies[:, 2:3])[0, 0],
        "copy 3 of 4": block_logits(model, prompts[:1], copies[:1])[0, 2],
    }


def test_moe_row_is_bitwise_the_same_alone_in_a_batch_and_as_a_packed_copy():
    """Dropless routing depends on the row only; in the invariant mode the experts also run at one
    shape. (The fast mode differs here by ~2e-7 between these layouts, so this can fail.)"""
    model = moe_block_model()
    with dlmjax.numerics(invariant=True):
        logits = moe_layouts(model)
    for layout, value in logits.items():
        np.testing.assert_array_equal(value, logits["alone"], err_msg=f"{layout} differs from the row alone")


def test_a_bf16_softmax_router_scores_the_gates_bf16_logits_as_transformers_does():
    """transformers' Qwen3-MoE (and LLaDA-MoE's, SDAR's code) run the gate Linear in the model's
    dtype and take the softmax in float32. In bf16 the chosen experts then equal theirs except
    where two experts tie at the k-th place (torch.topk leaves the order of ties open). Scoring the
    logits in float32 instead picks other experts where there is no tie, which fails this test."""
    import jax
    import torch

    t, d, e, k = 1024, 512, 64, 8
    rng = np.random.default_rng(0)
    h = torch.from_numpy(rng.standard_normal((t, d)).astype(np.float32)).to(torch.bfloat16)
    w = torch.from_numpy((rng.standard_normal((e, d)) * 0.02).astype(np.float32)).to(torch.bfloat16)
    probs = torch.softmax(torch.nn.functional.linear(h, w), dim=-1, dtype=torch.float)
    want = np.sort(torch.topk(probs, k, dim=-1).indices.numpy(), axis=-1)
    cfg = moe_config(num_experts=e, num_experts_per_tok=k, hidden_size=d, dtype="bfloat16")
    logits = moe.router_logits(jnp.asarray(h.float().numpy(), jnp.bfloat16),
                               jnp.asarray(w.float().numpy().T, jnp.bfloat16), cfg)
    _, experts = moe.route(cfg, logits)
    differs = ~np.all(np.sort(np.asarray(experts), axis=-1) == want, axis=-1)
    ranked = -np.sort(-np.asarray(jax.nn.softmax(logits.astype(jnp.float32), axis=-1)), axis=-1)
    tied_at_k = ranked[:, k - 1] == ranked[:, k]
    assert differs.any() and not (differs & ~tied_at_k).any()
