"""The row-asynchronous engine against the lockstep engine it replaced, on toy-sdar: the prompts,
new tokens and seed of tests/data/lockstep_toy_sdar.json (what the lockstep engine decoded,
recorded before it was replaced), one `generate` of all 64 prompts per decoder with the shipped
MRP head.

Per decoder: row TPF (committed tokens / row NFE over all rows), the forwards the batch ran and
batch TPF (committed tokens / (forwards x 64)), beside the lockstep engine's forwards from the
file (its batch NFE, a prefill and a store per block) and its batch TPF. Where the decoder's
tokens still equal the file's, both engines committed the same tokens; where they do not (the
decoders the file does not hold, or whose rule changed since), the lockstep columns are empty.

    PYTHONPATH=. python benchmarks/row_async_toy.py --out benchmarks/results/row_async_toy
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_results  # noqa: E402
from dlmjax.decoding.api import generate  # noqa: E402
from dlmjax.presets import load_checkpoint  # noqa: E402

RECORDED = Path(__file__).resolve().parents[1] / "tests" / "data" / "lockstep_toy_sdar.json"
EXTRA = ("entropy:gamma=0.5", "threshold:tau=0.5,temperature=0.8,top_p=0.9")  # not in the recorded file


def measure(model, tokenizer, head, recorded: dict, spec: str) -> dict:
    result = generate(model, recorded["prompts"], tokenizer=tokenizer, decoder=spec, head=head,
                      max_new_tokens=recorded["max_new_tokens"], seed=recorded["seed"])
    rows = len(recorded["prompts"])
    committed = sum(round(row.tpf * row.nfe) for row in result.rows)
    row = dict(decoder=spec, row_tpf=round(result.tpf, 2), forwards=result.forwards,
               batch_tpf=round(committed / (result.forwards * rows), 2))
    old = recorded["decoders"].get(spec)
    if old is not None and [r.tokens for r in result.rows] == old["tokens"] and [r.nfe for r in result.rows] == old["nfe"]:
        row["lockstep_forwards"] = old["batch_nfe"] + old["prefill"] + old["stores"]
        row["lockstep_batch_tpf"] = round(committed / (row["lockstep_forwards"] * rows), 2)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    recorded = json.loads(RECORDED.read_text())
    _, model, tokenizer, head = load_checkpoint(recorded["model"])
    rows = []
    for spec in [*recorded["decoders"], *EXTRA]:
        rows.append(measure(model, tokenizer, head, recorded, spec))
        print(rows[-1], flush=True)
    command = "PYTHONPATH=. python benchmarks/row_async_toy.py" + (f" --out {args.out}" if args.out else "")
    lines = [f"# Row-asynchronous vs lockstep engine ({recorded['model']}, {len(recorded['prompts'])} prompts, "
             f"{recorded['max_new_tokens']} new tokens, seed {recorded['seed']})", "", f"`{command}`", "",
             "| decoder | row TPF | forwards, lockstep | batch TPF, lockstep | forwards, row-async | batch TPF, row-async |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| `{r['decoder']}` | {r['row_tpf']:.2f} | {r.get('lockstep_forwards', '')} | "
                     f"{r.get('lockstep_batch_tpf', '')} | {r['forwards']} | {r['batch_tpf']:.2f} |")
    print("\n".join(lines))
    if args.out:
        write_results(args.out, "cpu-toy-sdar", dict(command=command, rows=rows), lines)


if __name__ == "__main__":
    main()
