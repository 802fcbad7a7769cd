"""The `dlmjax` command: generate, eval, train, traces, regenerate, export.

    dlmjax generate --model DIR_OR_PRESET --prompt TEXT [--prompt TEXT ...] [--decoder SPEC]
                    [--max-new-tokens N] [--json]
    dlmjax eval [--model DIR_OR_PRESET] [--task NAME ...] [--decoder SPEC ...] [--limit N] [--out DIR]
                [--save-outputs] [--backend {native,lm-eval}]
    dlmjax train CONFIG [section.key=value ...] --out RUN_DIR
    dlmjax traces [--model DIR_OR_PRESET] --out DIR        (TSPD training traces)
    dlmjax regenerate --model DIR --data FILE --max-new-tokens N --out FILE   (drafter data: the model's answers)
    dlmjax export SRC OUT --format torch
    dlmjax lm-eval --model dlmjax --model_args pretrained=DIR_OR_PRESET,... --tasks ...   (lm-eval's flags)

generate, eval, train, traces and regenerate take --precision {default,highest} and --invariant (dlmjax.numerics),
and --kernels {auto,on,interpret,off} (dlmjax.kernels).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import traceback

import jax

from dlmjax import kernels
from dlmjax.arithmetic import PRECISIONS, numerics
from dlmjax.decoding.spec import decoder_names
from dlmjax.models.moe import EXPERT_DISPATCH
from dlmjax.regenerate import add_parser as add_regenerate_parser
from dlmjax.traces import add_parser as add_traces_parser
from dlmjax.io.files import check_output_dir
from dlmjax.validation import InputError, at_least_0_arg, count_arg, seed_arg

# A mistake in what the user typed or pointed at: one line, exit 2. Anything else is a bug.
USER_ERRORS = (InputError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
# the OSErrors of a path or a disk, not of dlmjax: a name too long, a link loop, a name taken, a
# read-only filesystem, no space left
PATH_ERRNOS = (errno.ENAMETOOLONG, errno.ELOOP, errno.EEXIST, errno.EROFS, errno.ENOSPC, errno.EDQUOT)


def _drafter_for(path, model, decoders, drafter_dir, dtype):
    """The DFlash drafter a causal model decodes with: --drafter DIR, else the one in the model's
    directory; loaded when a `drafter` decoder asks for it (or, with no decoder named, when there
    is one). None otherwise."""
    from dlmjax.io.dflash import find_drafter_dir, resolve_drafter

    if model.config.attention != "causal":
        if drafter_dir is not None:
            raise InputError(f"--drafter serves causal (autoregressive) targets; {path} is a "
                             f"{model.config.attention} {model.config.family} model")
        return None
    wanted = any(d.split(":")[0].strip() == "drafter" for d in decoders) if decoders else (
        drafter_dir is not None or find_drafter_dir(path) is not None)
    if drafter_dir is not None and not wanted:
        raise InputError(f"--drafter {drafter_dir} is for the drafter decoder, which none of the decoders named is; "
                         "add --decoder drafter, or drop --drafter")
    return resolve_drafter(path, model.config, drafter_dir, dtype=dtype) if wanted else None


CONTROLLER_DECODERS = ("tspd", "tspd+ce")  # decoders that read a per-token TSPD controller


def _check_controller_used(specs, controller) -> None:
    """--tspd-controller names a file for the TSPD decoders: refused where none of them runs."""
    if controller is not None and not any(s.partition(":")[0].strip() in CONTROLLER_DECODERS for s in specs):
        raise InputError(f"--tspd-controller {controller} is for the {' and '.join(CONTROLLER_DECODERS)} decoders, "
                         "which none of the decoders is; add --decoder tspd, or drop --tspd-controller")


def _with_controller(specs, model, model_dir, controller):
    """Decoder specs with `controller=` filled in for the TSPD decoders that lack it: --tspd-controller,
    else the controller stored in the model's directory (when there is one), named as the user named
    the model (`toy-sdar`, not its absolute path: the spec is the results' row label)."""
    from dlmjax.heads.controller import CONTROLLER_FILE

    default = controller or (model if (model_dir / CONTROLLER_FILE).is_file() else None)
    if default is not None and "," in default and any(s.partition(":")[0].strip() in CONTROLLER_DECODERS
                                                      for s in specs):
        raise InputError(f"the TSPD controller path {default!r} holds a ',', which separates a decoder's options; "
                         "move it (or link it) to a path without one")
    filled = []
    for spec in specs:
        name, _, options = spec.partition(":")
        if name.strip() in CONTROLLER_DECODERS and default is not None and "controller=" not in options:
            spec = f"{name}:{options + ',' if options else ''}controller={default}"
        filled.append(spec)
    return filled


def cli_mesh(spec: str | None):
    """The mesh `--mesh` names, or None without the option."""
    from dlmjax.sharding import parse_mesh

    return None if spec is None else parse_mesh(spec)


def add_distributed_args(parser) -> None:
    dist = parser.add_argument_group("multi-process (docs/launch.md; default: DLMJAX_* variables, SLURM, a TPU pod, "
                                     "or one process)")
    dist.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                      help="address of process 0 and a free port (or DLMJAX_COORDINATOR)")
    dist.add_argument("--num-processes", type=count_arg, default=None, help="processes in the run (or "
                      "DLMJAX_NUM_PROCESSES)")
    dist.add_argument("--process-id", type=int, default=None, help="this process, 0..N-1 (or DLMJAX_PROCESS_ID, "
                      "or SLURM_PROCID)")


def _join_processes(args) -> bool:
    """Join the multi-process run the flags or the environment describe (before anything touches a
    device); whether this is process 0, the one that prints and writes."""
    from dlmjax.distributed import initialize, is_main

    initialize(args.coordinator, args.num_processes, args.process_id)
    return is_main()


def decoder_for(args, path, model, controller=None) -> tuple[str, object]:
    """(decoder spec, DFlash drafter or None) that one decoder's command (generate, regenerate)
    runs: --decoder; else `drafter` where --drafter names one for a causal model; else the model's
    first default. The TSPD `controller` is filled in and the drafter loaded where it decodes."""
    from dlmjax.decoding.api import check_kind
    from dlmjax.decoding.spec import parse_options
    from dlmjax.evaluation.runner import default_decoders

    asked_drafter = args.drafter is not None and model.config.attention == "causal"  # --drafter DIR: decode with it
    decoder = args.decoder or ("drafter" if asked_drafter else default_decoders(model)[0])
    check_kind(parse_options(decoder)[0], model)  # before the drafter or controller it would need is looked for
    _check_controller_used([decoder], controller)
    decoder = _with_controller([decoder], args.model, path, controller)[0]
    return decoder, _drafter_for(path, model, [decoder], args.drafter, args.dtype)


def cmd_generate(args) -> int:
    main = _join_processes(args)
    from dlmjax.decoding.api import generate
    from dlmjax.evaluation.runner import replicate_on
    from dlmjax.presets import load_checkpoint
    from dlmjax.sharding import make_mesh

    mesh = cli_mesh(args.mesh)
    if mesh is None and jax.process_count() > 1:  # as eval: every device of every process on 'data'
        mesh = make_mesh(model=1)
    path, model, tokenizer, head = load_checkpoint(args.model, dtype=args.dtype, head_from=args.mrp_head, mesh=mesh,
                                                   expert_dispatch=args.expert_dispatch)
    decoder, drafter = decoder_for(args, path, model, args.tspd_controller)
    prompts = args.prompt
    if args.chat:
        prompts = tokenizer.user_turns(prompts)
    if mesh is not None:
        model, head, drafter = (replicate_on(m, mesh) for m in (model, head, drafter))
    result = generate(model, prompts, tokenizer=tokenizer, decoder=decoder, max_new_tokens=args.max_new_tokens,
                      seed=args.seed, head=head, drafter=drafter, mesh=mesh)
    if not main:  # every process decodes its part; process 0 prints
        return 0
    for row in result.rows:
        if args.json:
            print(json.dumps({**row.to_json(), "batch_forwards": result.forwards, "batch_tpf": result.batch_tpf}))
        else:
            print(row.text)
            print(f"  [{row.num_tokens} tokens, NFE {row.nfe}, TPF {row.tpf:.2f}]", file=sys.stderr)
    if not args.json:
        print(
            f"{result.decoder}: {result.forwards} forwards, TPF {result.tpf:.2f} per row, {result.batch_tpf:.2f} per "
            f"batch slot, {result.wall_s:.2f} s, {result.tokens_per_s:.1f} tokens/s",
            file=sys.stderr,
        )
    return 0


def cmd_export(args) -> int:
    from dlmjax.heads.controller import CONTROLLER_FILE, export_controller
    from dlmjax.heads.mrp import has_head, load_head, save_head
    from dlmjax.io.dflash import DRAFTER_SUBDIR, find_drafter_dir, load_drafter, save_drafter
    from dlmjax.io.files import staged_dir
    from dlmjax.io.hf import check_export_target, export_model, load_model
    from dlmjax.presets import resolve_model

    src, out = resolve_model(args.src, "export SRC"), check_output_dir(args.out)
    check_export_target(out)
    if (src / CONTROLLER_FILE).is_file() and not (src / "config.json").is_file():
        raise InputError(f"{src} holds a TSPD controller alone (a TSPD training run's model/): decode with "
                         f"--tspd-controller {src}, or copy {CONTROLLER_FILE} into the backbone's directory and "
                         "export that")
    model = load_model(src)
    extras = []
    with staged_dir(out, keep_existing=True) as stage:  # `out` appears only once everything is written
        export_model(model, stage, files_from=src)
        if has_head(src):
            save_head(load_head(src, model.config, stored_dtype=True), stage)  # a float32 head stays float32
            extras.append("its MRP head")
        if (src / CONTROLLER_FILE).is_file():
            export_controller(src, stage)
            extras.append("its TSPD controller")
        drafter_dir = find_drafter_dir(src)
        if drafter_dir is not None:  # DFlash format (vLLM and SGLang load it)
            drafter, dtype = load_drafter(drafter_dir, model.config, target_dir=src), args.drafter_dtype or "bfloat16"
            save_drafter(drafter, stage / DRAFTER_SUBDIR, dtype=dtype)
            extras.append(f"its DFlash drafter in {DRAFTER_SUBDIR}/ ({dtype})")
        elif args.drafter_dtype is not None:
            raise InputError(f"--drafter-dtype sets the dtype of the DFlash drafter exported beside the model, and "
                             f"{src} holds none (no {DRAFTER_SUBDIR}/); drop --drafter-dtype")
    print(f"wrote {args.format} checkpoint to {out}" + (f" (with {' and '.join(extras)})" if extras else ""))
    return 0


def cmd_eval(args) -> int:
    check_output_dir(args.out)
    check_output_dir(os.path.join(args.out, "earlier"))  # where an earlier eval's files move (report.keep_earlier_results)
    main = _join_processes(args)
    if args.backend == "lm-eval":
        if jax.process_count() > 1:
            raise InputError("--backend lm-eval runs in one process; a multi-process evaluation takes the native "
                             "backend (drop --backend lm-eval)")
        if args.preset is not None:
            raise InputError("--preset sets up the native backend's tasks and decoders; drop --backend lm-eval")
        args.model, args.batch_size = args.model or "toy-sdar", args.batch_size or 64
    if args.backend == "lm-eval":  # lm-eval's task definitions through the dlmjax lm-eval model
        try:
            from dlmjax.lm_eval.backend import run_backend
        except ImportError as err:  # lm-eval not installed: the message says how to install it
            raise InputError(str(err)) from None
        return run_backend(args)
    for option, value in (("--num-fewshot", args.num_fewshot), ("--fewshot-as-multiturn", args.fewshot_as_multiturn),
                          ("--confirm-run-unsafe-code", args.confirm_run_unsafe_code or None)):
        if value is not None:
            raise InputError(f"{option} applies to --backend lm-eval (the native tasks are zero-shot and always "
                             "sandbox the code they run); add --backend lm-eval or drop it")
    from dlmjax.decoding.spec import distinct_specs, spec_key
    from dlmjax.evaluation.report import run_settings, write_report
    from dlmjax.evaluation.runner import compare_to, default_decoders, run_eval
    from dlmjax.evaluation.tasks import TOY_TASKS, load_eval_set
    from dlmjax.io.dflash import find_drafter_dir
    from dlmjax.io.files import absolute_if_local
    from dlmjax.presets import load_checkpoint, load_eval_preset
    from dlmjax.sharding import make_mesh

    preset = None
    if args.preset is not None:  # a seed table on a published checkpoint (dlmjax/eval_presets)
        preset = load_eval_preset(args.preset)
        if args.model is None:
            raise InputError(f"--preset {preset.name} runs on {preset.checkpoint}: download it and pass its "
                             "directory as --model DIR")
        args.decoder = args.decoder or list(preset.decoders)
        args.chat = preset.chat if args.chat is None else args.chat
        args.batch_size = args.batch_size or preset.batch_size
    args.model = args.model or "toy-sdar"
    args.chat = bool(args.chat)
    args.batch_size = args.batch_size or 64
    mesh = cli_mesh(args.mesh) or make_mesh(model=1)
    path, model, tokenizer, head = load_checkpoint(args.model, dtype=args.dtype, head_from=args.mrp_head, mesh=mesh,
                                                   expert_dispatch=args.expert_dispatch)
    if preset is not None:
        preset.check_model(model.config)
        if args.chat and preset.chat_template_vars:
            args.chat = dict(preset.chat_template_vars)  # e.g. Qwen3's enable_thinking: false
    named = (args.decoder or []) + ([args.compare_to] if args.compare_to is not None and args.decoder else [])
    try:
        drafter = _drafter_for(path, model, named, args.drafter, args.dtype)
    except InputError as err:
        if preset is None or preset.drafter is None:
            raise
        raise InputError(f"{err} (the preset's drafter is {preset.drafter}, from huggingface.co/{preset.drafter})"
                         ) from None
    tasks = list(dict.fromkeys(args.task or (list(preset.tasks) if preset is not None else
                                             list(TOY_TASKS))))  # a task named twice runs once
    if args.data is not None and len(tasks) != 1:
        raise InputError("--data applies to one task; pass a single --task with it")
    if args.strict_data and all(t in TOY_TASKS for t in tasks):
        raise InputError(f"--strict-data refuses a data file with unusable rows, and {', '.join(tasks)} read no file "
                         "(they are generated); drop --strict-data")
    lengths = preset.tasks if preset is not None else {}
    eval_sets = [load_eval_set(t, data=args.data, limit=args.limit, max_new_tokens=args.max_new_tokens or lengths.get(t),
                               strict=args.strict_data) for t in tasks]
    for eval_set in eval_sets:
        for problem in eval_set.skipped if main else ():
            print(f"{eval_set.task}: skipped {problem}", file=sys.stderr)
    # the TSPD decoders' controllers filled in first: `tspd` and `tspd:controller=M` are one decoder
    decoders = args.decoder or default_decoders(model, head, drafter)
    _check_controller_used(decoders + ([args.compare_to] if args.compare_to else []), args.tspd_controller)
    decoders = distinct_specs(_with_controller(decoders, args.model, path, args.tspd_controller))
    reference = None  # --compare-to's decoder, as spelled in the runs (run first where it is not one of them)
    if args.compare_to is not None:
        compared = _with_controller([args.compare_to], args.model, path, args.tspd_controller)[0]
        reference = next((d for d in decoders if spec_key(d) == spec_key(compared)), compared)
        decoders = decoders if reference in decoders else [reference] + decoders
    settings = run_settings(
        getattr(args, "argv", None), backend="native", model=args.model, checkpoint=str(path),
        preset=None if preset is None else preset.name, dtype=model.config.dtype, decoders=decoders,
        compare_to=args.compare_to, tasks={s.task: {"rows": len(s.items), "max_new_tokens": s.max_new_tokens}
                                           for s in eval_sets},
        data=absolute_if_local(args.data), strict_data=args.strict_data, limit=args.limit,
        batch_size=-(-args.batch_size // mesh.shape["data"]) * mesh.shape["data"],  # as Stream rounds it
        mesh=dict(mesh.shape), seed=args.seed, chat=args.chat, expert_dispatch=args.expert_dispatch,
        # what was used, also where it was found in the model's directory
        mrp_head=None if head is None else absolute_if_local(args.mrp_head or path),
        drafter=None if drafter is None else absolute_if_local(args.drafter or find_drafter_dir(path)),
        working_directory=os.getcwd())
    runs, title = len(eval_sets) * len(decoders), f"{args.model} ({path})"
    reported = False  # whether this eval wrote its report yet (the first write moves an earlier eval's aside)

    def report(records, outputs):
        """The report of the runs done so far."""
        nonlocal reported
        complete = len(records) == runs
        table = write_report(
            records, outputs if args.save_outputs else None, args.out, settings={**settings, "complete": complete},
            title=title if complete else f"{title}: partial, {len(records)} of {runs} runs (interrupted, or still "
            "running)", skipped={s.task: s.skipped for s in eval_sets if s.skipped}, keep_earlier=not reported)
        reported = True
        return table

    records, outputs = run_eval(
        model, tokenizer, eval_sets, decoders, model_name=args.model, batch_size=args.batch_size,
        mesh=mesh, seed=args.seed, chat=args.chat, progress=main and not args.no_progress, head=head,
        drafter=drafter, on_run=report if main and runs > 1 else None,
    )
    if not main:  # every process decodes its part of each batch (and scores it all); process 0 writes
        return 0
    if reference is not None:
        records = compare_to(records, outputs, reference)
    table = report(records, outputs)
    print(table)
    print(f"wrote {args.out}/results.json, results.md, pareto.png" + (", outputs.jsonl" if args.save_outputs else ""))
    return 0


def cmd_lm_eval(argv: list[str]) -> int:
    """`dlmjax lm-eval ARGS`: lm-eval's own command line, flags unchanged, with the `dlmjax` model."""
    try:
        from dlmjax.lm_eval import run_cli
    except ImportError as err:
        raise InputError(str(err)) from None
    return run_cli(argv)


def _train_mesh_overrides(args) -> list[str]:
    """--mesh and --device-memory of `dlmjax train` as overrides of the config's mesh section
    (--mesh replaces its axes: an axis left out is 1, data takes the devices left)."""
    from dlmjax.sharding import MESH_AXES, parse_mesh_sizes

    out = []
    if getattr(args, "mesh", None) is not None:
        axes = {f"mesh.{axis}" for axis in MESH_AXES}
        both = [key for key in (o.partition("=")[0].strip() for o in args.overrides) if key in axes]
        if both:
            raise InputError(f"--mesh {args.mesh} and the override {both[0]}= both set the mesh's axes (--mesh "
                             "replaces them all); give them in one of the two")
        sizes = parse_mesh_sizes(args.mesh)
        out += [f"mesh.{axis}={sizes.get(axis, 'null' if axis == 'data' else 1)}" for axis in MESH_AXES]
    if getattr(args, "device_memory", None) is not None:
        out.append(f"mesh.device_memory={args.device_memory}")
    return out


def cmd_train(args) -> int:
    main = _join_processes(args)
    from dlmjax.train.config import load_run_config
    from dlmjax.train.loop import train

    check_output_dir(args.out)
    run = load_run_config(args.config, args.overrides + _train_mesh_overrides(args))
    result = train(run, args.out, progress=not args.no_progress)
    if result.model_dir is not None and main:
        print(f"trained {result.step} steps; model written to {result.model_dir}")
    return 0


DRAFTER_HELP = ("DFlash drafter directory for the `drafter` decoder of a causal model; default: the model's own "
                "drafter/ subdirectory when it has one")
CONTROLLER_HELP = ("TSPD controller (tspd_controller.safetensors, or a directory or preset holding one) for the tspd "
                   "and tspd+ce decoders that name none; default: the model's own, when it has one")
MESH_HELP = ("device mesh AXIS=N,...: prompts split over 'data', the model's weights tensor-parallel over 'model', "
             "each weight's largest free dimension over 'fsdp', an MoE model's experts over 'expert' (e.g. "
             "data=2,model=4 or expert=4,data=2; an axis left out is 1 except data, which takes the devices the "
             "others leave)")
EXPERT_DISPATCH_HELP = ("MoE models with experts split over --mesh expert=N: how tokens meet their experts. all_to_all "
                        "sends each token to its experts' device and back; gather all-gathers the experts to every "
                        "device; xla leaves it to the compiler; auto (default) takes whichever of all_to_all and "
                        "gather moves fewer bytes per layer")
MRP_HEAD_HELP = ("checkpoint directory holding the MRP head (mrp_modules.* tensors) for the mrp-* decoders; "
                 "default: the model's own directory when it has one")


def add_numerics_args(parser: argparse.ArgumentParser):
    group = parser.add_argument_group("numerics (dlmjax.numerics)")
    group.add_argument("--precision", choices=PRECISIONS, default=None,
                       help="fp32 matmuls: highest computes them in full fp32 on GPU/TPU (parity with PyTorch); "
                            "default lets them round through TF32/bf16 passes (faster). CPU: always full fp32")
    group.add_argument("--invariant", action="store_true",
                       help="batch-invariant numerics: a row's logits are bitwise the same alone, in any batch and "
                            "as a packed copy, so lossless decoders stay lossless on accelerators (slower)")
    group.add_argument("--kernels", choices=kernels.MODES, default=None,
                       help="Pallas kernels (dlmjax.kernels): auto (default: each where kernels.AUTO names it, on GPU "
                            "where it was measured faster; the XLA references on CPU), on, interpret (any device, "
                            "slow), off")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlmjax", description="Fast decoding for diffusion language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="decode prompts with a decoder")
    gen.add_argument("--model", required=True, help="checkpoint directory or preset (toy-sdar, toy-ar, random-sdar, random-qwen3, random-*-moe, ...)")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    gen.add_argument("--decoder", default=None,
                     help=f"NAME or NAME:key=value,... (default: static; ar for causal models, drafter with --drafter, "
                          "fast-dllm-v2 for Fast-dLLM v2); decoders: "
                          f"{', '.join(decoder_names())}")
    gen.add_argument("--max-new-tokens", type=count_arg, default=64,
                     help="tokens to generate, any number >= 1 (whole blocks are decoded and cut; default 64)")
    gen.add_argument("--seed", type=seed_arg, default=0)
    gen.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--mrp-head", default=None, help=MRP_HEAD_HELP)
    gen.add_argument("--drafter", default=None, help=DRAFTER_HELP)
    gen.add_argument("--tspd-controller", default=None, help=CONTROLLER_HELP)
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt: text, tokens, nfe, tpf, ...")
    gen.add_argument("--mesh", default=None, help=MESH_HELP + "; copies of the last prompt fill the last device's "
                     "share. Default: one device (in a multi-process run, data = every device)")
    gen.add_argument("--expert-dispatch", choices=EXPERT_DISPATCH, default=None, help=EXPERT_DISPATCH_HELP)
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="accuracy and speed of decoders on tasks (default: toy-sdar, both toy tasks)")
    ev.add_argument("--model", default=None, help="checkpoint directory or preset (default toy-sdar)")
    ev.add_argument("--preset", default=None, metavar="NAME",
                    help="a seed table on a published checkpoint (dlmjax/eval_presets/NAME.yaml, or a YAML file): its tasks, "
                         "generation lengths, chat template, batch size and decoders, checked against --model DIR "
                         "(family, mask id, block size); options given here override them")
    ev.add_argument("--task", action="append", help="toy-arith, toy-constraint, gsm8k, gsm8k-cot (0-shot chain of thought, boxed answer), humaneval, "
                    "humaneval-instruct (an instruction before the code prompt), mbpp, mbpp-sanitized (its 257 "
                    "hand-verified test problems), math500; repeat for several")
    ev.add_argument("--decoder", action="append", help="decoder SPEC as in `dlmjax generate`; repeat (default: a set)")
    ev.add_argument("--limit", type=count_arg, default=None,
                    help="first N prompts per task (toy tasks: N generated; default 128)")
    ev.add_argument("--data", default=None, help="gsm8k/humaneval/mbpp/math500 (and variants) source: local .jsonl(.gz)/.json, a directory or a HF dataset name")
    ev.add_argument("--strict-data", action="store_true",
                    help="refuse a --data file with unreadable rows (default: report their line numbers and skip them)")
    ev.add_argument("--out", default="eval-results",
                    help="output directory (default eval-results); an earlier run's results there move to "
                         "OUT/earlier/<time written>/")
    ev.add_argument("--save-outputs", action="store_true", help="also write outputs.jsonl (one line per decoder and prompt)")
    ev.add_argument("--batch-size", type=count_arg, default=None, help="prompts decoded together (default 64, or the preset's)")
    ev.add_argument("--mesh", default=None, help=MESH_HELP + " (--batch-size is rounded up to a multiple of data). "
                    "Default: data = every device")
    ev.add_argument("--expert-dispatch", choices=EXPERT_DISPATCH, default=None, help=EXPERT_DISPATCH_HELP)
    ev.add_argument("--max-new-tokens", type=count_arg, default=None, help="override the task's generation budget")
    ev.add_argument("--seed", type=seed_arg, default=0)
    ev.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    ev.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                    help="wrap each prompt in the model's chat template (--no-chat: not, where a preset would)")
    ev.add_argument("--mrp-head", default=None, help=MRP_HEAD_HELP)
    ev.add_argument("--drafter", default=None, help=DRAFTER_HELP)
    ev.add_argument("--tspd-controller", default=None, help=CONTROLLER_HELP)
    ev.add_argument("--compare-to", default=None, metavar="DECODER",
                    help="also report each decoder's token agreement with DECODER on the same prompts (run if not "
                         "listed), e.g. PSD against its own policy, mrp-spec against static")
    ev.add_argument("--no-progress", action="store_true")
    ev.add_argument("--backend", choices=("native", "lm-eval"), default="native",
                    help="native: dlmjax's own prompts and scorers (default); lm-eval: lm-evaluation-harness's task "
                         "definitions (prompts, few-shot examples, stops, filters, metrics) for gsm8k, humaneval, mbpp "
                         "and math500 (its minerva_math500) over the data dlmjax ships, offline")
    ev.add_argument("--num-fewshot", type=at_least_0_arg, default=None,
                    help="--backend lm-eval: few-shot examples per prompt (default: the task's, e.g. gsm8k 5)")
    ev.add_argument("--fewshot-as-multiturn", choices=("true", "false"), default=None,
                    help="--backend lm-eval with --chat: the few-shot examples as turns of their own (true, lm-eval's "
                         "default with a chat template) or all in the first user message (false); lm-eval's "
                         "--fewshot_as_multiturn")
    ev.add_argument("--confirm-run-unsafe-code", action="store_true",
                    help="--backend lm-eval: allow humaneval and mbpp, which run the generated code (in dlmjax's "
                         "sandbox); lm-eval's --confirm_run_unsafe_code")
    ev.set_defaults(func=cmd_eval)

    tr = sub.add_parser("train", help="train a toy backbone, an MRP head, a DFlash drafter or a TSPD controller "
                                      "from a YAML config (rerun to resume)")
    tr.add_argument("config", help="YAML config, e.g. configs/toy-sdar.yaml")
    tr.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.steps=100")
    tr.add_argument("--out", required=True, help="run directory (checkpoints, metrics, exported model)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.add_argument("--mesh", default=None,
                    help="device mesh AXIS=N,... (axes data, fsdp, expert, model): the batch split over data x fsdp, "
                         "a backbone's weights tensor-parallel over model and sharded over fsdp, trained heads "
                         "replicated; replaces the config's mesh section (e.g. data=2,fsdp=2,model=2)")
    tr.add_argument("--device-memory", default=None, metavar="SIZE",
                    help="per-device memory the run's estimate is checked against, e.g. 16GiB (default: what the "
                         "device reports; none on CPU, where no run is refused)")
    tr.set_defaults(func=cmd_train)

    add_traces_parser(sub)
    add_regenerate_parser(sub)
    for name in ("generate", "eval", "train", "traces", "regenerate"):
        add_numerics_args(sub.choices[name])
    for name in ("generate", "eval", "train"):
        add_distributed_args(sub.choices[name])

    # Never parsed here: `main` hands everything after `lm-eval` to lm-eval's own parser.
    sub.add_parser("lm-eval", add_help=False,
                   help="lm-evaluation-harness with the dlmjax model: dlmjax lm-eval --model dlmjax --model_args "
                        "pretrained=DIR,decoder=SPEC --tasks ... (lm-eval's flags; `dlmjax lm-eval --help`)")

    exp = sub.add_parser("export", help="write a checkpoint (with its MRP head, drafter, TSPD controller) in "
                                        "Hugging Face PyTorch format")
    exp.add_argument("src", help="checkpoint directory or preset")
    exp.add_argument("out", help="output directory (new or empty)")
    exp.add_argument("--format", choices=("torch",), default="torch")
    exp.add_argument("--drafter-dtype", choices=("bfloat16", "float32", "float16"), default=None,
                     help="dtype of the DFlash drafter written beside the model (default bfloat16, as published)")
    exp.set_defaults(func=cmd_export)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The parsed command line; `train` overrides may come before or after its options."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":
        args.overrides += [a for a in extra if "=" in a and not a.startswith("-")]
        extra = [a for a in extra if a not in args.overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:  # lm-eval's flags go to lm-eval's parser untouched
        return _run("lm-eval", lambda: cmd_lm_eval(argv[1:]))
    args = parse_args(argv)
    args.argv = argv  # the command as given, for results.json

    def run():  # inside _run: a bad DLMJAX_KERNELS is a one-line error too
        with numerics(precision=getattr(args, "precision", None), invariant=getattr(args, "invariant", None) or None), \
                kernels.use(getattr(args, "kernels", None) or kernels.current()):
            return args.func(args)

    return _run(args.command, run)


def _run(command: str, run) -> int:
    """run(): its exit code; a user mistake prints one line and exits 2, anything else is a bug (1)."""
    try:
        return run()
    except USER_ERRORS as err:  # a mistake in the input: the message names it and the fix
        print(f"dlmjax {command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout piped into a reader that stopped (`| head`): nothing left to tell it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit goes nowhere
        return 0
    except KeyboardInterrupt:  # Ctrl-C: what was finished is kept (a run's last step is checkpointed)
        kept = {"train": "; rerun the same command to resume from the last finished step",
                "regenerate": "; rerun the same command to keep the rows written and decode the others",
                "eval": "; any (task, decoder) runs that finished are in the --out directory's results "
                        "(settings.complete: false)"}
        print(f"dlmjax {command}: interrupted" + kept.get(command, ""), file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 (anything else is ours: keep the traceback)
        if isinstance(err, OSError) and err.errno in PATH_ERRNOS:  # a path that cannot be, or a full disk
            print(f"dlmjax {command}: error: {err}", file=sys.stderr)
            return 2
        traceback.print_exc()
        print(f"dlmjax {command}: internal error: this is a bug in dlmjax, not a mistake in your input; "
              "please report it with the traceback above", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
