"""Expert parallelism on 8 fake CPU devices: one MoE layer, tokens sent all-to-all vs experts gathered.

For each mesh (`--meshes`, default expert=4 x data=2 and expert=8) and each token count
(`--tokens`: decode-like few tokens, prefill-like many), it times `dlmjax.models.moe.moe_forward`
jitted with each `dispatch`:
- "all_to_all": each device routes its slice of the tokens and sends each assignment's row to the
  device holding its expert (jax.lax.all_to_all under shard_map, dropless padded buffers), which
  runs its local experts (`moe.grouped_rows`: tiled rows on CPU, ragged_dot elsewhere) and sends
  the outputs back;
- "gather": the experts are all-gathered over 'expert' and each device computes its own slice;
- "xla": the layer as written, partitioned by XLA over the sharded experts (on CPU it all-gathers
  them);
median of `--repeats` calls after `--warmup`, random fp32 weights, tokens split over 'data'. It
also reads the compiled HLO and sums, per device, the bytes each kind of collective produces
(all-to-all, all-gather, all-reduce, ...), checks every path against the one-device layer
(max |diff|), and writes a JSON results file with the command that made it.

What this shows: 8 fake devices share the host's cores and "communicate" by memory copies, so the
times are CPU compute plus copies, not accelerator speed or interconnect; the collective bytes and
the shapes are what carries over.

    python benchmarks/moe_ep_cpu.py --json benchmarks/results/moe_ep_cpu/results.json
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dlmjax  # noqa: E402
from benchmarks.common import median_ms  # noqa: E402
from dlmjax.models import moe  # noqa: E402
from dlmjax.sharding import make_mesh  # noqa: E402

MODES = ("all_to_all", "gather", "xla")
# (hidden, experts, expert width, top-k) of one MoE layer
PUBLISHED_SHAPES = {"LLaDA-MoE-7B-A1B": (2048, 64, 1024, 8), "LLaDA2.0-mini": (2048, 256, 512, 8)}
_COLLECTIVE = re.compile(r"=\s*(.+?)\s+(all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)\(")
_ARRAY = re.compile(r"(f32|bf16|f16|s32|u32|s8|u8|pred|f64|s64)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}


def collective_bytes(hlo: str) -> dict[str, int]:
    """Per device: bytes produced by each kind of collective in a compiled (SPMD-partitioned) HLO."""
    out: dict[str, int] = {}
    for result, kind in _COLLECTIVE.findall(hlo):
        nbytes = sum(_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                     for t, dims in _ARRAY.findall(result))
        out[kind] = out.get(kind, 0) + nbytes
    return out


def layer_config(args) -> dlmjax.ModelConfig:
    return dlmjax.ModelConfig(family="llada_moe", vocab_size=16, hidden_size=args.hidden, intermediate_size=8,
                              num_layers=1, num_heads=4, num_kv_heads=4, head_dim=args.hidden // 4,
                              attention="bidirectional", num_experts=args.experts, num_experts_per_tok=args.top_k,
                              moe_intermediate_size=args.width, moe_layers=(0,), router="softmax",
                              norm_topk_prob=False)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--meshes", nargs="+", default=["expert=4,data=2", "expert=8,data=1"])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    cfg = layer_config(args)
    rng = np.random.default_rng(0)
    d, e, f = args.hidden, args.experts, args.width
    router = np.asarray(rng.normal(size=(d, e)) * 0.5, np.float32)
    gate_up = np.asarray(rng.normal(size=(e, d, 2 * f)) * 0.05, np.float32)
    down = np.asarray(rng.normal(size=(e, f, d)) * 0.05, np.float32)
    xs = {t: np.asarray(rng.normal(size=(t, d)), np.float32) for t in args.tokens}
    local = jax.jit(lambda x, r, g, w: moe.moe_forward(x, r, None, g, w, cfg))
    expected = {t: np.asarray(local(x, router, gate_up, down)) for t, x in xs.items()}
    local_ms = {t: median_ms(lambda: local(x, router, gate_up, down), args.repeats, warmup=args.warmup)
                for t, x in xs.items()}

    rows = []
    for spec in args.meshes:
        sizes = {k: int(v) for k, v in (part.split("=") for part in spec.split(","))}
        mesh = make_mesh(expert=sizes.get("expert", 1), data=sizes.get("data", 1), model=sizes.get("model", 1))
        experts = NamedSharding(mesh, P("expert", None, None))
        params = (jax.device_put(router, NamedSharding(mesh, P())), jax.device_put(gate_up, experts),
                  jax.device_put(down, experts))
        for t, x_host in xs.items():
            data = sizes.get("data", 1)
            x = jax.device_put(x_host, NamedSharding(mesh, P("data" if t % data == 0 else None, None)))
            row = dict(mesh=spec, tokens=t, one_device_ms=round(local_ms[t], 2),
                       auto=moe.resolve_dispatch("auto", t, cfg, mesh.abstract_mesh),
                       auto_model_bytes=moe.dispatch_bytes(t, cfg, mesh.abstract_mesh))
            for mode in MODES:
                fn = jax.jit(lambda x, r, g, w, mode=mode: moe.moe_forward(x, r, None, g, w, cfg, dispatch=mode))
                hlo = fn.lower(x, *params).compile().as_text()
                got = np.asarray(fn(x, *params))
                row[f"{mode}_ms"] = round(median_ms(lambda: fn(x, *params), args.repeats, warmup=args.warmup), 2)
                row[f"{mode}_collective_bytes_per_device"] = collective_bytes(hlo)
                row[f"{mode}_max_abs_diff"] = float(np.abs(got - expected[t]).max())
            rows.append(row)
            print(json.dumps(row), flush=True)
    published = []  # what "auto" picks at the published models' shapes (bf16), from the byte model alone
    for name, (hidden, experts, width, top_k) in PUBLISHED_SHAPES.items():
        shape_cfg = dlmjax.ModelConfig(**{**layer_config(args).__dict__, "hidden_size": hidden, "num_experts": experts,
                                          "moe_intermediate_size": width, "num_experts_per_tok": top_k,
                                          "head_dim": hidden // 4, "dtype": "bfloat16"})
        for spec in args.meshes:
            sizes = {k: int(v) for k, v in (part.split("=") for part in spec.split(","))}
            abstract = make_mesh(expert=sizes.get("expert", 1), data=sizes.get("data", 1)).abstract_mesh
            tokens = 1
            while moe.resolve_dispatch("auto", tokens, shape_cfg, abstract) == "all_to_all" and tokens < 1 << 24:
                tokens *= 2
            published.append(dict(model=name, mesh=spec, all_to_all_up_to_tokens=tokens // 2,
                                  bytes_at_32_tokens=moe.dispatch_bytes(32, shape_cfg, abstract, 2),
                                  gather_from_tokens=tokens))
            print(json.dumps(published[-1]), flush=True)
    result = dict(command="python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
                  shape=dict(hidden=d, experts=e, expert_width=f, top_k=args.top_k, dtype="float32"),
                  machine=dict(platform=platform.platform(), cpus=os.cpu_count(), jax=jax.__version__,
                               backend=jax.default_backend(), devices=len(jax.devices()),
                               note="8 fake CPU devices on shared cores: shapes and collective bytes carry over, "
                                    "times are not accelerator speed"),
                  load_average=os.getloadavg(), rows=rows, auto_at_published_shapes=published)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
