"""Trace-aware decoders (ALGORITHMS.md section 4, seed 004): `tspd`, `ce` and `tspd+ce`.

Every decoder here keeps a per-token trajectory of the row's current block in the engine's carry
(`DecodeState.carry`, every leaf [B, ...]) and resets it when the row moves to another block.

Trajectory features (dlmjax.heads.controller.FEATURES; dlmjax.traces records the same ones), per
position of the current block, at each round (= each new set of logits for the block):
  confidence  probability of the proposed token (float32)
  entropy     entropy of the position's distribution
  momentum    confidence minus the confidence one round earlier (0 at the block's first round)
  stable      rounds in a row the argmax has not changed (0 at the first round or after a change)
  block_pos   index of the position in its block (0..K-1)
  abs_pos     the position's own token position in its row (counted from the row's first token)

TSPD: a small MLP (dlmjax.heads.controller) maps the features to P(argmax is final); commit the
masked positions with P > threshold (the controller's calibrated one unless given); where none
passes, the most confident one (progress guard: at least one token a round; `learn2pd` ORs its
filter with the top-1, as Learn2PD does).

CE (confidence extrapolation, training-free): per token a Kalman filter on x = [c, c_dot],
    x_t = A x_{t-1} + w, w ~ N(0, q I),   A = [[1, 1], [0, 1]];   z_t = c_t + v, v ~ N(0, r).
It is started from the first two observations (x = [c_1, c_1 - c_0], P = [[r, r], [r, 2r]]:
the two-point start, exact for a noiseless constant-velocity series) and afterwards predicts
and updates as usual. The k-step forecast is mean = c + k c_dot with variance P_k[0, 0] of
P_k = A P_{k-1} A^T + q I. Rules over the base policy (`ce`: confidence > tau; `tspd+ce`: the
controller):
  safe look-ahead: also commit a masked token whose forecast lower bound mean - z sqrt(var),
    `horizon` rounds ahead, is above tau (it will pass the threshold; commit it now);
  stabilisation: hold back a proposed commit whose velocity just changed sign by more than
    `osc_eps` (the trajectory oscillates) or whose forecast mean stays below `floor`
    (under-confident).
The progress guard runs last, so every round commits at least one token.

PSD over these policies: `depth=N` (default 1) drafts N steps of the policy per forward and
verifies them (dlmjax.decoding.psd): `tspd:controller=toy-sdar,depth=4`, `ce:tau=0.7,depth=4`,
`tspd+ce:controller=toy-sdar,depth=4`. Drafts assume the logits do not change (the trajectory
observes the same confidences again: momentum 0, stable + 1; the Kalman filter gets the same
confidence); verification replays the policy on each draft's real logits, so the output equals
depth=1 token for token with at most its forwards. Greedy only (temperature=0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from dlmjax.decoding import policies
from dlmjax.decoding.engine import Plan
from dlmjax.decoding.psd import DraftAndVerify
from dlmjax.decoding.spec import DecoderSpecError, DiffusionDecoder, register_decoder
from dlmjax.heads.controller import (
    BLOCK_FEATURES, FEATURES, ControllerMismatchError, load_controller, mlp_logits, mlp_outputs,
)
from dlmjax.models.transformer import take_rows
from dlmjax.validation import AT_LEAST_0, AT_LEAST_1, POSITIVE, PROBABILITY, STRICT_UNIT

# -- trajectory features ------------------------------------------------------------------------


@struct.dataclass
class Trajectory:
    """Per-row trajectory of the current block: block [B] (-1: none yet), the rest [B, K]."""

    block: jax.Array
    rounds: jax.Array  # int32 observations so far in this block
    confidence: jax.Array  # float32 last confidence
    token: jax.Array  # int32 last argmax
    stable: jax.Array  # int32

    @classmethod
    def init(cls, batch: int, k: int) -> "Trajectory":
        zeros = jnp.zeros((batch, k), jnp.int32)
        return cls(block=jnp.full((batch,), -1, jnp.int32), rounds=zeros, confidence=zeros.astype(jnp.float32),
                   token=zeros - 1, stable=zeros)


def reset_moved(tree, old_block_b, block_b, fresh_tree):
    """Rows whose block changed take `fresh_tree`'s values (the trajectory starts over)."""
    moved = old_block_b != block_b

    def pick(old, new):
        return jnp.where(moved.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)

    return jax.tree.map(pick, tree, fresh_tree)


def observe(traj: Trajectory, scores: policies.Scores, block_b, abs_pos_bk):
    """(features {name: [B, K] float32}, trajectory after this round). Rows that moved to another
    block start over."""
    b, k = scores.confidence.shape
    traj = reset_moved(traj, traj.block, block_b, Trajectory.init(b, k))
    seen = traj.rounds > 0
    same = seen & (scores.tokens == traj.token)
    stable = jnp.where(same, traj.stable + 1, 0)
    momentum = jnp.where(seen, scores.confidence - traj.confidence, 0.0)
    feats = {
        "confidence": scores.confidence.astype(jnp.float32),
        "entropy": scores.entropy.astype(jnp.float32),
        "momentum": momentum.astype(jnp.float32),
        "stable": stable.astype(jnp.float32),
        "block_pos": jnp.broadcast_to(jnp.arange(k, dtype=jnp.float32), (b, k)),
        "abs_pos": abs_pos_bk.astype(jnp.float32),
    }
    new = Trajectory(block=block_b.astype(jnp.int32), rounds=traj.rounds + 1, confidence=scores.confidence,
                     token=scores.tokens, stable=stable)
    return feats, new


def feature_matrix(feats: dict, names) -> jax.Array:
    """[..., F] in the order of `names`."""
    return jnp.stack([feats[n] for n in names], axis=-1)


def block_abs_pos(fwd, block_b):
    return take_rows(fwd.rows.positions, fwd.block_start(block_b), fwd.geometry.block)


# -- the Kalman filter (pure, elementwise over any leading shape) ---------------------------------


@struct.dataclass
class Kalman:
    x: jax.Array  # [..., 2] estimate [c, c_dot]
    p: jax.Array  # [..., 2, 2] its covariance
    n: jax.Array  # [...] int32 observations so far
    flipped: jax.Array  # [...] bool: the last update changed the velocity's sign by more than osc_eps

    @classmethod
    def init(cls, shape) -> "Kalman":
        return cls(x=jnp.zeros((*shape, 2), jnp.float32), p=jnp.zeros((*shape, 2, 2), jnp.float32),
                   n=jnp.zeros(shape, jnp.int32), flipped=jnp.zeros(shape, bool))


def _mat(rows):
    return jnp.asarray(rows, jnp.float32)


def kalman_predict(x, p, q: float):
    """(A x, A P A^T + q I) for A = [[1, 1], [0, 1]], written out elementwise (in the order a
    matmul sums them): no matmul, so no TF32 rounding or batch-shape-dependent kernel on an
    accelerator."""
    (p00, p01), (p10, p11) = (p[..., 0, 0], p[..., 0, 1]), (p[..., 1, 0], p[..., 1, 1])
    x_new = jnp.stack([x[..., 0] + x[..., 1], x[..., 1]], -1)
    row0 = jnp.stack([((p00 + p10) + (p01 + p11)) + q, p01 + p11], -1)
    row1 = jnp.stack([p10 + p11, p11 + q], -1)
    return x_new, jnp.stack([row0, row1], -2)


def kalman_update(state: Kalman, z, *, q: float, r: float, osc_eps: float = 0.0) -> Kalman:
    """One observation z [...] (float32): the two-point start for the first two, then predict + update."""
    z = z.astype(jnp.float32)
    # n == 0: x = [z, 0]; no covariance yet (a forecast before two observations has infinite
    # variance, and the two-point start replaces it)
    x0 = jnp.stack([z, jnp.zeros_like(z)], -1)
    p0 = jnp.zeros((*z.shape, 2, 2), jnp.float32)
    # n == 1: the two-point start
    x1 = jnp.stack([z, z - state.x[..., 0]], -1)
    p1 = jnp.broadcast_to(_mat(((r, r), (r, 2 * r))), (*z.shape, 2, 2))
    # n >= 2: predict, then update with H = [1, 0]
    xp, pp = kalman_predict(state.x, state.p, q)
    s = pp[..., 0, 0] + r
    gain = pp[..., :, 0] / s[..., None]  # P- H^T / S
    x2 = xp + gain * (z - xp[..., 0])[..., None]
    p2 = pp - gain[..., :, None] * pp[..., 0, None, :]  # (I - K H) P-
    n = state.n[..., None]
    x = jnp.where(n == 0, x0, jnp.where(n == 1, x1, x2))
    p = jnp.where(n[..., None] == 0, p0, jnp.where(n[..., None] == 1, p1, p2))
    v_old, v_new = state.x[..., 1], x[..., 1]
    flipped = (state.n >= 2) & (v_old * v_new < 0) & (jnp.abs(v_new - v_old) > osc_eps)
    return Kalman(x=x, p=p, n=state.n + 1, flipped=flipped)


def kalman_forecast(state: Kalman, horizon: int, *, q: float):
    """(mean [...], variance [...]) of the confidence `horizon` rounds ahead. Before two
    observations the velocity is unknown: variance is infinite."""
    # a loop, not `horizon` copies of the step: a long horizon would take minutes to compile
    x, p = jax.lax.fori_loop(0, horizon, lambda _, xp: kalman_predict(*xp, q), (state.x, state.p))
    var = jnp.where(state.n >= 2, p[..., 0, 0], jnp.inf)
    return x[..., 0], var


# -- decoders -----------------------------------------------------------------------------------


def _parse_features(spec: str) -> tuple[str, ...]:
    names = tuple(filter(None, spec.split("+")))
    if names == BLOCK_FEATURES:  # a block filter's one feature (learn2pd)
        return names
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise DecoderSpecError(f"features={spec!r}: unknown {unknown}; join names from {', '.join(FEATURES)} with '+' "
                               f"(a block filter: {BLOCK_FEATURES[0]})")
    return names


@dataclass(frozen=True)
class _TraceAware(DraftAndVerify, DiffusionDecoder):
    """Shared carry handling: the trajectory (and, for CE, the Kalman state) of each row's block.
    depth: PSD over this policy (dlmjax.decoding.psd) with `depth` drafts verified per forward;
    1 (the default) is the policy one step per forward. Greedy only above 1."""

    uses_controller: ClassVar[bool] = False
    uses_ce: ClassVar[bool] = False
    limits = {"depth": AT_LEAST_1}
    depth: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.depth > 1:
            self.refuse_sampling(f"depth={self.depth} is PSD, whose drafts cannot know future samples")

    def init_carry(self, fwd, batch: int):
        k = fwd.geometry.block
        carry = {"traj": Trajectory.init(batch, k)}
        if self.uses_ce:
            carry["kalman"] = Kalman.init((batch, k))
        if self.uses_controller:
            weights = self.weights()
            weights.check_model(fwd.model.config)
            weights.check_block(k)
        return carry

    def base_commit(self, feats, scores, masked_bk):
        raise NotImplementedError

    def select(self, scores, masked_bk):
        raise DecoderSpecError(f"{self.name} decides from per-token trajectories kept across rounds; it has no "
                               f"stateless commit set (PSD over it: its own option depth=N)")

    def policy_step(self, fwd, state, carry, scores, masked_bk):
        """Observe one round's scores: (commit set with the progress guard, next carry). A row whose
        block differs from its carry's starts its trajectory (and Kalman state) over."""
        old_block = carry["traj"].block
        feats, traj = observe(carry["traj"], scores, state.block, block_abs_pos(fwd, state.block))
        after = {"traj": traj}
        commit = self.base_commit(feats, scores, masked_bk)
        if self.uses_ce:
            kal = reset_moved(carry["kalman"], old_block, state.block, Kalman.init(masked_bk.shape))
            kal = kalman_update(kal, scores.confidence, q=self.q, r=self.r, osc_eps=self.osc_eps)
            commit = ce_rules(self, kal, commit, masked_bk)
            after["kalman"] = kal
        return policies.with_progress_guard(commit, scores, masked_bk), after


def ce_rules(cfg, kal: Kalman, commit_bk, masked_bk):
    """Safe look-ahead, then stabilisation (module docstring)."""
    mean, var = kalman_forecast(kal, cfg.horizon, q=cfg.q)
    if cfg.lookahead:
        lower = mean - cfg.z * jnp.sqrt(var)
        commit_bk = commit_bk | (masked_bk & (lower > cfg.tau))
    if cfg.stabilize:
        hold = kal.flipped | ((kal.n >= 2) & (mean < cfg.floor))
        commit_bk = commit_bk & ~hold
    return commit_bk & masked_bk


@dataclass(frozen=True)
class _CEOptions(DiffusionDecoder):
    """CE options: tau (threshold), horizon (forecast rounds), z (lower bound = mean - z std), q/r
    (process/measurement noise), lookahead/stabilize (the two rules), osc_eps (smallest velocity
    change that counts as oscillation), floor (forecast mean under which a commit is held)."""

    # tau 0 (as threshold 0 below): every masked token is above it, and the whole block commits at once
    limits = {"tau": STRICT_UNIT, "horizon": AT_LEAST_1, "z": AT_LEAST_0, "q": AT_LEAST_0,
              "r": POSITIVE, "osc_eps": AT_LEAST_0, "floor": PROBABILITY}
    tau: float = 0.9
    horizon: int = 2
    z: float = 1.0
    q: float = 1e-3
    r: float = 1e-2
    lookahead: bool = True
    stabilize: bool = True
    osc_eps: float = 0.05
    floor: float = 0.5


@dataclass(frozen=True)
class _ControllerOptions(DiffusionDecoder):
    """controller: a tspd_controller.safetensors file, a directory with one, or a preset that ships
    one (toy-sdar). threshold: commit where the controller's score (trained class-balanced: not
    P(final)) > threshold (default: its calibrated one). features: optional '+'-joined feature
    names, checked against the controller's."""

    limits = {"threshold": STRICT_UNIT}
    controller: str = ""
    threshold: float | None = None
    features: str = ""
    # the controller file's sha256 when the decoder was built: part of the decoder's identity (the
    # key of its compiled programs, which hold the weights), so a rewritten file compiles anew
    controller_sha256: str = field(default="", init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if not self.controller:
            if self.name == "learn2pd":  # a block filter; the one toy-sdar ships is a token controller
                raise DecoderSpecError(
                    "learn2pd needs controller=PATH: a block filter (features block_confidence), e.g. the toy one "
                    "in a checkout, controller=benchmarks/results/tspd_toy/learn2pd_filter.safetensors; train one "
                    "with `dlmjax traces --model MODEL --out DIR` then `dlmjax train configs/tspd/toy-sdar.yaml "
                    "backbone=MODEL tspd.traces=DIR \"tspd.features=[block_confidence]\" --out RUN` (then "
                    "controller=RUN/model)")
            raise DecoderSpecError(
                f"{self.name} needs controller=PATH: a tspd_controller.safetensors (toy-sdar ships one: "
                f"controller=toy-sdar); train one with `dlmjax traces --model MODEL --out DIR` then `dlmjax train "
                f"configs/tspd/toy-sdar.yaml backbone=MODEL tspd.traces=DIR --out RUN` (then controller=RUN/model)")
        names = _parse_features(self.features)
        try:
            weights = load_controller(self.controller)
            weights.check_features(names)
        except (OSError, ValueError) as exc:  # a missing or unreadable controller, or one of other features
            raise DecoderSpecError(f"{self.name}: {exc}") from None
        object.__setattr__(self, "controller_sha256", weights.sha256)

    def weights(self):
        weights = load_controller(self.controller)
        if weights.sha256 != self.controller_sha256:
            raise DecoderSpecError(f"{self.name}: controller {weights.path} was rewritten after this decoder was "
                                   "built; build the decoder again (e.g. parse_decoder of its spec)")
        return weights

    def check_kind(self, kind: str):
        w = self.weights()
        if w.kind != kind:
            fix = ("decoder learn2pd" if w.kind == "block" else "decoders tspd / tspd+ce")
            raise DecoderSpecError(f"{self.name}: controller {w.path} is a {w.kind} controller (features "
                                   f"{'+'.join(w.features)}); use it with {fix}")

    def controller_commit(self, feats, masked_bk):
        w = self.weights()
        prob = jax.nn.sigmoid(mlp_logits(w.jax_params(), feature_matrix(feats, w.features)))
        threshold = w.threshold if self.threshold is None else self.threshold
        return masked_bk & (prob > threshold)


@register_decoder
@dataclass(frozen=True)
class CE(_TraceAware, _CEOptions):
    """Confidence extrapolation over the threshold policy (training-free)."""

    name: ClassVar[str] = "ce"
    uses_ce: ClassVar[bool] = True

    def base_commit(self, feats, scores, masked_bk):
        return policies.threshold_commit(scores, masked_bk, self.tau)


@register_decoder
@dataclass(frozen=True)
class TSPD(_TraceAware, _ControllerOptions):
    """The learned per-token convergence controller."""

    name: ClassVar[str] = "tspd"
    uses_controller: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        self.check_kind("token")

    def base_commit(self, feats, scores, masked_bk):
        return self.controller_commit(feats, masked_bk)


@register_decoder
@dataclass(frozen=True)
class TSPDCE(_TraceAware, _ControllerOptions, _CEOptions):
    """TSPD's controller as the base policy, with CE's look-ahead and stabilisation (tau is the
    look-ahead's confidence threshold)."""

    name: ClassVar[str] = "tspd+ce"
    uses_controller: ClassVar[bool] = True
    uses_ce: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        self.check_kind("token")

    def base_commit(self, feats, scores, masked_bk):
        return self.controller_commit(feats, masked_bk)


@register_decoder
@dataclass(frozen=True)
class Learn2PD(_ControllerOptions):
    """A Learn2PD-style filter (the benchmark's baseline): one MLP over the block's K confidences
    (1.0 at positions not masked) scores every position; commit the masked ones above threshold,
    ORed with the static top-1 (as Learn2PD ORs its filter with the static pick). Train one with
    `tspd.features=[block_confidence]`."""

    name: ClassVar[str] = "learn2pd"

    def __post_init__(self):
        super().__post_init__()
        self.check_kind("block")

    def select(self, scores, masked_bk):
        w = self.weights()
        x = jnp.where(masked_bk, scores.confidence, 1.0)
        prob = jax.nn.sigmoid(mlp_outputs(w.jax_params(), x))
        threshold = w.threshold if self.threshold is None else self.threshold
        return masked_bk & ((prob > threshold) | policies.top_k_mask(scores.confidence, masked_bk, 1))

    def plan(self, fwd, state, tokens_bk, masked_bk, keys_b) -> Plan:
        w = self.weights()
        w.check_model(fwd.model.config)
        if w.params["fc1_w"].shape[1] != fwd.geometry.block:
            raise ControllerMismatchError(f"controller {w.path} reads blocks of {w.params['fc1_w'].shape[1]}, this "
                                          f"decode uses block {fwd.geometry.block}; set block= to match")
        return super().plan(fwd, state, tokens_bk, masked_bk, keys_b)
