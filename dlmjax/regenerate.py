"""`dlmjax regenerate`: a training file's answers written again by the model itself. A drafter learns
to guess its target's next tokens, so it trains on answers the target wrote (DFlash's and
SpecForge's recipe: labels from target-regenerated data, ALGORITHMS.md section 3), not on the
dataset's own answers:

    dlmjax regenerate --model TARGET --data train.jsonl --field question --chat \\
        --max-new-tokens 1024 --out regen.jsonl
    dlmjax train configs/drafter/toy-ar.yaml backbone=TARGET "data.files={regen.jsonl: 1}" \\
        data.tasks=null data.prompt_field=question data.response_field=response data.chat=true ...

Each row of --data whose --field is a non-empty text is decoded (greedy `ar` for a causal model,
unless --decoder names another); the output line is the row's fields plus `response`, the decoded
text without special tokens (training's `data.chat` writes the end of turn again), and
`source_row`, its row number in --data. A row that reaches --max-new-tokens before its stop token
gets `response: null`: it is no answer the model finished, and training skips it and says so.

Rows are written as they finish, to OUT.partial (its first line the settings). A stopped run
started again with the same command keeps the rows written and decodes the others, to the same
tokens, since a row's output does not depend on the rows decoded beside it. At the end OUT is
written in row order and OUT.partial removed.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
from pathlib import Path

from dlmjax.validation import InputError, count_arg, seed_arg

SETTINGS_KEY = "dlmjax_regenerate"  # the partial file's first line: {SETTINGS_KEY: settings}


class RegenerateError(InputError):
    pass


def read_partial(content: bytes, partial: Path, settings: dict) -> dict[int, dict]:
    """{source row: output line} of a stopped run's partial file (its whole lines: one the stop
    cut short is not among them), which must have been started with `settings`."""
    header, *lines = content.split(b"\n")[:-1]
    try:
        started = json.loads(header)[SETTINGS_KEY]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise RegenerateError(f"{partial} is not a dlmjax regenerate file; move it away") from None
    changed = [key for key in sorted(set(settings) | set(started)) if settings.get(key) != started.get(key)]
    if changed:
        raise RegenerateError(
            f"{partial} was started with other settings ({', '.join(f'{k}: {started.get(k)!r}' for k in changed)}; "
            f"now {', '.join(f'{settings.get(k)!r}' for k in changed)}); rerun with its settings to finish it, or "
            "delete it to start over")
    done = {}
    for number, line in enumerate(lines, 2):
        try:
            row = json.loads(line)
            done[row["source_row"]] = row
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise RegenerateError(f"{partial}:{number} is not a row this command wrote; delete the file to start "
                                  "over") from None
    return done


def output_line(row: dict, source_row: int, text: str, finished: bool, response_field: str) -> dict:
    return {**row, response_field: text if finished else None, "source_row": source_row}


def _line(row: dict) -> bytes:
    return json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n"


def regenerate(model, tokenizer, rows: list[tuple[int, dict]], *, field: str, out: Path, settings: dict,
               decoder: str, max_new_tokens: int, batch_size: int, chat=False, seed: int = 0, mesh=None, head=None,
               drafter=None, progress: bool = True, response_field: str = "response") -> dict:
    """Decode `rows` ([(source row, object)]) into `out` (module docstring), resuming a stopped run
    of the same `settings`; a summary {rows, unfinished, resumed}. The partial file is locked
    while it is written: a second run on the same --out is refused."""
    from tqdm.auto import tqdm

    from dlmjax.decoding.api import Stream
    from dlmjax.io.tokenizer import decode_stop_ids, training_chat_vars

    partial = out.with_name(out.name + ".partial")
    with open(partial, "a+b") as f:  # appends go to the end, whatever was read
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RegenerateError(f"another dlmjax regenerate is writing {partial}; wait for it to finish, or give "
                                  "this one another --out") from None
        f.seek(0)
        content = f.read()
        whole_lines = content[: content.rfind(b"\n") + 1]  # a line the stop cut short is dropped
        f.truncate(len(whole_lines))
        done = read_partial(whole_lines, partial, settings) if whole_lines else {}
        if not whole_lines:
            f.write(_line({SETTINGS_KEY: settings}))
        todo = [(n, row) for n, row in rows if n not in done]
        stops = set(decode_stop_ids(model.config, tokenizer))
        prompts = [row[field] for _, row in todo]
        if chat and prompts:  # as training renders them (training_chat_vars: the template's date fixed)
            prompts = tokenizer.user_turns(prompts, training_chat_vars(chat))
        if prompts:
            stream = Stream(model, prompts, batch_size=batch_size, tokenizer=tokenizer, decoder=decoder,
                            max_new_tokens=max_new_tokens, seed=seed, row_ids=[n for n, _ in todo], mesh=mesh,
                            head=head, drafter=drafter)
            with tqdm(total=len(rows), initial=len(done), unit="row", desc="regenerate", disable=not progress) as bar:
                for index, result in stream:
                    n, row = todo[index]
                    finished = bool(result.tokens) and result.tokens[-1] in stops
                    done[n] = output_line(row, n, result.text, finished, response_field)
                    f.write(_line(done[n]))
                    f.flush()  # a stopped run keeps every row written
                    bar.update(1)
        whole = out.with_name(out.name + ".tmp")  # OUT appears only complete
        whole.write_bytes(b"".join(_line(done[n]) for n, _ in rows))
        os.replace(whole, out)
        partial.unlink()
    unfinished = sum(done[n][response_field] is None for n, _ in rows)
    return {"rows": len(rows), "unfinished": unfinished, "resumed": len(rows) - len(todo)}


def check_fields_free(rows: list[tuple[int, dict]], data: Path, field: str, response_field: str) -> None:
    """The fields the output writes hold nothing of the rows' own (a prompt, the data's answers)."""
    if response_field == field:
        raise RegenerateError(f"--response-field {response_field} is the prompt's field; the answers would replace "
                              "the prompts: name another")
    for n, row in rows:
        for key, fix in ((response_field, "write the answers to another field (--response-field NAME)"),
                         ("source_row", "rename it in the file")):
            if key in row:
                raise RegenerateError(f"{data}: row {n} already has a field {key!r}, which the output writes; {fix}")


# -- `dlmjax regenerate` --------------------------------------------------------------------------


def chat_arg(text: str):
    """--chat's optional value: the chat template's variables as a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object of chat template variables, e.g. "
                                         "'{\"enable_thinking\": false}'")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("regenerate", help="a training file's answers written again by the model (drafter data)")
    p.add_argument("--model", required=True, help="checkpoint directory or preset: the drafter's target")
    p.add_argument("--data", required=True, help="rows to answer: .jsonl(.gz) or .json, read as `dlmjax eval --data`")
    p.add_argument("--field", default="prompt", help="the rows' prompt field (GSM8K: question)")
    p.add_argument("--response-field", default="response", help="the field the answer is written to")
    p.add_argument("--out", required=True, help="output .jsonl (a stopped run resumes from OUT.partial)")
    p.add_argument("--max-new-tokens", type=count_arg, required=True,
                   help="tokens per answer; an answer not finished by then is written as null")
    p.add_argument("--chat", nargs="?", const=True, default=False, type=chat_arg, metavar="VARIABLES",
                   help="render each prompt as a user turn of the chat template (optionally with its variables, "
                        "'{\"enable_thinking\": false}'); train with the same data.chat")
    p.add_argument("--decoder", default=None, help="decoder spec (default: ar for causal models, as eval's first)")
    p.add_argument("--drafter", default=None, help="decode with this DFlash drafter (the `drafter` decoder: the ar "
                   "tokens, faster)")
    p.add_argument("--limit", type=count_arg, default=None, help="the first N usable rows only")
    p.add_argument("--batch-size", type=count_arg, default=32, help="rows decoded together")
    p.add_argument("--seed", type=seed_arg, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    p.add_argument("--mesh", default=None, help="e.g. data=8: rows split over the devices")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from dlmjax.cli import cli_mesh, decoder_for
    from dlmjax.distributed import plan
    from dlmjax.evaluation.runner import replicate_on
    from dlmjax.evaluation.tasks import DatasetError, read_rows, usable_rows
    from dlmjax.io.files import file_sha256
    from dlmjax.presets import load_checkpoint

    out, data = Path(args.out), Path(args.data).expanduser()
    if out.exists() or out.is_symlink():
        raise RegenerateError(f"{out} exists; pick another --out, or delete it to regenerate")
    if not out.parent.is_dir():
        raise RegenerateError(f"--out {out}: no directory {out.parent}; create it first")
    if not data.is_file():
        raise RegenerateError(f"--data {data}: no such file (regenerate reads a local .jsonl or .json file)")
    try:
        usable, bad = usable_rows(read_rows(data, split="train"), (args.field,))
    except DatasetError as err:
        raise RegenerateError(f"--data: {err}") from None
    if bad:
        print(f"{data}: skipped {len(bad)} row(s) without a text field {args.field!r} ({'; '.join(bad[:5])}"
              f"{' ...' if len(bad) > 5 else ''})")
    usable = usable[: args.limit]
    if not usable:
        raise RegenerateError(f"{data} has no row with a text field {args.field!r}; pass --field NAME")
    check_fields_free(usable, data, args.field, args.response_field)
    if plan().mode in ("explicit", "slurm"):
        raise RegenerateError("regenerate runs as one process (split its rows over this host's devices with --mesh "
                              "data=N); start it once, not under srun or with DLMJAX_* multi-process settings")
    mesh = cli_mesh(args.mesh)
    path, model, tokenizer, head = load_checkpoint(args.model, dtype=args.dtype, mesh=mesh)
    decoder, drafter = decoder_for(args, path, model)
    if mesh is not None:
        model, head, drafter = (replicate_on(m, mesh) for m in (model, head, drafter))
    settings = {"model": str(path.resolve()), "data": str(data.resolve()), "data_sha256": file_sha256(data),
                "field": args.field, "response_field": args.response_field, "chat": args.chat, "decoder": decoder,
                "max_new_tokens": args.max_new_tokens, "seed": args.seed, "dtype": args.dtype, "limit": args.limit}
    summary = regenerate(model, tokenizer, usable, field=args.field, out=out, settings=settings, decoder=decoder,
                         max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, chat=args.chat,
                         seed=args.seed, mesh=mesh, head=head, drafter=drafter, progress=not args.no_progress,
                         response_field=args.response_field)
    resumed = f", {summary['resumed']} of them from the stopped run" if summary["resumed"] else ""
    unfinished = (f"; {summary['unfinished']} reached --max-new-tokens {args.max_new_tokens} unfinished (response "
                  "null: training skips them; raise --max-new-tokens to keep them)") if summary["unfinished"] else ""
    print(f"wrote {summary['rows']} rows to {out}{resumed}{unfinished}")
    return 0
