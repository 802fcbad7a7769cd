"""Sharded evaluation on 8 fake CPU devices: `dlmjax eval/generate --mesh data=D,model=M` split the
prompts over 'data' and the weights over 'model', and give the single-device run's tokens."""

import json

import pytest
from jax.sharding import NamedSharding

from dlmjax.cli import main
from dlmjax.config import ModelConfig
from dlmjax.evaluation.runner import replicate_on
from dlmjax.io.hf import export_model
from dlmjax.models.transformer import init_model
from dlmjax.presets import load_checkpoint
from dlmjax.sharding import parse_mesh
from dlmjax.toy.tokenizer import save_char_tokenizer
from dlmjax.validation import InputError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An untrained block-4 SDAR-style model: 4 heads and an MLP of 64 split over model=4."""
    path = tmp_path_factory.mktemp("sharded-sdar")
    ids = save_char_tokenizer(path)
    cfg = ModelConfig(family="sdar", attention="block_causal", block_size=4, vocab_size=ids["vocab_size"],
                      hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=512, qk_norm=True, mask_token_id=ids["mask"],
                      eos_token_ids=(ids["eos"],), pad_token_id=ids["pad"])
    export_model(init_model(cfg, seed=0), path)
    return path


def test_mesh_option_parses_axes_and_names_the_fix():
    mesh = parse_mesh("data=2,model=4")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 1, "model": 4}
    assert dict(parse_mesh("model=2").shape)["data"] == 4  # data takes what the others leave
    assert dict(parse_mesh("data=1,model=1").shape) == {"data": 1, "fsdp": 1, "expert": 1, "model": 1}
    for bad in ("data=2,data=4", "batch=2", "data", "data=x", "model=0", "data=²"):  # a digit int() refuses
        with pytest.raises(InputError, match="AXIS=N"):
            parse_mesh(bad)
    with pytest.raises(InputError, match="must divide the number of devices"):
        parse_mesh("model=3")


@pytest.mark.devices(8)
def test_a_model_loaded_on_a_mesh_stays_tensor_parallel(checkpoint):
    mesh = parse_mesh("data=2,model=4")
    _, model, _, _ = load_checkpoint(checkpoint, mesh=mesh)
    placed = replicate_on(model, mesh)
    gate_up = placed.layers[0].mlp.gate_up.kernel[...]  # gate and up fused: [D, 2F], (gate, up) pairs
    assert isinstance(gate_up.sharding, NamedSharding) and gate_up.sharding.mesh == mesh
    assert gate_up.sharding.spec[1] == "model" and gate_up.addressable_shards[0].data.shape == (32, 32)


def _eval_tokens(checkpoint, out, mesh, capsys):
    args = ["eval", "--model", str(checkpoint), "--task", "toy-arith", "--limit", "12", "--decoder", "static",
            "--decoder", "threshold:tau=0.5", "--max-new-tokens", "8", "--batch-size", "8", "--no-progress",
            "--save-outputs", "--out", str(out), "--mesh", mesh]
    assert main(args) == 0
    capsys.readouterr()
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    runs = json.loads((out / "results.json").read_text())["runs"]
    return ({(o["decoder"], o["index"]): o["tokens"] for o in outputs},
            [(r["decoder"], r["n"], r["accuracy"]) for r in runs])


@pytest.mark.devices(8)
def test_sharded_eval_equals_the_single_device_run(checkpoint, tmp_path, capsys):
    single = _eval_tokens(checkpoint, tmp_path / "one", "data=1,model=1", capsys)
    assert len(single[0]) == 2 * 12
    for mesh in ("data=2,model=4", "data=8"):
        assert _eval_tokens(checkpoint, tmp_path / mesh.replace(",", "_"), mesh, capsys) == single, mesh


@pytest.mark.devices(8)
def test_sharded_generate_equals_the_single_device_run(checkpoint, capsys):
    common = ["generate", "--model", str(checkpoint), "--prompt", "12+7=", "--prompt", "3+4=", "--max-new-tokens",
              "8", "--json"]

    def rows(*extra):
        assert main([*common, *extra]) == 0
        return [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]

    single = rows("--mesh", "data=1,model=1")
    assert rows("--mesh", "data=2,model=4") == single and len(single) == 2
    assert rows("--mesh", "data=4,model=2") == single  # 2 prompts filled with copies to split over 4
    assert main([*common, "--mesh", "data=2;model=4"]) == 2
