"""Run several decoders over the same prompts and measure accuracy and speed.

Batches are padded to a fixed size (a multiple of the mesh's 'data' axis, repeating the last
prompt; the copies are dropped) so every batch of a task shares one compiled program, and the
batch is split over 'data' (data-parallel decoding). Each (task, decoder) first decodes its first
batch once untimed, so `wall_s` and tokens/s measure decoding, not compilation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from dlmjax.decoding.api import generate
from dlmjax.evaluation.tasks import EvalSet


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
    skipped_rows: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def default_decoders(model, head=None) -> list[str]:
    """AR for causal models; for diffusion models one token per step, the whole block at once,
    two confidence thresholds and PSD; with an MRP head also mrp-spec, mrp-direct, and mrp-remask
    beside threshold decoding at the same low tau (where threshold loses accuracy)."""
    if model.config.attention == "causal":
        return ["ar"]
    block = model.config.block_size or 32
    decoders = ["static", f"static:k={block}", "threshold:tau=0.9", "threshold:tau=0.7",
                "psd:policy=threshold,tau=0.9,depth=4"]
    if head is not None:
        decoders += ["mrp-spec:drafts=3", "mrp-direct:mrp_steps=1", "threshold:tau=0.2", "mrp-remask:tau=0.2,delta=0.5"]
    return decoders


def replicate_on(model, mesh):
    """Put the model's (or head's) params on every device of `mesh` (data-parallel decoding)."""
    if model is None:
        return None
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, NamedSharding(mesh, P())))


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _batches(items, batch_size: int):
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        yield chunk, chunk + [chunk[-1]] * (batch_size - len(chunk))


def evaluate_decoder(model, tokenizer, eval_set: EvalSet, decoder: str, *, model_name: str, batch_size: int,
                     mesh=None, seed: int = 0, chat: bool = False, warmup: bool = True, bar=None, head=None):
    """(RunRecord, per-prompt outputs) for one decoder (a SPEC string, used as its label) on one task."""
    prompts = {item.index: item.prompt for item in eval_set.items}
    if chat:
        prompts = {i: tokenizer.apply_chat_template([{"role": "user", "content": p}]) for i, p in prompts.items()}

    def run(padded):
        return generate(model, [prompts[it.index] for it in padded], tokenizer=tokenizer, decoder=decoder,
                        max_new_tokens=eval_set.max_new_tokens, seed=seed, row_ids=[it.index for it in padded],
                        mesh=mesh, head=head)

    if warmup:  # compile outside the timed runs
        run(next(_batches(eval_set.items, batch_size))[1])
    outputs, wall, nfe, committed, generated, correct = [], 0.0, 0, 0.0, 0, 0
    for chunk, padded in _batches(eval_set.items, batch_size):
        result = run(padded)
        rows = result.rows[: len(chunk)]
        wall += result.wall_s * len(chunk) / len(padded)  # padding rows do not count
        scores = eval_set.score(chunk, [row.text for row in rows])
        for item, row, ok in zip(chunk, rows, scores):
            nfe += row.nfe
            committed += row.tpf * row.nfe
            generated += row.num_tokens
            correct += bool(ok)
            outputs.append({"task": eval_set.task, "decoder": decoder, "index": item.index,
                            "tokens": row.tokens, "text": row.text, "correct": bool(ok)})
        if bar is not None:
            bar.update(len(chunk))
    n = len(eval_set.items)
    record = RunRecord(
        task=eval_set.task, decoder=decoder, model=model_name, n=n, accuracy=correct / n,
        nfe=nfe / n, tpf=committed / max(nfe, 1), useful_tpf=generated / max(nfe, 1),
        tokens_per_s=generated / max(wall, 1e-9), wall_s=wall, skipped_rows=len(eval_set.skipped),
    )
    return record, outputs


def run_eval(model, tokenizer, eval_sets: list[EvalSet], decoders: list[str], *, model_name: str,
             batch_size: int = 64, mesh=None, seed: int = 0, chat: bool = False, progress: bool = True,
             warmup: bool = True, head=None):
    """Every decoder on every task: (records, outputs). Without `warmup`, times include compilation.
    `head`: the MRP head for mrp-* decoders."""
    for eval_set in eval_sets:
        if not eval_set.items:
            raise ValueError(f"{eval_set.task}: no usable prompts ({len(eval_set.skipped)} rows skipped); "
                             "check the dataset file or --limit")
    data = mesh.shape["data"] if mesh is not None else 1
    if mesh is not None:
        model, head = replicate_on(model, mesh), replicate_on(head, mesh)
    records, outputs = [], []
    total = sum(len(s.items) for s in eval_sets) * len(decoders)
    with tqdm(total=total, desc="eval", unit="prompt", disable=not progress, dynamic_ncols=True) as bar:
        for eval_set in eval_sets:
            size = _round_up(min(batch_size, len(eval_set.items)), data)
            for decoder in decoders:
                bar.set_postfix(task=eval_set.task, decoder=decoder)
                record, outs = evaluate_decoder(model, tokenizer, eval_set, decoder, model_name=model_name,
                                                batch_size=size, mesh=mesh, seed=seed, chat=chat, warmup=warmup,
                                                bar=bar, head=head)
                records.append(record)
                outputs.extend(outs)
    return records, outputs
