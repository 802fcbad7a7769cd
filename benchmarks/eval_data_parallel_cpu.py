"""Sharded evaluation on 8 fake CPU devices: `dlmjax eval --mesh data=D` for D = 1, 2, 4, 8.

Each width runs the same command on the same prompts (toy-sdar on toy-arith by default, one
decoder, a fixed `--batch-size` of row slots split over 'data'), and this script reports per width:
the accuracy, forwards, tokens per forward, wall time and tokens/s that `dlmjax eval` writes, the
row slots each device holds, and whether every decoded token equals the data=1 run.

What this shows: 8 fake devices share the host's cores, so tokens/s does not grow with D here
(the same arithmetic is split into D programs on the same 2 cores, plus copies); what carries over
to a pod is the shape (each device decodes batch/D rows, no collective in the decode step) and the
equality of the outputs. Throughput scaling is measured only on real devices. Forwards may differ
between widths with equal tokens: the stream refills finished slots a multiple of D rows at a time
(batch/8 rounded up to D: 4 rows at D <= 4, 8 at D = 8 with the default batch of 32).

    python benchmarks/eval_data_parallel_cpu.py --json benchmarks/results/eval_data_parallel_cpu/results.json
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dlmjax.cli import main as dlmjax_main  # noqa: E402


def run_width(data: int, args, out_dir: Path) -> tuple[dict, list]:
    """One `dlmjax eval --mesh data=D` run: its results.json record and its decoded tokens."""
    out = out_dir / f"data{data}"
    code = dlmjax_main(["eval", "--model", args.model, "--task", args.task, "--limit", str(args.limit),
                        "--decoder", args.decoder, "--batch-size", str(args.batch_size), "--mesh", f"data={data}",
                        "--save-outputs", "--no-progress", "--out", str(out)])
    if code != 0:
        raise SystemExit(f"dlmjax eval --mesh data={data} exited {code}")
    record = json.loads((out / "results.json").read_text())["runs"][0]
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    return record, [row["tokens"] for row in sorted(rows, key=lambda r: r["index"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="toy-sdar")
    parser.add_argument("--task", default="toy-arith")
    parser.add_argument("--decoder", default="threshold:tau=0.9")
    parser.add_argument("--limit", type=int, default=64, help="prompts")
    parser.add_argument("--batch-size", type=int, default=32, help="row slots in all, split over 'data'")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()

    results, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for data in args.widths:
            record, tokens = run_width(data, args, Path(tmp))
            reference = tokens if reference is None else reference
            results.append({"data": data, "rows_per_device": args.batch_size // data,
                            "same_tokens_as_data1": tokens == reference,
                            **{k: record[k] for k in ("n", "accuracy", "forwards", "tpf", "wall_s", "tokens_per_s")}})
    header = "| data | rows/device | accuracy | forwards | TPF | wall s | tokens/s | tokens = data=1 |"
    print(header)
    print("|---" * 8 + "|")
    for r in results:
        print(f"| {r['data']} | {r['rows_per_device']} | {r['accuracy']:.3f} | {r['forwards']} | {r['tpf']:.2f} | "
              f"{r['wall_s']:.2f} | {r['tokens_per_s']:.1f} | {r['same_tokens_as_data1']} |")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": "python benchmarks/eval_data_parallel_cpu.py " + shlex.join(sys.argv[1:]),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                       f"{len(jax.devices())} fake CPU devices",
            "versions": {"jax": jax.__version__, "python": platform.python_version()},
            "note": "fake devices share the host's cores: tokens/s is not a scaling measurement; refills are a "
                    "multiple of data rows, so forwards differ at data=8 with the same tokens",
            "results": results,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
