"""Training a drafter on a frozen causal target (objective `drafter`, ALGORITHMS.md section 3).

One step, per batch of rows (tokens, valid, target [B, L]):

1. one frozen target forward gives its hidden states at the drafter's layer ids (the context
   features of every position) and, for self-distillation, its greedy next-token predictions;
2. `anchors_per_row` anchors a are drawn per row among the generated positions (a >= the first
   target position, with at least one label after it);
3. every anchor makes a block [x_a, MASK x (K - 1)] at positions a .. a + K - 1, and all blocks
   of a row run in one drafter forward: a block sees the context strictly before its anchor and
   its own tokens (bidirectionally), nothing of other blocks;
4. block position k >= 1 is labelled with the target's greedy prediction for position a + k
   (`labels: target`, self-distillation) or with the data token x_{a+k} (`labels: data`);
   position 0 is the given token and never supervised, nor are labels past the row's end;
5. the losses of dlmjax.losses, composed by `LossWeights`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dlmjax.decoding.ar import greedy_tokens
from dlmjax.heads.drafter import Drafter, context_features, visibilities
from dlmjax.losses import LabelScores, LossWeights, drafter_loss, label_scores_from_hidden
from dlmjax.models.transformer import Transformer

LABELS = ("target", "data")


@dataclass(frozen=True)
class DrafterTrainSpec:
    block_size: int
    anchors_per_row: int
    labels: str = "target"
    weights: LossWeights = LossWeights()


def sample_anchors(key, valid_bl, target_bl, n: int):
    """(anchors [B, n] int32, anchor_ok [B, n] bool): distinct random positions a with target[a]
    (a generated position) and valid[a + 1] (at least one label). Rows with fewer than n such
    positions get their extra anchors marked not ok, and so do the anchors past a batch narrower
    than n (a batch's width follows its rows)."""
    b, l = valid_bl.shape
    next_valid = jnp.concatenate([valid_bl[:, 1:], jnp.zeros((b, 1), bool)], axis=1)
    allowed = target_bl & next_valid
    score = jnp.where(allowed, jax.random.uniform(key, (b, l)), -1.0)
    _, anchors = jax.lax.top_k(score, min(n, l))
    ok = jnp.take_along_axis(allowed, anchors, axis=1)
    extra = ((0, 0), (0, n - anchors.shape[1]))
    return jnp.pad(anchors.astype(jnp.int32), extra), jnp.pad(ok, extra)


def block_inputs(tokens_bl, valid_bl, labels_bl, anchors_bn, ok_bn, *, block: int, mask_id: int):
    """Block tokens, positions, labels and label mask, each [B, n, K]."""
    l = tokens_bl.shape[1]
    k = jnp.arange(block, dtype=jnp.int32)
    pos = anchors_bn[..., None] + k  # [B, n, K]
    inside = pos < l
    idx = jnp.minimum(pos, l - 1).reshape(pos.shape[0], -1)
    gather = lambda x: jnp.take_along_axis(x, idx, axis=1).reshape(pos.shape)  # noqa: E731
    first = jnp.take_along_axis(tokens_bl, anchors_bn, axis=1)
    blk = jnp.where(k == 0, first[..., None], mask_id)
    labels = gather(labels_bl)
    mask = (k > 0) & inside & gather(valid_bl) & ok_bn[..., None]
    return blk, pos, labels, mask


def drafter_hidden(drafter: Drafter, target: Transformer, blk_bnk, pos_bnk, feats_blf, valid_bl):
    """Draft hidden states [B, n, K, D] (the target's lm_head makes their logits): every block of a
    row in one forward, each seeing the context before its anchor and its own block only."""
    b, n, k = blk_bnk.shape
    l = feats_blf.shape[1]
    ctx_pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    ctx_kv = drafter.context_kv(drafter.context(feats_blf), ctx_pos)
    q_pos = pos_bnk.reshape(b, n * k)
    group = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, k)).reshape(1, n * k)
    anchor = jnp.broadcast_to(pos_bnk[..., :1], (b, n, k)).reshape(b, n * k)
    ctx_vis, blk_vis = visibilities(drafter.config, q_pos, jnp.broadcast_to(group, (b, n * k)), ctx_pos, anchor, valid_bl)
    h = drafter(drafter.embed(target, blk_bnk.reshape(b, n * k)), q_pos, ctx_kv, ctx_vis, blk_vis)
    return h.reshape(b, n, k, -1)


def target_pass(target: Transformer, cfg, tokens_bl, valid_bl):
    """Frozen target: (context features [B, L, n_ids * D], greedy next-token predictions [B, L]
    shifted so that entry t is the target's prediction for position t). The predictions come
    through `greedy_tokens`: where residual_argmax runs as a kernel, the [B, L, V] logits of a
    training batch (40 GB at Qwen3's vocabulary, batch 16, 4,096 tokens) are never made."""
    out = target(tokens_bl, valid_bl=valid_bl, hidden_layers=cfg.hidden_layers, compute_logits=False)
    feats = jax.lax.stop_gradient(context_features(target, cfg, out.layer_hidden))
    pred = greedy_tokens(target, jax.lax.stop_gradient(out.hidden))  # pred[t] predicts position t + 1
    pred_at = jnp.concatenate([tokens_bl[:, :1], pred[:, :-1]], axis=1)
    return feats, jax.lax.stop_gradient(pred_at)


def drafter_train_loss(drafter: Drafter, target: Transformer, batch, key, *, spec: DrafterTrainSpec):
    """(loss, metrics) for one batch; `target` is frozen (no gradient flows into it)."""
    if spec.labels not in LABELS:
        raise ValueError(f"drafter labels {spec.labels!r}; choose one of {', '.join(LABELS)}")
    cfg = drafter.config
    tokens, valid, gen = batch["tokens"], batch["valid"], batch["target"]
    feats, predicted = target_pass(target, cfg, tokens, valid)
    labels_src = predicted if spec.labels == "target" else tokens
    anchors, ok = sample_anchors(key, valid, gen, spec.anchors_per_row)
    blk, pos, labels, mask = block_inputs(tokens, valid, labels_src, anchors, ok, block=spec.block_size,
                                          mask_id=cfg.mask_token_id)
    hidden = drafter_hidden(drafter, target, blk, pos, feats, valid)
    scores = label_scores_from_hidden(hidden, target.lm_logits, labels)
    loss, parts = drafter_loss(scores, mask, spec.weights)
    metrics = {"loss": loss, **parts, **acceptance_metrics(scores, mask)}
    return loss, metrics


def acceptance_metrics(scores: LabelScores, mask):
    """Greedy acceptance that these blocks would get from a target whose choices are the labels:
    `accept_len` = 1 + the accepted prefix (mean over blocks), `top1` = per-position accuracy."""
    right = scores.right & mask
    m = mask.astype(jnp.float32)
    prefix = jnp.cumprod(jnp.where(mask, right, False)[..., 1:], axis=-1).sum(axis=-1)
    blocks = jnp.any(mask, axis=-1).astype(jnp.float32)
    return {
        "top1": jnp.sum(right * m) / jnp.maximum(jnp.sum(m), 1.0),
        "accept_len": jnp.sum((1.0 + prefix) * blocks) / jnp.maximum(jnp.sum(blocks), 1.0),
    }


# ----------------------------------------------------------------------------------------------
# The training loop's view of a drafter run (dlmjax.train.loop.Trainee)


def spec_from_run(run) -> DrafterTrainSpec:
    d = run.drafter
    weights = LossWeights(ce_weight=d.ce_weight, decay_gamma=d.decay_gamma, focal_alpha=d.focal_alpha,
                          focal_gamma=d.focal_gamma, chain_alpha=d.chain_alpha)
    return DrafterTrainSpec(block_size=d.block_size, anchors_per_row=d.anchors_per_row, labels=d.labels,
                            weights=weights)


def load_target(name: str, *, toy_data: bool = True, mesh=None):
    """(checkpoint dir, causal target on `mesh`, tokenizer) of a drafter run; the toy tasks
    (`toy_data`) need the toy tokenizer."""
    from dlmjax.io.hf import load_config, load_model
    from dlmjax.io.tokenizer import load_tokenizer
    from dlmjax.presets import resolve_model
    from dlmjax.train.config import RunConfigError
    from dlmjax.train.loop import is_toy_tokenizer

    try:
        ckpt_dir = resolve_model(name, "model")
    except FileNotFoundError as exc:
        raise RunConfigError(f"backbone: {exc}") from None
    cfg = load_config(ckpt_dir)
    if cfg.attention != "causal":
        raise RunConfigError(f"backbone {name} has {cfg.attention} attention; a drafter speculates for a causal "
                             "(autoregressive) target such as toy-ar")
    tokenizer = load_tokenizer(ckpt_dir, cfg)
    if toy_data and not is_toy_tokenizer(tokenizer):
        raise RunConfigError(f"backbone {name}'s tokenizer is not the toy character tokenizer that the toy tasks "
                             "are written in; train on its own data (data.files: JSONL prompt/response rows) or "
                             "train toy drafters on toy-ar")
    return ckpt_dir, load_model(ckpt_dir, mesh=mesh), tokenizer


def drafter_config_for(run, target: Transformer, tokenizer):
    from dlmjax.heads.drafter import DrafterConfig
    from dlmjax.train.loop import TRAINED_DTYPE

    d = run.drafter
    mask = d.mask_token_id
    if mask is None:
        mask = target.config.mask_token_id if target.config.mask_token_id is not None else tokenizer.mask_id
    if mask is None:
        from dlmjax.train.config import RunConfigError

        raise RunConfigError(f"the target ({target.config.family}) names no mask token: set drafter.mask_token_id "
                             f"(a token id < {target.config.vocab_size} the target never emits, e.g. an unused special "
                             "token)")
    ids = tuple(d.target_layer_ids) if d.target_layer_ids else None
    return DrafterConfig.for_target(target.config, num_layers=d.num_layers, block_size=d.block_size,
                                    target_layer_ids=ids, mask_token_id=mask, dtype=TRAINED_DTYPE)


def eval_prompts(tasks, file_tasks, tokenizer, n: int) -> dict[str, tuple[list[list[int]], int]]:
    """{task or file's name: (prompt ids, max_new_tokens)} that a drafter run evaluates on: the
    first n prompts of each toy task's eval set, or of each file's rows (generating as many tokens
    as the longest of their answers, and EOS)."""
    from dlmjax.evaluation.tasks import load_eval_set

    out = {}
    for task in sorted(tasks):
        if file_tasks is None:
            eval_set = load_eval_set(task, limit=n)
            out[task] = [tokenizer.encode(item.prompt) for item in eval_set.items], eval_set.max_new_tokens
        else:
            examples = file_tasks[task].examples[:n]
            out[file_tasks[task].name] = ([tokenizer.encode_prompt(ex.prompt) for ex in examples],
                                          max(len(tokenizer.encode(ex.target)) for ex in examples) + 1)
    return out


def mean_accepted_length(drafter: Drafter, target: Transformer, tokenizer, prompts: dict) -> dict:
    """{task: mean accepted length} of greedy speculative decoding on `prompts` (`eval_prompts`)."""
    from dlmjax.decoding.speculative import generate_with_drafter

    out = {}
    for task, (ids, max_new_tokens) in prompts.items():
        res = generate_with_drafter(target, drafter, ids, max_new_tokens=max_new_tokens,
                                    eos_ids=(tokenizer.eos_id,), pad_id=target.config.pad_token_id or 0)
        out[task] = res.mean_accepted_length
    return out


def drafter_trainee(run, run_dir, mesh=None):
    """A drafter (`run.drafter`) for the frozen target `run.backbone` (loaded onto `frozen_mesh`);
    eval logs its mean accepted length on the first `drafter.eval_prompts` prompts per task or file."""
    from functools import partial

    from dlmjax.heads.drafter import abstract_drafter, check_compatible, init_drafter
    from dlmjax.io.dflash import save_drafter
    from dlmjax.train.loop import Trainee, data_tasks, frozen_mesh, pad_id_of

    _, target, tokenizer = load_target(run.backbone, toy_data=not run.data.files, mesh=frozen_mesh(mesh))
    tasks = data_tasks(run, tokenizer, target, None)
    dcfg = drafter_config_for(run, target, tokenizer)
    check_compatible(dcfg, target.config)
    loss = partial(drafter_train_loss, spec=spec_from_run(run))
    prompts = eval_prompts(run.data.weights, tasks, tokenizer, run.drafter.eval_prompts)

    def evaluate(drafter, target):
        scores = mean_accepted_length(drafter, target, tokenizer, prompts)
        return {f"eval/{task}/accept_len": v for task, v in scores.items()}

    def export(drafter, run_dir):
        from dlmjax.io.files import staged_dir

        with staged_dir(run_dir / "drafter") as stage:  # replaces an earlier export only when complete
            save_drafter(drafter, stage, dtype=run.drafter.export_dtype)
        return run_dir / "drafter"

    return Trainee(
        build=lambda: init_drafter(dcfg, seed=run.train.seed), abstract=abstract_drafter(dcfg), frozen=target,
        loss=loss, tokenizer=tokenizer, block=None, pad_id=pad_id_of(target.config, tokenizer), evaluate=evaluate,
        export=export, tasks=tasks,
    )
