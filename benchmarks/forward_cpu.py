"""CPU forward latency: dlmjax vs transformers (PyTorch) on the same random Qwen3 model.

What it measures, side by side in one process, on identical fp32 weights:

1. full forward: a batch of `--seq` (128) tokens with no cache, for each batch size in
   `--batches` (1 and 8): ms per forward and tokens/s;
2. a decode-size step against a KV cache: prefill `--seq` tokens, then time only the forward of
   a block of `--block` (4) new tokens at positions seq..seq+block-1 that reads the cache.
   dlmjax keeps its cache immutable (the timed call does not write it); transformers'
   DynamicCache is appended to in place, so a fresh `copy.deepcopy` of the prefilled cache is
   made before each repeat, outside the timed region.

Each case runs `--warmup` untimed calls, then reports the median of `--repeats` timed calls;
dlmjax and torch calls alternate so that background load affects both alike.
The dlmjax forward is jitted the recommended way (`nnx.split` once, `nnx.merge` inside
`jax.jit`) and timed through `block_until_ready`; torch runs under `torch.inference_mode()`
with `model.eval()` and `torch.set_num_threads(<cores>)`. The ratio column is
torch_ms / dlmjax_ms, so > 1 means dlmjax is faster. The max |logit difference| between the
two is printed as a sanity check that both run the same computation.

Run from the repository root (about 1-2 minutes on 2 cores with the defaults):

    python benchmarks/forward_cpu.py
    python benchmarks/forward_cpu.py --layers 4 --repeats 20 --json /tmp/forward_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

import dlmjax  # noqa: E402
from benchmarks.common import torch_cache_name  # noqa: E402
from dlmjax.models import KVCache  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128, help="tokens per full forward / prefill length")
    p.add_argument("--block", type=int, default=4, help="tokens in the cached decode step")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None, help="also write the results to this path")
    return p.parse_args(argv)


def time_pair(jax_fn, torch_fn, warmup: int, repeats: int, torch_setup=None) -> tuple[float, float]:
    """Median wall time in ms of `jax_fn()` and `torch_fn(torch_setup())`, calls interleaved so
    that background load hits both alike; `torch_setup` runs outside the timed region."""
    times = {"jax": [], "torch": []}
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        jax_fn()
        t1 = time.perf_counter()
        arg = torch_setup() if torch_setup is not None else None
        t2 = time.perf_counter()
        torch_fn(arg)
        t3 = time.perf_counter()
        if i >= warmup:
            times["jax"].append((t1 - t0) * 1e3)
            times["torch"].append((t3 - t2) * 1e3)
    return statistics.median(times["jax"]), statistics.median(times["torch"])


def cpu_snapshot():
    """(jiffies of all CPUs: total, idle, steal; this process's CPU seconds), or None off Linux."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    t = os.times()
    return sum(f), f[3] + f[4], f[7], t.user + t.system


def cpu_sharing(start, end) -> tuple[float, float] | None:
    """Percent of all CPU time, between two snapshots, used by other processes and stolen by the
    hypervisor: the noise this benchmark cannot control on a shared machine."""
    if start is None or end is None or end[0] <= start[0]:
        return None
    total, idle, steal = (e - s for e, s in zip(end[:3], start[:3]))
    ours = (end[3] - start[3]) * os.sysconf("SC_CLK_TCK")
    return max(0.0, 100 * (total - idle - steal - ours) / total), 100 * steal / total


def build_models(args, ckpt_dir: str):
    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(4096, args.seq + args.block),
        tie_word_embeddings=False,
        torch_dtype=torch.float32,
    )
    torch.manual_seed(args.seed)
    torch_model = transformers.Qwen3ForCausalLM(cfg).to(torch.float32).eval()
    torch_model.save_pretrained(ckpt_dir)
    jax_model = dlmjax.load_model(ckpt_dir)
    return torch_model, jax_model


def main(argv=None):
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    cpu_start = cpu_snapshot()
    transformers.utils.logging.disable_progress_bar()

    print("command:", shlex.join([sys.executable] + sys.argv))
    print(
        f"jax {jax.__version__} ({jax.default_backend()}), flax {flax.__version__}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}"
    )
    print(
        f"cpu cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()}, "
        f"load average at start: {os.getloadavg()[0]:.2f}"
    )
    print(
        f"model: Qwen3 fp32 hidden={args.hidden} layers={args.layers} heads={args.heads} "
        f"kv_heads={args.kv_heads} head_dim={args.head_dim} intermediate={args.intermediate} "
        f"vocab={args.vocab}; warmup={args.warmup} repeats={args.repeats} (median)"
    )

    with tempfile.TemporaryDirectory() as ckpt_dir:
        torch_model, jax_model = build_models(args, ckpt_dir)
    n_params = sum(p.numel() for p in torch_model.parameters())
    print(f"params: {n_params / 1e6:.1f}M")

    graphdef, state = nnx.split(jax_model)
    cfg = jax_model.config

    @jax.jit
    def jax_forward(state, tokens):
        return nnx.merge(graphdef, state)(tokens).logits

    @jax.jit
    def jax_prefill(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache=cache, write_cache=True).cache

    @jax.jit
    def jax_step(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache=cache).logits

    rng = np.random.default_rng(args.seed)
    results = []

    def record(case, batch, tokens, jax_ms, torch_ms, max_diff):
        row = dict(
            case=case, batch=batch, tokens=tokens,
            dlmjax_ms=jax_ms, torch_ms=torch_ms, ratio_torch_over_dlmjax=torch_ms / jax_ms,
            dlmjax_tok_s=tokens / jax_ms * 1e3, torch_tok_s=tokens / torch_ms * 1e3,
            max_abs_logit_diff=max_diff,
        )
        results.append(row)
        print(f"  done: {case}", flush=True)

    with torch.inference_mode():
        # 1. full forward, no cache
        for b in batches:
            ids = rng.integers(0, args.vocab, size=(b, args.seq), dtype=np.int32)
            ids_j, ids_t = jnp.asarray(ids), torch.from_numpy(ids.astype(np.int64))
            jax_ms, torch_ms = time_pair(
                lambda: jax_forward(state, ids_j).block_until_ready(),
                lambda _: torch_model(input_ids=ids_t).logits,
                args.warmup, args.repeats,
            )
            diff = float(np.abs(np.asarray(jax_forward(state, ids_j)) - torch_model(input_ids=ids_t).logits.numpy()).max())
            record(f"full fwd {b}x{args.seq}", b, b * args.seq, jax_ms, torch_ms, diff)

        # 2. decode-size step: prefill seq tokens, then a block of `block` tokens against the cache
        cache_name = torch_cache_name(torch_model)
        for b in batches:
            total = args.seq + args.block
            ids = rng.integers(0, args.vocab, size=(b, total), dtype=np.int32)
            pos = np.broadcast_to(np.arange(total, dtype=np.int32), (b, total))
            pre_ids, blk_ids = ids[:, : args.seq], ids[:, args.seq :]
            pre_pos, blk_pos = jnp.asarray(pos[:, : args.seq]), jnp.asarray(pos[:, args.seq :])

            cache = KVCache.init(cfg, b, total)
            cache = jax_prefill(state, jnp.asarray(pre_ids), pre_pos, cache)
            blk_j = jnp.asarray(blk_ids)
            pre_t = torch.from_numpy(pre_ids.astype(np.int64))
            blk_t = torch.from_numpy(blk_ids.astype(np.int64))
            past = getattr(torch_model(input_ids=pre_t, use_cache=True), cache_name)

            jax_ms, torch_ms = time_pair(
                lambda: jax_step(state, blk_j, blk_pos, cache).block_until_ready(),
                lambda kv: torch_model(input_ids=blk_t, **{cache_name: kv}, use_cache=True).logits,
                args.warmup, args.repeats, torch_setup=lambda: copy.deepcopy(past),
            )
            ref = torch_model(input_ids=blk_t, **{cache_name: copy.deepcopy(past)}, use_cache=True).logits
            diff = float(np.abs(np.asarray(jax_step(state, blk_j, blk_pos, cache)) - ref.numpy()).max())
            record(f"cached step {b}x{args.block} (+{args.seq} cached)", b, b * args.block, jax_ms, torch_ms, diff)

    print()
    header = f"{'case':<32} {'dlmjax ms':>10} {'torch ms':>10} {'ratio':>7} {'dlmjax tok/s':>13} {'torch tok/s':>12} {'max|dlogit|':>12}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['case']:<32} {r['dlmjax_ms']:>10.2f} {r['torch_ms']:>10.2f} {r['ratio_torch_over_dlmjax']:>7.2f} "
            f"{r['dlmjax_tok_s']:>13.0f} {r['torch_tok_s']:>12.0f} {r['max_abs_logit_diff']:>12.1e}"
        )
    print("ratio = torch ms / dlmjax ms (> 1: dlmjax faster)")
    sharing = cpu_sharing(cpu_start, cpu_snapshot())
    if sharing is not None:
        print(f"CPU time during the run: {sharing[0]:.0f}% used by other processes, {sharing[1]:.0f}% stolen by the hypervisor")
        if sum(sharing) > 10:
            print("WARNING: the CPU was shared with other work; timings are noisy "
                  "(torch's OpenMP threads suffer most from a busy CPU)")

    if args.json:
        meta = dict(
            command=shlex.join([sys.executable] + sys.argv), jax=jax.__version__, torch=torch.__version__,
            transformers=transformers.__version__, cpu_cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
            args=vars(args), params=n_params, cpu_other_percent=sharing and sharing[0], cpu_steal_percent=sharing and sharing[1],
        )
        Path(args.json).write_text(json.dumps(dict(meta=meta, results=results), indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
