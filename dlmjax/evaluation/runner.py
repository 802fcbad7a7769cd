"""Run several decoders over the same prompts and measure accuracy and speed.

Each (task, decoder) runs as one continuous-batching stream (`dlmjax.decoding.api.Stream`):
`batch_size` slots (a multiple of the mesh's 'data' axis, split over it: data-parallel
decoding), and a finished row's slot takes the next prompt. Each (task, decoder) first decodes
a warm-up slice with the layout of the whole task, untimed, so `wall_s` and tokens/s measure
decoding, not compilation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from dlmjax.decoding.api import Stream
from dlmjax.distributed import shared_flags
from dlmjax.evaluation.tasks import EvalSet
from dlmjax.validation import InputError


@dataclass
class RunRecord:
    task: str
    decoder: str
    model: str
    n: int
    accuracy: float
    nfe: float  # mean denoising forwards per prompt
    tpf: float  # committed tokens per forward (EOS fill included)
    useful_tpf: float  # generated tokens up to the first EOS per forward
    tokens_per_s: float  # generated tokens up to EOS / wall_s
    wall_s: float
    mean_accepted_length: float | None = None  # speculative decoders: tokens per verifying forward
    forwards: int = 0  # model forwards run for the whole task (prefills of new prompts included)
    batch_tpf: float = 0.0  # committed tokens / row slots of those forwards (tpf, less idle slots)
    skipped_rows: int = 0
    # `dlmjax eval --compare-to REF`: agreement of this decoder's tokens with REF's on the same prompts
    compared_to: str | None = None
    identical_rows: float | None = None  # fraction of prompts whose generated tokens equal REF's
    token_agreement: float | None = None  # fraction of positions equal (over the longer of the two)

    def to_json(self) -> dict:
        return asdict(self)


def default_decoders(model, head=None, drafter=None) -> list[str]:
    """AR for causal models, and `drafter` beside it when a drafter is given; fast-dllm-v2 for its
    family; for other diffusion models
    one token per step, the whole block at once, two confidence thresholds and PSD; with an MRP
    head also mrp-spec, mrp-direct, and mrp-remask beside threshold decoding at the same low tau
    (where threshold loses accuracy)."""
    if model.config.attention == "causal":
        return ["ar"] + (["drafter"] if drafter is not None else [])
    if model.config.attention == "block_causal" and model.config.shift_logits:
        return ["fast-dllm-v2"]  # the only decoder for Fast-dLLM v2 (decoding/api._cache_mode)
    block = model.config.block_size or 32  # PSD's depth and the MRP drafts fit the block (api._block_size)
    decoders = ["static", f"static:k={block}", "threshold:tau=0.9", "threshold:tau=0.7",
                f"psd:policy=threshold,tau=0.9,depth={min(4, block)}"]
    if head is not None:
        direct = ["mrp-direct:mrp_steps=1"] if block >= 2 else []
        decoders += [f"mrp-spec:drafts={min(3, block)}", *direct, "threshold:tau=0.2", "mrp-remask:tau=0.2,delta=0.5"]
    return decoders


def replicate_on(model, mesh):
    """Put the model's (or head's) params on every device of `mesh` (data-parallel decoding).
    Arrays already placed on `mesh` keep their sharding: a model loaded with `load_model(...,
    mesh=mesh)` stays split tensor-parallel over 'model'."""
    if model is None:
        return None
    graphdef, state = nnx.split(model)
    replicated = NamedSharding(mesh, P())

    def place(x):
        on_mesh = isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh
        return x if on_mesh else jax.device_put(x, replicated)

    return nnx.merge(graphdef, jax.tree.map(place, state))


def task_stream(model, tokenizer, eval_set: EvalSet, decoder: str, *, batch_size: int, mesh=None, seed: int = 0,
                chat: bool = False, head=None, drafter=None):
    """stream(limit=None): a `Stream` of `decoder` over the task's prompts. Making one checks the
    decoder against the model and the prompts against its length; an error names the task and
    decoder."""
    items = eval_set.items
    prompts = [item.prompt for item in items]
    if chat:  # True, or a dict of chat template variables (e.g. {"enable_thinking": False})
        prompts = tokenizer.user_turns(prompts, chat)

    def stream(limit=None):
        try:
            return Stream(model, prompts, batch_size=batch_size, tokenizer=tokenizer, decoder=decoder,
                          max_new_tokens=eval_set.max_new_tokens, seed=seed, row_ids=[it.index for it in items],
                          mesh=mesh, head=head, drafter=drafter, limit=limit)
        except InputError as err:
            raise type(err)(f"task {eval_set.task}, decoder {decoder}: {err}") from None

    return stream


def evaluate_decoder(model, tokenizer, eval_set: EvalSet, decoder: str, *, model_name: str, batch_size: int,
                     mesh=None, seed: int = 0, chat: bool = False, warmup: bool = True, bar=None, head=None,
                     drafter=None):
    """(RunRecord, per-prompt outputs) for one decoder (a SPEC string, used as its label) on one task."""
    items = eval_set.items
    stream = task_stream(model, tokenizer, eval_set, decoder, batch_size=batch_size, mesh=mesh, seed=seed, chat=chat,
                         head=head, drafter=drafter)
    if warmup:  # compile outside the timed run: the first slots and one refill
        probe = stream()
        for _ in stream(limit=min(len(items), probe.batch + probe.refill)):
            pass
    run = stream()
    rows = {}
    for position, row in run:
        rows[position] = row
        if bar is not None:
            bar.update(1)
    ordered = [rows[i] for i in range(len(items))]
    # on a mesh of every process, each scores its share (the code tasks run in the sandbox once, not once per host)
    scores = shared_flags(lambda share: eval_set.score([items[i] for i in share], [ordered[i].text for i in share]),
                          len(items), mesh=mesh)
    outputs = [{"task": eval_set.task, "decoder": decoder, "index": item.index, "tokens": row.tokens, "text": row.text,
                "correct": bool(ok)} for item, row, ok in zip(items, ordered, scores)]
    n, nfe = len(items), sum(row.nfe for row in ordered)
    accepted = [row.mean_accepted_length for row in ordered if row.mean_accepted_length is not None]
    record = RunRecord(
        task=eval_set.task, decoder=decoder, model=model_name, n=n, accuracy=sum(map(bool, scores)) / n,
        nfe=nfe / n, tpf=run.committed / max(nfe, 1), useful_tpf=run.generated / max(nfe, 1),
        tokens_per_s=run.generated / max(run.wall_s, 1e-9), wall_s=run.wall_s,
        mean_accepted_length=sum(accepted) / len(accepted) if accepted else None, forwards=run.forwards,
        batch_tpf=run.batch_tpf, skipped_rows=len(eval_set.skipped),
    )
    return record, outputs


def run_eval(model, tokenizer, eval_sets: list[EvalSet], decoders: list[str], *, model_name: str,
             batch_size: int = 64, mesh=None, seed: int = 0, chat: bool = False, progress: bool = True,
             warmup: bool = True, head=None, drafter=None, on_run=None):
    """Every decoder on every task: (records, outputs). Without `warmup`, times include compilation.
    `head`: the MRP head for mrp-* decoders; `drafter`: the DFlash drafter for `drafter`.
    `on_run(records, outputs)` is called with what is done after each (task, decoder) run (the CLI
    writes it, so an interrupted evaluation keeps its finished runs)."""
    for eval_set in eval_sets:
        if not eval_set.items:
            raise InputError(f"{eval_set.task}: no usable prompts ({len(eval_set.skipped)} rows skipped); "
                             "check the dataset file or --limit")
    for eval_set in eval_sets:  # every task and decoder checked before the first decodes (hours, on real models)
        for decoder in decoders:
            task_stream(model, tokenizer, eval_set, decoder, batch_size=batch_size, chat=chat, head=head,
                        drafter=drafter)()
    if mesh is not None:
        model, head, drafter = (replicate_on(m, mesh) for m in (model, head, drafter))
    records, outputs = [], []
    total = sum(len(s.items) for s in eval_sets) * len(decoders)
    with tqdm(total=total, desc="eval", unit="prompt", disable=not progress, dynamic_ncols=True) as bar:
        for eval_set in eval_sets:
            for decoder in decoders:
                bar.set_postfix(task=eval_set.task, decoder=decoder)
                record, outs = evaluate_decoder(model, tokenizer, eval_set, decoder, model_name=model_name,
                                                batch_size=batch_size, mesh=mesh, seed=seed, chat=chat, warmup=warmup,
                                                bar=bar, head=head, drafter=drafter)
                records.append(record)
                outputs.extend(outs)
                if on_run is not None:
                    on_run(records, outputs)
    return records, outputs


def token_agreement(pairs) -> float:
    """The share of token positions where two generations hold the same token, over every
    (tokens, reference) pair, each pair's positions counted over its longer generation (a short
    row weighs what its tokens weigh, not what a long row weighs)."""
    same = sum(sum(a == b for a, b in zip(tokens, reference)) for tokens, reference in pairs)
    positions = sum(max(len(tokens), len(reference)) for tokens, reference in pairs)
    return same / positions if positions else 1.0


def compare_to(records: list[RunRecord], outputs: list[dict], reference: str) -> list[RunRecord]:
    """Records with their agreement with decoder `reference` on each task filled in (the fast mode
    against a lossless decoder's reference, PSD against its policy, ...). `reference` must be
    among the decoders run."""
    by_key = {(o["task"], o["decoder"], o["index"]): o["tokens"] for o in outputs}
    if not any(decoder == reference for _, decoder, _ in by_key):
        raise InputError(f"--compare-to {reference!r} was not run; name one of the decoders: "
                         f"{sorted({d for _, d, _ in by_key})}")
    for record in records:
        pairs = [(tokens, by_key[(task, reference, index)]) for (task, decoder, index), tokens in by_key.items()
                 if task == record.task and decoder == record.decoder]
        record.compared_to = reference
        record.identical_rows = sum(a == b for a, b in pairs) / len(pairs)
        record.token_agreement = token_agreement(pairs)
    return records
