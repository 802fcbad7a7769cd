"""Decoder configurations and the `NAME:key=value,...` spec strings that select them.

Each decoder is a frozen dataclass (hashable: it is a static argument of the jitted loop).
`parse_decoder("threshold:tau=0.8")` builds one; an unknown name or option is an error that
lists the valid ones. Later decoders (MRP, PSD, TSPD) register the same way.

Every option is typed (its annotation) and ranged (the class's `limits`, dlmjax.validation): a
decoder built from a spec or in Python with a value out of range raises `DecoderSpecError`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp

from dlmjax.decoding import policies
from dlmjax.decoding.engine import Plan
from dlmjax.validation import (AT_LEAST_0, AT_LEAST_1, INT32_MAX, OPEN_UNIT, STEPS, InputError, OneOf, Range,
                               check_fields, check_value, limits_of)

CACHE_MODES = ("none", "prefix", "dual")


class DecoderSpecError(InputError):
    """A decoder spec that names an unknown decoder or option, or a bad value."""


@dataclass(frozen=True)
class DiffusionDecoder:
    """Options every diffusion decoder shares.

    temperature: 0 is greedy; otherwise Gumbel-max sampling at this temperature.
    top_p: nucleus filter for sampling, applied to the tempered logits.
    sampled_scores: when sampling, confidence, entropy and margin are those of the tempered,
      filtered distribution the token was drawn from (Dream's sample_tokens; LLaDA2's default);
      off, those of the untempered logits (LLaDA's generate()).
    block: decoding block size; default: the model's block_size (block-causal models must use
      it), 32 for bidirectional models.
    cache: bidirectional models only: none (exact: full forward each step), prefix or dual
      (Fast-dLLM approximations: prefix KV, or prefix and suffix KV, recomputed once per block).
    no_eos: never propose the model config's EOS ids (LLaDA's `logits_eos_inf`: LLaDA-8B-Instruct's
      SFT data pads answers with EOS; its end-of-turn token stays allowed).
    eos_last: positions proposing a stop token (EOS or end of turn) rank last: their confidence is
      taken with the stop tokens' logits at -inf (LLaDA's `confidence_eos_eot_inf`, as its greedy
      generate() applies it). no_eos: static, threshold, entropy and psd; eos_last: those of them
      that rank by confidence (`ranks_by_confidence`).
    """

    name: ClassVar[str] = ""
    eos_options: ClassVar[bool] = False  # whether no_eos / eos_last reach this decoder's scores
    limits = {"temperature": AT_LEAST_0, "top_p": OPEN_UNIT, "block": AT_LEAST_1, "cache": OneOf(CACHE_MODES)}
    temperature: float = 0.0
    top_p: float = 1.0
    sampled_scores: bool = False
    block: int | None = None
    cache: str = "none"
    no_eos: bool = False
    eos_last: bool = False

    def __post_init__(self):
        """Every option's type and range (`limits`, merged with the subclasses'); integers fit
        int32, the type they are traced as."""
        check_fields(self, f"{self.name}: ", error=DecoderSpecError)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value > INT32_MAX:
                raise DecoderSpecError(f"{self.name}: {f.name}={value} must be <= {INT32_MAX} (an int32 on the device)")
        refuse_idle_sampling_options(self)
        if (self.no_eos or self.eos_last) and not self.eos_options:
            raise DecoderSpecError(f"{self.name}: no_eos and eos_last are options of static, threshold, entropy and "
                                   "psd only; drop them or pick one of those decoders")
        if self.eos_last and self.eos_options and not self.ranks_by_confidence():
            raise DecoderSpecError(f"{self.name}: eos_last ranks stop tokens last by confidence, and this decoder "
                                   "ranks positions by entropy or margin; drop eos_last or rank by confidence")

    def ranks_by_confidence(self) -> bool:
        """Whether this decoder picks positions by their confidence (what `eos_last` changes)."""
        return True

    def select(self, scores: policies.Scores, masked_bk):
        """This step's commit set [B, K] (before the progress guard)."""
        raise NotImplementedError

    def remask(self, scores: policies.Scores, commit_bk, masked_bk):
        """Hook for decoders that veto proposed commits (MRP remask, TSPD): return the commits
        to keep. The default keeps them all. The progress guard runs after it."""
        return commit_bk

    def commit_set(self, scores: policies.Scores, masked_bk):
        """`select`, then `remask`, then the progress guard: every row with a masked position
        commits at least one."""
        chosen = self.remask(scores, self.select(scores, masked_bk), masked_bk)
        return policies.with_progress_guard(chosen, scores, masked_bk)

    def refuse_sampling(self, why: str):
        """A greedy-only decoder (`why` it is) refuses a temperature (top_p and sampled_scores at
        temperature 0 every decoder refuses: `refuse_idle_sampling_options`)."""
        if self.temperature != 0.0:
            raise DecoderSpecError(f"{self.name} is greedy (temperature=0): {why}")

    def scores_from_hidden(self, model) -> bool:
        """Whether this decoder's rounds need greedy scores only, never the logits (greedy), and
        `residual_argmax` runs as a kernel here: the engine then keeps no [B, K, V] logits and
        scores hidden states (`BlockForwards.block_scores`)."""
        from dlmjax import kernels

        return (self.temperature == 0.0 and not (self.no_eos or self.eos_last)
                and kernels.choose("residual_argmax") is not None)

    def scores(self, fwd, state, keys_b) -> policies.Scores:
        """Proposed tokens and their confidences from each row's latest logits (or, with
        `scores_from_hidden`, its hidden state)."""
        if self.temperature == 0.0:
            return fwd.block_scores(state.logits, state.hidden)
        return policies.score(state.logits, mask_id=fwd.mask_id, temperature=self.temperature, top_p=self.top_p,
                              keys_b=keys_b, sampled_scores=self.sampled_scores, banned=fwd.banned_ids,
                              last=fwd.last_ids)

    def init_carry(self, fwd, batch: int):
        """The decoder's own per-row state carried from round to round (`DecodeState.carry`, every
        leaf [B, ...]; `plan` returns the one after its commits in `Plan.carry`, `resolve` the one
        after the forward). None: the decoder keeps none."""
        return None

    def plan(self, fwd, state, tokens_bk, masked_bk, keys_b) -> Plan:
        """The round before its forward (engine.decode_round): commit `commit_set` from the latest
        logits; the forward then evaluates the block as it is after the commits."""
        scores = self.scores(fwd, state, keys_b)
        after = jnp.where(self.commit_set(scores, masked_bk), scores.tokens, tokens_bk)
        return Plan(tokens=after, copies=after[:, None])

    def resolve(self, fwd, state, plan: Plan, logits_bnkv, hidden_bnkd):
        """The round after its forward: (block tokens, seed logits, seed hidden, carry) of each row
        that forwarded copies. `plan.carry` is the carry after the plan (the engine fills in
        `DecodeState.carry` when the plan kept it); return it unless the forward changes it (PSD
        over a stateful policy). Policy decoders keep their commits and seed from the one copy."""
        return plan.tokens, logits_bnkv[:, 0], hidden_bnkd[:, 0], plan.carry


@dataclass(frozen=True)
class Static(DiffusionDecoder):
    """Commit the k most confident masked positions per step (k=1: the quality reference).

    order: what "most confident" ranks by: `confidence` (the token's probability; LLaDA's
    low_confidence, Dream's maskgit_plus), `margin` (top-1 minus top-2 probability; Dream's
    topk_margin) or `entropy` (lowest first; Dream's alg="entropy").
    steps: instead of k, denoise each block in this many steps, step i of a block committing the
    i-th count of `schedule` (`policies.step_counts`): `even` (LLaDA's, SDAR's: block // steps a
    step, the remainder on the first steps) or `linear` (Dream's). LLaDA's generate(steps=S,
    gen_length=G, block_length=K) is `static:block=K,steps=S*K/G`; Dream's diffusion_generate(steps=S)
    with max_new_tokens=G is `static:block=G,steps=S,schedule=linear`. Steps that would commit
    nothing are left out (the reference forwards the same canvas again there)."""

    name: ClassVar[str] = "static"
    eos_options: ClassVar[bool] = True
    limits = {"k": AT_LEAST_1, "order": OneOf(policies.STATIC_ORDERS), "steps": STEPS,
              "schedule": OneOf(policies.STEP_SCHEDULES)}
    k: int = 1
    order: str = "confidence"
    steps: int | None = None
    schedule: str = "even"

    def __post_init__(self):
        super().__post_init__()
        if self.steps is not None and self.k != 1:
            raise DecoderSpecError(f"static: k={self.k} and steps={self.steps} both set how many positions a step "
                                   "commits; give one of them")
        if self.steps is None and self.schedule != "even":
            raise DecoderSpecError(f"static: schedule={self.schedule} spreads a block over `steps` steps; give steps "
                                   "too (e.g. steps=32)")

    def ranks_by_confidence(self) -> bool:
        return self.order == "confidence"

    def select(self, scores, masked_bk):
        return policies.static_commit(scores, masked_bk, self.k, order=self.order)

    def init_carry(self, fwd, batch: int):
        if self.steps is None:
            return None
        zeros = jnp.zeros((batch,), jnp.int32)
        return {"block": zeros - 1, "step": zeros}  # block -1: the first round starts the row's block afresh

    def plan(self, fwd, state, tokens_bk, masked_bk, keys_b) -> Plan:
        if self.steps is None:
            return super().plan(fwd, state, tokens_bk, masked_bk, keys_b)
        step = jnp.where(state.carry["block"] != state.block, 0, state.carry["step"])  # 0: the row moved on
        counts = policies.scheduled_counts(policies.step_counts(fwd.geometry.block, self.steps, self.schedule), step)
        scores = self.scores(fwd, state, keys_b)
        chosen = policies.static_commit(scores, masked_bk, counts, order=self.order)
        after = jnp.where(policies.with_progress_guard(chosen, scores, masked_bk), scores.tokens, tokens_bk)
        carry = {"block": state.block, "step": step + jnp.any(masked_bk, axis=-1)}
        return Plan(tokens=after, copies=after[:, None], carry=carry)


@dataclass(frozen=True)
class Threshold(DiffusionDecoder):
    """Commit every masked position with confidence > tau, and always the most confident one.

    Strictly above tau, as ALGORITHMS.md and Fast-dLLM v2 have it; Fast-dLLM v1's LLaDA code
    commits confidence >= tau, which differs only at an exact tie (with tau=1: positions whose
    probability rounds to 1.0 commit together there, one a step here)."""

    name: ClassVar[str] = "threshold"
    eos_options: ClassVar[bool] = True
    limits = {"tau": OPEN_UNIT}  # tau = 0 would commit the whole block at once
    tau: float = 0.9

    def select(self, scores, masked_bk):
        return policies.threshold_commit(scores, masked_bk, self.tau)


@dataclass(frozen=True)
class Entropy(DiffusionDecoder):
    """Entropy-bounded (the EB sampler's idea, Ben-Hamu et al.; the spec lists it among dInfer's
    cheap extras): commit masked positions in order of increasing entropy while their summed
    entropy, this one's included, stays <= gamma; always at least the lowest-entropy one. (The EB
    sampler leaves the last one's entropy out of the sum, and SDAR's JetEngine compares with <:
    at one gamma the three commit slightly different sets.)"""

    name: ClassVar[str] = "entropy"
    eos_options: ClassVar[bool] = True
    limits = {"gamma": AT_LEAST_0}  # 0: the lowest-entropy position per step (with any of entropy exactly 0)
    gamma: float = 0.5

    def ranks_by_confidence(self) -> bool:
        return False

    def select(self, scores, masked_bk):
        return policies.entropy_commit(scores, masked_bk, self.gamma)


def refuse_idle_sampling_options(decoder) -> None:
    """top_p and sampled_scores shape sampling: at temperature 0 (greedy) they would do nothing, yet
    the decoder's name would carry them into every result; refuse them there."""
    fields = {f.name: f.default for f in dataclasses.fields(decoder)}
    idle = [f"{name}={getattr(decoder, name)}" for name in ("top_p", "sampled_scores")
            if name in fields and getattr(decoder, name) != fields[name]]
    if decoder.temperature == 0.0 and idle:
        raise DecoderSpecError(f"{decoder.name}: {', '.join(idle)}: top_p and sampled_scores shape sampling, and "
                               "temperature=0 is greedy; set temperature > 0 or remove them")


@dataclass(frozen=True)
class AR:
    """Plain autoregressive decoding with a KV cache (causal models only)."""

    name: ClassVar[str] = "ar"
    limits = {"temperature": AT_LEAST_0, "top_p": OPEN_UNIT}
    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        check_fields(self, f"{self.name}: ", error=DecoderSpecError)
        refuse_idle_sampling_options(self)


@dataclass(frozen=True)
class DrafterDecoding:
    """Speculative decoding of a causal target with a left-to-right diffusion drafter (DFlash
    format, `dlmjax.decoding.speculative`): greedy output equals `ar`'s token for token; sampled
    output keeps the target's distribution (rejection sampling).

    block: the drafter's block K (default its own block_size; K - 1 proposals per target forward).
    """

    name: ClassVar[str] = "drafter"
    limits = {"block": Range(2), "temperature": AT_LEAST_0, "top_p": OPEN_UNIT}  # block: the last token + 1 proposal
    block: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        check_fields(self, f"{self.name}: ", error=DecoderSpecError)
        refuse_idle_sampling_options(self)


CAUSAL_DECODERS = (AR, DrafterDecoding)  # the decoders of causal (autoregressive) models
DECODERS: dict[str, type] = {cls.name: cls for cls in (Static, Threshold, Entropy, AR, DrafterDecoding)}


def decoder_spec(decoder) -> str:
    """The spec string that rebuilds `decoder` (only options that differ from the defaults)."""
    changed = [
        f"{f.name}={getattr(decoder, f.name)}"
        for f in dataclasses.fields(decoder)
        if f.init and getattr(decoder, f.name) != f.default
    ]
    return decoder.name + (":" + ",".join(changed) if changed else "")


def spec_key(spec: str) -> tuple:
    """What a spec decodes with, whatever its spelling: its class and every option's value, given
    or default (`threshold` and `threshold:tau=0.90` have one key). Builds nothing."""
    cls, options = parse_options(spec)
    return cls, tuple((f.name, options.get(f.name, f.default)) for f in dataclasses.fields(cls) if f.init)


def distinct_specs(specs: list[str]) -> list[str]:
    """`specs` without repeats, two spellings of one decoder (tau=0.9, tau=0.90) being one: the
    first spelling stays."""
    distinct: dict[tuple, str] = {}
    for spec in specs:
        distinct.setdefault(spec_key(spec), spec)
    return list(distinct.values())


def register_decoder(cls: type) -> type:
    """Class decorator for decoders defined in their own modules (MRP, PSD, TSPD); the package's
    __init__ imports each module, so they are registered whenever dlmjax.decoding is."""
    DECODERS[cls.name] = cls
    return cls


# what an option's number may look like: Python's int()/float() would also read `1_0` (10) or `+3`
_NUMBER = {"int": re.compile(r"-?\d+"), "float": re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|-?inf|nan", re.I)}


def _convert(value: str, annotation, field: str, decoder: str):
    kinds = {"int": int, "float": float, "str": str, "bool": _parse_bool}
    kind = str(annotation).replace(" | None", "").strip()
    try:
        if kind in _NUMBER and not _NUMBER[kind].fullmatch(value.strip()):
            raise ValueError(value)
        return kinds[kind](value) if kind in kinds else value
    except ValueError:
        raise DecoderSpecError(f"{decoder}: option {field}={value!r} is not a valid {kind}") from None


def _parse_bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise ValueError(value)


def decoder_names() -> list[str]:
    """All registered decoders (dlmjax.decoding's __init__ imports every decoder module)."""
    return sorted(DECODERS)


def parse_decoder(spec: str):
    """`NAME` or `NAME:key=value,key=value` -> a decoder config."""
    cls, options = parse_options(spec)
    return cls(**options)


def parse_options(spec: str) -> tuple[type, dict]:
    """A spec's decoder class and its options, each named, typed and within its range, before the
    decoder is built (a TSPD decoder reads its controller file when built)."""
    if not isinstance(spec, str):
        raise DecoderSpecError(f"decoder {spec!r} is neither a spec string (e.g. 'threshold:tau=0.9') nor a decoder "
                               f"config; valid decoders: {', '.join(decoder_names())}")
    name, _, options = spec.strip().partition(":")
    name = name.strip()
    if name not in DECODERS:
        raise DecoderSpecError(f"unknown decoder {name!r}; valid decoders: {', '.join(decoder_names())}")
    cls = DECODERS[name]
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    limits = limits_of(cls)
    kwargs = {}
    for item in filter(None, (o.strip() for o in options.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq:
            raise DecoderSpecError(f"{name}: option {item!r} needs the form key=value")
        if key not in fields:
            raise DecoderSpecError(f"{name}: unknown option {key!r}; valid options: {', '.join(fields)}")
        if key in kwargs:
            raise DecoderSpecError(f"{name}: option {key!r} is given twice; keep one")
        kwargs[key] = check_value(f"{name}: {key}", _convert(value, fields[key].type, key, name), fields[key].type,
                                  limits.get(key), error=DecoderSpecError)
    return cls, kwargs
