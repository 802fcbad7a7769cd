"""How long XLA:CPU takes to compile the engine's programs under different XLA flags: the test
suite's time is mostly that (tests/conftest.py picks its flags from this).

Each flag set runs in a fresh process (no compilation cache): toy-sdar decodes 2 prompts of 24
tokens with four decoders (static, threshold, psd, mrp-spec), one compile each of their programs.
It prints the wall time per flag set (load, compile and run; the decoding itself is a small part)
and a digest of the tokens, which must be the same under every flag set.

    PYTHONPATH=. python benchmarks/compile_flags.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time

BASE = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"  # the suite's
FLAG_SETS = {
    "the suite's before (LLVM level 0)": "",
    "+ older fusion emitters": "--xla_cpu_use_fusion_emitters=false",
    "+ no thunk runtime": "--xla_cpu_use_thunk_runtime=false",
    "+ both": "--xla_cpu_use_fusion_emitters=false --xla_cpu_use_thunk_runtime=false",
}
DECODERS = ("static", "threshold:tau=0.9", "psd:policy=threshold,tau=0.9", "mrp-spec")


def decode_once() -> str:
    """Decode with every decoder; the digest of all tokens."""
    from dlmjax.decoding.api import generate
    from dlmjax.presets import load_checkpoint

    _, model, tokenizer, head = load_checkpoint("toy-sdar")
    prompts = [tokenizer.encode("12+7-3\n"), tokenizer.encode("3*4+1\n")]
    tokens = [[list(map(int, row.tokens)) for row in generate(model, prompts, tokenizer=tokenizer, decoder=d,
                                                              max_new_tokens=24, head=head).rows]
              for d in DECODERS]
    return hashlib.md5(repr(tokens).encode()).hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per flag set (the best is kept)")
    args = parser.parse_args()
    print(f"| flags (beside `{BASE}`) | best of {args.repeats}, s | tokens |\n|---|---|---|")
    for name, flags in FLAG_SETS.items():
        times, digests = [], set()
        for _ in range(args.repeats):
            env = {**os.environ, "XLA_FLAGS": f"{BASE} {flags}".strip(), "JAX_PLATFORMS": "cpu",
                   "JAX_ENABLE_COMPILATION_CACHE": "false"}
            start = time.perf_counter()
            run = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                                 check=True)
            times.append(time.perf_counter() - start)
            digests.add(run.stdout.strip().splitlines()[-1])
        print(f"| {name} `{flags}` | {min(times):.1f} | {', '.join(sorted(digests))} |", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        print(decode_once())
    else:
        main()
