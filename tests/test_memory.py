"""The per-device memory estimate (dlmjax.memory) against the bytes that placed arrays actually hold
on 8 fake CPU devices, fsdp placement (dlmjax.sharding), and refusing a run that cannot fit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from dlmjax.cli import main as cli_main
from dlmjax.config import ModelConfig
from dlmjax.memory import (
    GiB, MiB, MemoryEstimate, check_fits, kv_cache_bytes, parse_memory, placed_bytes, training_activation_bytes,
    tree_bytes,
)
from dlmjax.models.transformer import KVCache, init_model
from dlmjax.sharding import make_mesh, parse_mesh, placement, put_array, with_fsdp
from dlmjax.train.config import RunConfigError, load_run_config
from dlmjax.train.loop import train
from dlmjax.validation import InputError

pytestmark = pytest.mark.devices(8)

DENSE = ModelConfig(family="sdar", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, attention="block_causal", block_size=4, qk_norm=True)
MOE = ModelConfig(family="sdar_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, attention="block_causal", block_size=4, qk_norm=True, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=16, moe_layers=(0, 1), norm_topk_prob=True)
MESHES = ["data=8", "data=2,model=4", "data=2,fsdp=2,model=2", "fsdp=8", "fsdp=4,expert=2", "data=2,expert=4"]


def _place(state, shardings):
    return jax.tree.map(lambda x, s: put_array(np.asarray(x), s), state, shardings)


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("spec", MESHES)
def test_estimate_equals_the_bytes_placed_arrays_hold(cfg, spec):
    mesh = parse_mesh(spec)
    _, state = nnx.split(init_model(cfg, seed=0))
    shardings = placement(state, mesh, cfg)
    placed = _place(state, shardings)
    held = placed_bytes(placed)
    assert len(held) == 8 and len(set(held.values())) == 1  # every device holds the same share
    assert tree_bytes(state, shardings) == held[jax.devices()[0]]
    # the optimiser's moments placed as their params: estimated as they are held
    tx = optax.adamw(1e-3)
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, state), shardings,
                                   transform_non_params=lambda _: NamedSharding(mesh, P()))
    opt = jax.jit(tx.init, out_shardings=opt_sh)(placed)
    assert tree_bytes(jax.eval_shape(tx.init, state), opt_sh) == max(placed_bytes(opt).values())
    whole = tree_bytes(state, None)
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    if sizes["fsdp"] > 1 or sizes["model"] > 1:
        assert held[jax.devices()[0]] < whole  # split, not replicated
    if cfg.num_experts and sizes["expert"] > 1:  # MoE experts counted as placed over 'expert'
        experts = placed.layers[0].mlp.experts_gate_up[...]
        assert experts.addressable_shards[0].data.shape[0] == cfg.num_experts // sizes["expert"]


def test_fsdp_splits_each_params_largest_free_dimension():
    sizes = {"data": 1, "fsdp": 4, "expert": 1, "model": 2}
    assert with_fsdp(P(None, "model"), (32, 64), sizes) == P("fsdp", "model")  # dim 1 already on model
    assert with_fsdp(P(None, None), (32, 64), sizes) == P(None, "fsdp")  # the largest
    assert with_fsdp(P(None, None), (6, 10), sizes) == P(None, None)  # nothing divides by 4
    assert with_fsdp(P(None, None), (32, 64), {**sizes, "fsdp": 1}) == P(None, None)
    mesh = make_mesh(fsdp=4, model=2)
    _, state = nnx.split(init_model(DENSE, seed=0))
    sh = placement(state, mesh, DENSE)
    assert sh["layers"][0]["mlp"]["down"]["kernel"].spec == P("model", "fsdp")  # [mlp 64, embed 32]
    assert sh["embed"].spec == P("model", "fsdp")
    assert placement(state, mesh)["embed"].spec == P()  # a head: replicated (data parallel)


def test_batch_splits_over_data_and_fsdp():
    mesh = make_mesh(data=2, fsdp=2, model=2)
    from dlmjax.sharding import batch_sharding, data_parallel_size, shard_batch

    assert data_parallel_size(mesh) == 4
    assert batch_sharding(mesh, 2).spec == P(("data", "fsdp"), None)
    assert batch_sharding(mesh, 2, rows=6).spec == P("data", None)  # 6 rows do not split 4 ways
    tokens = shard_batch(np.zeros((8, 5), np.int32), mesh)
    assert tokens.addressable_shards[0].data.shape == (2, 5)
    assert batch_sharding(make_mesh(data=8), 2).spec == P("data", None)  # as before fsdp existed


def test_the_fsdp_gather_is_the_largest_layers_and_moe_configs_name_their_expert_layers():
    """An MoE model whose first layer is dense (LLaDA2's first_k_dense_replace) gathers its expert
    layers, not layer 0; experts without moe_layers (a dense model in disguise) are refused, and a
    run config's YAML list is the tuple ModelConfig takes."""
    from dlmjax.config import ConfigError
    from dlmjax.memory import largest_layer

    mesh = make_mesh(fsdp=8)
    cfg = MOE.replace(moe_layers=(1,), num_experts=16)
    _, state = nnx.split(init_model(cfg, seed=0))
    sh = placement(state, mesh, cfg)
    per_layer = {i: tree_bytes(state["layers"][i], sh["layers"][i]) for i in range(cfg.num_layers)}
    assert per_layer[1] > per_layer[0] and tree_bytes(*largest_layer(state, sh)) == per_layer[1]
    with pytest.raises(ConfigError, match="num_experts=8 with no moe_layers would build a dense model"):
        MOE.replace(moe_layers=())
    from dlmjax.train.config import backbone_config

    run = load_run_config("configs/toy-sdar-scratch.yaml", [
        "model.family=sdar_moe", "model.num_experts=4", "model.num_experts_per_tok=2",
        "model.moe_intermediate_size=16", "model.moe_layers=[1, 2]"])
    assert backbone_config(run.model, {"vocab_size": 64, "mask": 3, "eos": 2, "pad": 0}).moe_layers == (1, 2)


def test_a_mesh_on_part_of_the_devices_is_named_and_refused_across_processes(monkeypatch, caplog):
    """One process: the mesh may take some of its devices (it says so). Several: every process must
    hold part of the mesh, or one fails and the others wait in a collective for ever."""
    with caplog.at_level("WARNING", logger="dlmjax.sharding"):
        assert dict(parse_mesh("data=2,model=3").shape) == {"data": 2, "fsdp": 1, "expert": 1, "model": 3}
    assert "uses 6 of the 8 devices" in caplog.text
    with pytest.raises(InputError, match="must divide the number of devices"):
        parse_mesh("model=3")  # data left out: it would fill the devices the others leave
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(InputError, match="uses 4 of the 8 devices of 2 processes; every process must hold part"):
        parse_mesh("data=2,model=2")
    assert dict(parse_mesh("data=4,model=2").shape)["data"] == 4


def test_kv_cache_estimate_equals_the_cache():
    cache = KVCache.init(DENSE, 3, 40)
    assert kv_cache_bytes(DENSE, rows=3, length=40) == sum(a.nbytes for a in cache.k + cache.v)
    assert kv_cache_bytes(DENSE, rows=3, length=40, model=2) == kv_cache_bytes(DENSE, rows=3, length=40) // 2


def test_activations_scale_with_rows_and_model_split():
    one = training_activation_bytes("block_diffusion", DENSE, rows=1, seq_len=32)
    assert training_activation_bytes("block_diffusion", DENSE, rows=4, seq_len=32) == 4 * one
    assert training_activation_bytes("block_diffusion", DENSE, rows=1, seq_len=32, model=2) < one
    assert training_activation_bytes("mrp", DENSE, rows=1, seq_len=32, head_layers=1) > 0
    assert training_activation_bytes("tspd", None, rows=1, seq_len=32) == 0


def test_the_dense_layers_of_an_moe_model_are_estimated_as_dense():
    """LLaDA2's first layer is dense: it keeps no expert tiles (every layer was counted as MoE)."""
    mixed = MOE.replace(num_layers=2, moe_layers=(1,))
    all_moe, dense = mixed.replace(moe_layers=(0, 1)), mixed.replace(num_experts=0, moe_layers=())
    estimate = {name: training_activation_bytes("block_diffusion", cfg, rows=2, seq_len=16)
                for name, cfg in (("mixed", mixed), ("all_moe", all_moe), ("dense", dense))}
    assert estimate["dense"] < estimate["mixed"] < estimate["all_moe"]
    assert 2 * estimate["mixed"] == estimate["all_moe"] + estimate["dense"]  # one layer of each


@pytest.mark.parametrize("base", [DENSE, MOE], ids=["dense", "moe"])
def test_activation_estimate_is_the_size_xla_allocates(base):
    """Between 1/2 and 3 times the temporary buffers XLA plans for the block-diffusion loss's
    gradient (the invariant mode's tiles need the most: 0.58x). A trained MoE layer's backward also
    keeps its tiles' expert weights and their gradients: counting only the chosen experts' rows
    was 0.36-0.53x of a whole MoE train step's buffers on CPU, 0.77-1.17x with them."""
    from dlmjax.train.objectives import block_diffusion_loss

    cfg = base.replace(num_layers=2, vocab_size=512)
    model = init_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    rows, seq = 8, 32
    batch = {"tokens": jnp.zeros((rows, seq), jnp.int32), "valid": jnp.ones((rows, seq), bool),
             "target": jnp.ones((rows, seq), bool)}

    def loss(s):
        return block_diffusion_loss(nnx.merge(graphdef, s), batch, jax.random.key(0), block=4, mask_id=1)[0]

    temp = jax.jit(jax.grad(loss)).lower(state).compile().memory_analysis().temp_size_in_bytes
    estimate = training_activation_bytes("block_diffusion", cfg, rows=rows, seq_len=seq)
    assert temp / 2 <= estimate <= 3 * temp, (estimate, temp)


@pytest.mark.parametrize("chain_steps", [1, 3])
def test_mrp_activation_estimate_at_a_vocabulary_where_logits_dominate(chain_steps):
    """The MRP loss makes logits for the noisy half only, and XLA does not keep each chain step's:
    counting them over both halves and per step put a realistic-vocabulary run at 2-3.4x what XLA
    allocates (and refused runs that fit). Within 2.5x of the loss gradient's temporaries here
    (XLA needs more in the whole train step: at vocab 152k the estimate was 0.87-1.0x of it)."""
    from dlmjax.heads.mrp import init_head
    from dlmjax.train.mrp import mrp_loss

    cfg = DENSE.replace(num_layers=1, vocab_size=8192)
    model, head = init_model(cfg, seed=0), init_head(cfg.replace(dtype="float32"), num_layers=1)
    head_graphdef, head_state = nnx.split(head)
    rows, seq = 4, 64
    batch = {"tokens": jnp.zeros((rows, seq), jnp.int32), "valid": jnp.ones((rows, seq), bool),
             "target": jnp.ones((rows, seq), bool)}

    def loss(s):
        return mrp_loss(nnx.merge(head_graphdef, s), model, batch, jax.random.key(0), block=4, mask_id=1,
                        chain_steps=chain_steps)[0]

    temp = jax.jit(jax.grad(loss)).lower(head_state).compile().memory_analysis().temp_size_in_bytes
    estimate = training_activation_bytes("mrp", cfg, rows=rows, seq_len=seq, head_layers=1, chain_steps=chain_steps)
    assert temp / 2 <= estimate <= 2.5 * temp, (estimate, temp)


@pytest.mark.usefixtures("kernel_numerics")
@pytest.mark.parametrize("mesh_spec,layers", [("data=1", 2), ("fsdp=8", 2), ("fsdp=8", 8), ("data=2,fsdp=4", 8),
                                             ("fsdp=2,model=4", 8)])
def test_a_train_step_whose_parameters_dominate_is_not_under_estimated(mesh_spec, layers):
    """A backbone trained whole on one short row per device: XLA's buffers for the real train step
    (arguments plus temporaries; outputs alias the donated arguments) are mostly params, moments,
    gradients and the update. The estimate without the gradients and the update was a third short;
    under fsdp, counting one layer gathered, 2-2.6x short (XLA keeps every layer's gathered weights
    for the backward, and the gradients whole until their reduce-scatter). (The estimate is for
    the default numerics; the invariant mode's tiles need more, README's memory section.)"""
    from dlmjax.memory import training_estimate
    from dlmjax.train.loop import make_train_step
    from dlmjax.train.objectives import block_diffusion_loss

    cfg = DENSE.replace(hidden_size=256, intermediate_size=1024, head_dim=64, vocab_size=512, num_layers=layers)
    graphdef, params = nnx.split(init_model(cfg, seed=0))
    tx = optax.adamw(1e-3)
    mesh = parse_mesh(mesh_spec)
    param_sh = placement(params, mesh, cfg)
    opt_sh = optax.tree_map_params(tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, params), param_sh,
                                   transform_non_params=lambda _: NamedSharding(mesh, P()))
    params = jax.device_put(params, param_sh)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    rows, seq = mesh.shape["data"] * mesh.shape["fsdp"], 16  # one row per data-parallel device
    rows_sh = NamedSharding(mesh, P(("data", "fsdp"), None))
    batch = {"tokens": jnp.zeros((rows, seq), jnp.int32), "valid": jnp.ones((rows, seq), bool),
             "target": jnp.ones((rows, seq), bool)}
    batch = jax.device_put(batch, rows_sh)

    def loss(model, frozen, batch, key):
        return block_diffusion_loss(model, batch, key, block=4, mask_id=1)

    step = make_train_step(graphdef, None, loss, tx, lambda s: 1e-3)
    with jax.set_mesh(mesh):
        analysis = step.lower(params, opt_state, None, batch, jax.random.key(0), 0).compile().memory_analysis()
    needed = analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
    run = load_run_config("configs/toy-sdar.yaml", [f"train.batch_size={rows}", f"data.seq_len={seq}"])
    estimate = training_estimate(run, cfg, mesh, trained=params, trained_shardings=param_sh, opt=opt_state,
                                 opt_shardings=opt_sh)
    if mesh.shape["fsdp"] == 1:
        assert estimate.gradients == 2 * estimate.trained_params and estimate.fsdp_gather == 0
    else:  # every weight gathered whole once, for the backward; the gradients whole, then the update
        whole = estimate.trained_params * mesh.shape["fsdp"]
        assert estimate.fsdp_gather == whole and estimate.gradients == whole + estimate.trained_params
    print(f"{mesh_spec}, {layers} layers: estimate / XLA = {estimate.total / needed:.2f}")  # the README's figures
    assert needed * 0.9 <= estimate.total <= needed * 2, (mesh_spec, layers, estimate, analysis)


def test_a_multi_process_runs_whole_copies_are_counted():
    """Across processes the frozen backbone also loads whole on each process's first device
    (train.loop.frozen_mesh: process 0 evaluates alone), and the trained params are gathered
    whole there for evaluation and export; the estimate counts both."""
    from dlmjax.memory import training_estimate

    mesh = make_mesh(model=2, fsdp=4)
    _, frozen = nnx.split(init_model(DENSE, seed=0))
    frozen_sh = placement(frozen, mesh, DENSE)
    run = load_run_config("configs/mrp/toy-sdar.yaml", ["train.batch_size=8"])
    head = {"w": jnp.zeros((32, 64))}
    kw = dict(frozen=frozen, frozen_shardings=frozen_sh, trained=head, trained_shardings=NamedSharding(mesh, P()),
              opt={}, opt_shardings={})
    one, several = (training_estimate(run, DENSE, mesh, whole_copies=copies, **kw) for copies in (False, True))
    whole = tree_bytes(frozen, None) + 32 * 64 * 4
    assert one.whole_copies == 0 and several.whole_copies == whole > 4 * several.frozen_params
    assert several.total == one.total + whole and "whole copies (eval)" in str(several)


def test_parse_memory_and_refusal():
    assert parse_memory("16GiB") == 16 * GiB and parse_memory("512 MiB") == 512 * MiB and parse_memory(2) == 2 * GiB
    for bad in ("lots", "-1GB", "16 parsecs", 0):
        with pytest.raises(InputError, match="16GiB"):
            parse_memory(bad)
    estimate = MemoryEstimate(frozen_params=3 * GiB, activations=2 * GiB, mesh="data=8", rows_per_device=4,
                              seq_len=512)
    check_fits(estimate, None, fix="")  # no capacity known (CPU): nothing refused
    check_fits(estimate, 8 * GiB, fix="")
    with pytest.raises(InputError, match=r"5.00 GiB per device against 4.00 GiB.*activations 2.00 GiB.*smaller batch"
                       ) as refused:
        check_fits(estimate, 4 * GiB, fix="fix: a smaller batch")
    assert "\n" not in str(refused.value)  # one line, as every refusal of the CLI


MRP_RUN = ["backbone=random-sdar", "train.steps=1", "train.batch_size=8", "train.eval_every=0", "mrp.num_layers=1",
           "data.seq_len=64", "data.tasks={toy-arith: 1}"]


def test_a_run_that_cannot_fit_is_refused_before_it_starts(tmp_path, capsys, monkeypatch):
    """A frozen backbone that cannot fit is refused from its config's shapes, before it is read
    and placed (loading it first would end in the device's out-of-memory error instead); a run
    without one, with the trained state counted."""
    from dlmjax.train import loop

    def no_load(*args, **kwargs):
        raise AssertionError("the backbone was loaded before the refusal")

    run = load_run_config("configs/mrp/toy-sdar.yaml", MRP_RUN + ["mesh.fsdp=2", "mesh.model=2",
                                                                    "mesh.device_memory=1MiB"])
    with monkeypatch.context() as patch:
        patch.setattr(loop, "load_model", no_load)
        with pytest.raises(InputError, match=r"(?s)does not fit.*frozen params.*activations"
                                             r".*train.batch_size \(now 8\).*--mesh data=1,fsdp=4,model=2"):
            train(run, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    backbone = load_run_config("configs/toy-sdar.yaml", ["train.steps=1", "mesh.device_memory=1MiB"])
    with pytest.raises(InputError, match=r"(?s)does not fit.*trained params.*optimizer state.*gradients.*activations"):
        train(backbone, tmp_path / "backbone", progress=False)
    # the same from the command line: one line of error, exit 2
    capsys.readouterr()
    code = cli_main(["train", "configs/mrp/toy-sdar.yaml", *MRP_RUN, "--out", str(tmp_path / "cli"),
                     "--mesh", "data=2,fsdp=2,model=2", "--device-memory", "1MiB", "--no-progress"])
    assert code == 2
    out, err = capsys.readouterr()
    assert err.startswith("dlmjax train: error: this run does not fit") and err.count("\n") == 1
    assert "mesh data=2,fsdp=2,model=2" in err and "memory per device" in out  # the table on stdout first


def test_the_refusal_suggests_only_meshes_of_the_devices_the_run_has():
    """With data=1 (one GPU, or every device on model) there is no data-parallel half to move to
    fsdp: the example mesh it used to give needed twice the devices."""
    from dlmjax.memory import training_fix

    run = load_run_config("configs/mrp/toy-sdar.yaml", MRP_RUN)
    assert "e.g. --mesh data=1,fsdp=2,model=4" in training_fix(run, make_mesh(data=2, model=4))
    assert "e.g. --mesh data=1,fsdp=3,model=2" in training_fix(run, make_mesh(data=3, model=2, devices=jax.devices()[:6]))  # 6 devices still
    for mesh in (make_mesh(data=1), make_mesh(data=1, model=8)):
        fix = training_fix(run, mesh)
        assert "e.g. --mesh" not in fix and "train.batch_size (now 8)" in fix and "more devices" in fix


def test_mesh_section_errors(tmp_path, capsys):
    with pytest.raises(RunConfigError, match="mesh.fsdp"):
        load_run_config("configs/mrp/toy-sdar.yaml", ["mesh.fsdp=0"])
    with pytest.raises(RunConfigError, match="unknown mesh keys"):
        load_run_config("configs/mrp/toy-sdar.yaml", ["mesh.tensor=2"])
    with pytest.raises(RunConfigError, match="device_memory"):
        load_run_config("configs/mrp/toy-sdar.yaml", ["mesh.device_memory=lots"])
    with pytest.raises(RunConfigError, match="must divide"):
        load_run_config("configs/mrp/toy-sdar.yaml", ["mesh.model=3"]).mesh.make()
    assert cli_main(["train", "configs/mrp/toy-sdar.yaml", "--out", str(tmp_path / "x"), "--mesh", "tensor=2"]) == 2
    # --mesh replaces the mesh's axes: an axis also set by an override is refused, not silently dropped
    assert cli_main(["train", "configs/mrp/toy-sdar.yaml", "mesh.data=2", "--out", str(tmp_path / "x"),
                     "--mesh", "model=2"]) == 2
    assert "--mesh model=2 and the override mesh.data= both set the mesh's axes" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_mrp_head_trains_on_a_sharded_backbone_as_on_one_device(tmp_path, capsys):
    """The frozen backbone tensor-parallel and fsdp (data=2, fsdp=2, model=2), the head replicated:
    the same losses as the default mesh (all devices on data); the estimate is printed first."""
    base = load_run_config("configs/mrp/toy-sdar.yaml", MRP_RUN + ["train.log_every=1"])
    sharded = load_run_config("configs/mrp/toy-sdar.yaml", MRP_RUN + ["train.log_every=1", "mesh.fsdp=2",
                                                                       "mesh.model=2"])
    a = train(base, tmp_path / "a", progress=False)
    out = capsys.readouterr().out
    assert "memory per device (mesh data=8; 1 rows x 64 tokens)" in out
    b = train(sharded, tmp_path / "b", progress=False)
    out = capsys.readouterr().out
    assert "memory per device (mesh data=2,fsdp=2,model=2; 2 rows x 64 tokens)" in out and "frozen params" in out
    assert b.losses[1] == pytest.approx(a.losses[1], rel=1e-4, abs=1e-6)  # a KL of ~3e-4: fp32 sums reordered
    assert "unsplit" not in capsys.readouterr().err  # 4 heads, 2 KV heads: model=2 splits every weight
    # model=4 cannot split 2 KV heads: said before the run, as loading the model on that mesh says it
    c = train(load_run_config("configs/mrp/toy-sdar.yaml", MRP_RUN + ["train.log_every=1", "mesh.model=4"]),
              tmp_path / "c", progress=False)
    assert "leave these weights unsplit over them: attention (2 KV heads, model=4)" in capsys.readouterr().err
    assert c.losses[1] == pytest.approx(a.losses[1], rel=1e-4, abs=1e-6)


def test_a_backbone_trains_fsdp_and_tensor_parallel_as_on_one_device(tmp_path, capsys):
    """A trained backbone split over fsdp=4 x model=2 (its AdamW moments with it): steps 1 and 2
    (after a sharded update) have the default mesh's losses; the estimate counts the params split."""
    tiny = ["train.steps=2", "train.log_every=1", "train.batch_size=8", "train.eval_every=0", "train.init_from=null",
            "train.warmup_steps=0", "model.hidden_size=32",
            "model.intermediate_size=64", "model.num_layers=2", "model.head_dim=8", "model.block_size=4",
            "data.tasks={toy-arith: 1}"]
    a = train(load_run_config("configs/toy-sdar.yaml", tiny), tmp_path / "a", progress=False)
    whole = capsys.readouterr().out
    b = train(load_run_config("configs/toy-sdar.yaml", tiny + ["mesh.fsdp=4", "mesh.model=2"]), tmp_path / "b",
              progress=False)
    split = capsys.readouterr().out
    assert "mesh data=1,fsdp=4,model=2; 2 rows" in split and "frozen params" not in split
    for step in (1, 2):
        assert b.losses[step] == pytest.approx(a.losses[step], rel=1e-5)
    assert a.losses[2] != a.losses[1]

    def trained(out):
        line = next(l for l in out.splitlines() if "trained params" in l)
        return float(line.split()[-2])

    assert trained(split) < trained(whole) / 4  # split over fsdp x model (norms and small dims stay whole)
