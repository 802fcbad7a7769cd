"""`dlmjax eval --backend lm-eval`: gsm8k, humaneval, mbpp and math500 scored by lm-eval's task
definitions (prompts, few-shot examples, stop strings, filters, metrics) instead of dlmjax's own
scorers, offline, through the `dlmjax` lm-eval model.

The tasks are the YAMLs of `dlmjax.lm_eval.tasks` (lm-eval's own tasks over the data dlmjax
ships), written with absolute data paths into a temporary include directory. Each decoder runs
`lm_eval.simple_evaluate` once on the same loaded model. The outputs are `dlmjax eval`'s:
results.json (one run per task and decoder: accuracy = the task's lm-eval metric named in
`tasks.TASKS`, the decoding metrics; lm-eval's full results under `lm_eval`), results.md (the
table, then lm-eval's own tables), pareto.png, and with --save-outputs outputs.jsonl (lm-eval's
logged samples: prompt, response, filtered answer, target, score).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

from dlmjax.evaluation.tasks import TOY_TASKS
from dlmjax.io.files import write_atomic
from dlmjax.validation import InputError


def check_backend_args(args, tasks: list[str]) -> None:
    """Refuse what the lm-eval backend cannot run, naming the fix (before any model is loaded)."""
    from dlmjax.lm_eval.tasks import TASKS, UNSAFE

    toy = [t for t in tasks if t in TOY_TASKS]
    if toy:
        raise InputError(f"{', '.join(toy)} {'is' if len(toy) == 1 else 'are'} dlmjax's own generated "
                         f"task{'s' if len(toy) > 1 else ''} with no lm-eval definition: drop --backend lm-eval "
                         f"(the native backend runs it), or name --task from {', '.join(TASKS)}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise InputError(f"unknown task {', '.join(map(repr, unknown))} for --backend lm-eval; tasks: "
                         f"{', '.join(TASKS)}")
    if args.data is not None or args.strict_data:
        raise InputError(f"{'--data' if args.data is not None else '--strict-data'} feeds the native backend; the lm-eval tasks read the data dlmjax ships. For other "
                         "data: python -m dlmjax.lm_eval.tasks DIR, edit data_files in DIR's YAML and run dlmjax "
                         "lm-eval --include_path DIR")
    if args.fewshot_as_multiturn is not None and not args.chat:
        raise InputError("--fewshot-as-multiturn lays few-shot examples out as chat turns; add --chat (lm-eval's "
                         "--apply_chat_template) or drop it")
    if args.compare_to is not None:
        raise InputError("--compare-to compares generated tokens, which lm-eval does not log; drop --backend lm-eval "
                         "to use it")
    unsafe = [t for t in tasks if t in UNSAFE]
    if unsafe and not args.confirm_run_unsafe_code:
        raise InputError(f"{', '.join(unsafe)} run{'s' if len(unsafe) == 1 else ''} the generated code (lm-eval marks "
                         "the task unsafe_code): pass --confirm-run-unsafe-code (lm-eval's --confirm_run_unsafe_code) "
                         "to run it, in dlmjax's sandbox")
    if unsafe and args.chat:
        print(f"dlmjax eval: warning: lm-eval's {', '.join(unsafe)} run{'s' if len(unsafe) == 1 else ''} the raw "
              "response as code, while a chat model answers with fenced code and prose, which then fails; the "
              "native backend (drop --backend lm-eval) takes the code out of the answer", file=sys.stderr)
    if "math500" in tasks:
        try:
            import lm_eval.tasks.minerva_math.utils  # noqa: F401
        except (ImportError, AssertionError) as err:
            raise InputError(f"math500 through lm-eval is its minerva_math500, whose scorer needs lm-eval's math "
                             f"extra ({err}): pip install 'lm-eval[math]'") from None


def run_backend(args) -> int:
    """`dlmjax eval --backend lm-eval` (see the module docstring)."""
    if not args.task:  # (the native backend's default, the toy tasks, has no lm-eval definition)
        from dlmjax.lm_eval.tasks import TASKS

        raise InputError(f"--backend lm-eval runs the tasks named with --task: {', '.join(TASKS)}")
    tasks = args.task
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table

        from dlmjax.lm_eval import DlmjaxLM
    except ImportError as err:
        raise InputError(f"--backend lm-eval needs lm-evaluation-harness: pip install 'dlmjax[lm-eval]' ({err})") from None
    check_backend_args(args, tasks)

    from dlmjax.decoding.api import _round_up
    from dlmjax.decoding.spec import distinct_specs
    from dlmjax.evaluation.report import run_settings, write_report
    from dlmjax.evaluation.runner import default_decoders
    from dlmjax.heads.mrp import has_head
    from dlmjax.io.dflash import find_drafter_dir
    from dlmjax.io.files import absolute_if_local
    from dlmjax.lm_eval.tasks import TASKS, write_tasks
    from dlmjax.presets import resolve_model

    import jax

    axes = {"data": jax.device_count(), "model": 1, "fsdp": 1, "expert": 1}  # as the native backend
    if args.mesh is not None:
        from dlmjax.sharding import parse_mesh

        axes = dict(parse_mesh(args.mesh).shape)
    batch = _round_up(args.batch_size, axes["data"])  # as the native backend: a multiple of the data axis
    lm = DlmjaxLM(pretrained=args.model, decoder=(args.decoder or [None])[0], batch_size=batch,
                  **{f"mesh_{axis}": size for axis, size in axes.items()}, expert_dispatch=args.expert_dispatch or "auto",
                  seed=args.seed, dtype=args.dtype, mrp_head=args.mrp_head, drafter=args.drafter,
                  tspd_controller=args.tspd_controller, max_new_tokens=args.max_new_tokens or 256,
                  progress=not args.no_progress)
    decoders = distinct_specs(args.decoder or [])  # two spellings of one decoder run once, as natively
    if not decoders:
        head = has_head(resolve_model(args.mrp_head, "--mrp-head") if args.mrp_head else lm.path) or None
        drafter = (args.drafter or find_drafter_dir(lm.path)) or None
        decoders = default_decoders(lm.model, head, drafter)

    uses_head = uses_drafter = False  # whether a decoder reads the MRP head, the drafter (for the settings)
    for decoder in decoders:  # every decoder checked (and what it needs found) before the first run
        lm.use_decoder(decoder)
        uses_head, uses_drafter = uses_head or lm.head is not None, uses_drafter or lm.drafter is not None
    records, outputs, lm_results, tables = [], [], {}, []
    with tempfile.TemporaryDirectory(prefix="dlmjax-lm-eval-tasks-") as include:
        write_tasks(include, tasks)
        names = [TASKS[t][0] for t in tasks]
        for decoder in decoders:
            lm.use_decoder(decoder)
            out = lm_eval.simple_evaluate(
                model=lm, tasks=names, num_fewshot=args.num_fewshot, limit=args.limit, log_samples=True,
                task_manager=TaskManager(include_path=include, include_defaults=False),
                gen_kwargs={"max_gen_toks": args.max_new_tokens} if args.max_new_tokens else None,
                apply_chat_template=bool(args.chat), fewshot_as_multiturn=args.fewshot_as_multiturn != "false",
                confirm_run_unsafe_code=args.confirm_run_unsafe_code,
            )
            tables.append(f"lm-eval, decoder `{decoder}`:\n\n{make_table(out)}")
            for task, name in zip(tasks, names):
                metric = TASKS[task][2]
                results = out["results"][name]
                kept = metric.split(",")[1]  # lm-eval logs each doc once per filter: keep the metric's
                samples = sorted((s for s in out["samples"][name] if s.get("filter", kept) == kept),
                                 key=lambda s: s["doc_id"])
                records.append(_record(task, decoder, args.model, results[metric], lm.metrics[name]))
                lm_results.setdefault(decoder, {})[task] = {
                    "lm_eval_task": name, "metric": metric, "n_shot": out["n-shot"].get(name),
                    "results": {k: v for k, v in results.items() if k != "alias"}}
                outputs += [_output(task, decoder, metric, s) for s in samples]
    from importlib.metadata import version

    title = f"{args.model} ({lm.path}), lm-eval {version('lm_eval')} task definitions (dlmjax.lm_eval.tasks)"
    settings = run_settings(
        getattr(args, "argv", None), backend="lm-eval", lm_eval_version=version("lm_eval"), model=args.model,
        checkpoint=str(lm.path), dtype=lm.model.config.dtype, decoders=list(decoders), tasks=list(tasks),
        num_fewshot=args.num_fewshot, limit=args.limit, max_new_tokens=args.max_new_tokens, batch_size=batch,
        mesh=axes, seed=args.seed, chat=bool(args.chat), expert_dispatch=args.expert_dispatch,
        # what was used, also where it was found in the model's directory (as the native backend)
        mrp_head=absolute_if_local(args.mrp_head or lm.path) if uses_head else None,
        drafter=absolute_if_local(args.drafter or find_drafter_dir(lm.path)) if uses_drafter else None)
    table = write_report(records, outputs if args.save_outputs else None, args.out, title=title, settings=settings)
    out_dir = Path(args.out)
    saved = json.loads((out_dir / "results.json").read_text())
    saved.update(backend="lm-eval", lm_eval=lm_results)
    write_atomic(out_dir / "results.json", json.dumps(saved, indent=2, default=str))
    write_atomic(out_dir / "results.md", (out_dir / "results.md").read_text() + "\n" + "\n\n".join(tables))
    print(table)
    print("\n\n".join(tables), file=sys.stderr)
    print(f"wrote {args.out}/results.json, results.md, pareto.png" + (", outputs.jsonl" if args.save_outputs else ""))
    return 0


def _record(task, decoder, model_name, accuracy, m):
    """A `dlmjax eval` RunRecord from lm-eval's score and the model's decoding metrics `m`."""
    from dlmjax.evaluation.runner import RunRecord

    return RunRecord(
        task=task, decoder=decoder, model=model_name, n=m.prompts, accuracy=float(accuracy),
        nfe=m.nfe / max(m.prompts, 1), tpf=m.committed / max(m.nfe, 1), useful_tpf=m.generated / max(m.nfe, 1),
        tokens_per_s=m.generated / max(m.wall_s, 1e-9), wall_s=m.wall_s,
        mean_accepted_length=sum(m.accepted) / len(m.accepted) if m.accepted else None, forwards=m.forwards,
        batch_tpf=m.committed / max(m.slot_forwards, 1))


def _output(task, decoder, metric, sample) -> dict:
    """One logged lm-eval sample as an outputs.jsonl row."""
    name = metric.split(",")[0]
    score = sample.get(name)
    return {"task": task, "decoder": decoder, "index": sample["doc_id"], "prompt": sample["arguments"][0][0],
            "text": sample["resps"][0][0], "filtered": sample["filtered_resps"], "target": sample["target"],
            "score": score, "correct": bool(score) if isinstance(score, (int, float)) and not math.isnan(score) else None}
