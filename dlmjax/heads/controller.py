"""The TSPD controller (ALGORITHMS.md section 4): a 2-layer MLP that reads a masked token's
trajectory features and gives the probability that its current argmax is already final.

    f      = clamp(features, feature_min, feature_max)         # the range seen in the training traces
    x      = (f - feature_mean) / feature_std                  # standardised on the training traces
    logit  = fc2(gelu(fc1(x)))                                 # fc1: F -> hidden, fc2: hidden -> 1
    p      = sigmoid(logit)

The feature set is configurable: any ordered subset of `FEATURES` (dlmjax.traces records all of
them). The checkpoint is one safetensors file in PyTorch layout (`torch.nn.Linear` weights are
[out, in]): `fc1.weight`, `fc1.bias`, `fc2.weight`, `fc2.bias`, `feature_mean`, `feature_std`,
`feature_min`, `feature_max`; its metadata holds `format: pt`, the feature names, the calibrated
threshold, the fingerprint of the model whose traces trained it and the block those traces were
decoded in (a decode in another block is refused: `block_pos` would lie outside what it saw). In
PyTorch:

    sd = safetensors.torch.load_file(path)
    x = (f.clamp(sd["feature_min"], sd["feature_max"]) - sd["feature_mean"]) / sd["feature_std"]
    p = torch.sigmoid(F.linear(F.gelu(F.linear(x, sd["fc1.weight"], sd["fc1.bias"]), approximate="tanh"),
                               sd["fc2.weight"], sd["fc2.bias"]))

The clamp keeps a feature inside the range the controller was trained on: an MLP's output past
it is an extrapolation (a controller trained on 48-token toy answers gave a score of 1 to every
token past position 200, whatever its confidence). A file without `feature_min`/`feature_max`
(written before they existed) is read unclamped.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dlmjax import arithmetic
from dlmjax.io.files import file_sha256
from dlmjax.io.safetensors import CheckpointError, SafetensorsFile, save_file
from dlmjax.validation import STRICT_UNIT, InputError

FEATURES = ("confidence", "entropy", "momentum", "stable", "block_pos", "abs_pos")
# A Learn2PD-style filter (kind "block"): one MLP over the K confidences of the block (committed and
# prompt positions read 1.0) that scores all K positions at once; its feature set is this one name.
BLOCK_FEATURES = ("block_confidence",)
KINDS = ("token", "block")
CONTROLLER_FILE = "tspd_controller.safetensors"  # listed in io.hf.SIDE_FILES: not a weight shard of its model
FORMAT_VERSION = "1"


class ControllerMismatchError(InputError):
    """A controller used with features or a model it was not trained for."""


def check_features(features) -> tuple[str, ...]:
    features = tuple(features)
    if features == BLOCK_FEATURES:
        return features
    unknown = [f for f in features if f not in FEATURES]
    if not features or unknown or len(set(features)) != len(features):
        raise InputError(f"controller features {list(features)}: give a non-empty list of distinct names from "
                         f"{', '.join(FEATURES)}, or {list(BLOCK_FEATURES)} alone (the Learn2PD block filter)")
    return features


def model_fingerprint(config) -> dict:
    """What a controller (and its traces) is tied to: the backbone's shape-defining config."""
    return {"family": config.family, "vocab_size": int(config.vocab_size), "hidden_size": int(config.hidden_size),
            "num_layers": int(config.num_layers), "block_size": config.block_size,
            "mask_token_id": int(config.mask_token_id)}


def mlp_outputs(params: dict, x):
    """The controller's pure numerics: params {fc1_w [H, F], fc1_b, fc2_w [O, H], fc2_b, mean, std,
    lo, hi} (PyTorch layout), x [..., F] raw features -> logits [..., O] (float32). Row by row
    (`arithmetic.rowwise`): in invariant mode a row's output does not depend on its batch."""
    return arithmetic.rowwise(_mlp_rows, x, weights=(params,))


def _mlp_rows(x, params: dict):
    x = (jnp.clip(x.astype(jnp.float32), params["lo"], params["hi"]) - params["mean"]) / params["std"]
    h = jax.nn.gelu(x @ params["fc1_w"].T + params["fc1_b"], approximate=True)
    return h @ params["fc2_w"].T + params["fc2_b"]


def mlp_logits(params: dict, x):
    """A per-token controller's logits [...] (one output)."""
    return mlp_outputs(params, x)[..., 0]


class Controller(nnx.Module):
    """The trainable MLP; `mean`/`std` (standardisation) and `lo`/`hi` (each feature's range) are
    fixed buffers set from the training traces."""

    def __init__(self, num_features: int, hidden: int = 32, *, outputs: int = 1, seed: int = 0, mean=None, std=None,
                 lo=None, hi=None):
        rngs = nnx.Rngs(seed)
        k1, k2 = jax.random.split(rngs.params())
        self.fc1_w = nnx.Param(jax.random.normal(k1, (hidden, num_features)) / np.sqrt(num_features))
        self.fc1_b = nnx.Param(jnp.zeros((hidden,)))
        self.fc2_w = nnx.Param(jax.random.normal(k2, (outputs, hidden)) / np.sqrt(hidden))
        self.fc2_b = nnx.Param(jnp.zeros((outputs,)))
        self.mean = nnx.Variable(jnp.zeros((num_features,)) if mean is None else jnp.asarray(mean, jnp.float32))
        self.std = nnx.Variable(jnp.ones((num_features,)) if std is None else jnp.asarray(std, jnp.float32))
        self.lo = nnx.Variable(jnp.full((num_features,), -jnp.inf) if lo is None else jnp.asarray(lo, jnp.float32))
        self.hi = nnx.Variable(jnp.full((num_features,), jnp.inf) if hi is None else jnp.asarray(hi, jnp.float32))

    def params(self) -> dict:
        return {name: getattr(self, name)[...] for name in _TORCH_NAMES}

    def __call__(self, x):
        params = self.params()  # the buffers are fixed: no gradient, so AdamW leaves them as they are
        for name in _BUFFERS:
            params[name] = jax.lax.stop_gradient(params[name])
        out = mlp_outputs(params, x)
        return out[..., 0] if out.shape[-1] == 1 else out


_TORCH_NAMES = {"fc1_w": "fc1.weight", "fc1_b": "fc1.bias", "fc2_w": "fc2.weight", "fc2_b": "fc2.bias",
                "mean": "feature_mean", "std": "feature_std", "lo": "feature_min", "hi": "feature_max"}
_BUFFERS = ("mean", "std", "lo", "hi")
_UNBOUNDED = {"lo": -np.inf, "hi": np.inf}  # a file from before the range was stored


@dataclass(frozen=True)
class ControllerWeights:
    """A loaded controller: host arrays (PyTorch layout) and its metadata."""

    params: dict
    features: tuple[str, ...]
    threshold: float
    model: dict  # model_fingerprint of the traces' model
    path: str = ""
    block: int | None = None  # the block its traces were decoded in (None: a file from before it was stored)
    sha256: str = ""  # of the file's bytes: which version of the file these are

    @property
    def kind(self) -> str:
        return "block" if self.features == BLOCK_FEATURES else "token"

    @property
    def hidden(self) -> int:
        return int(self.params["fc1_w"].shape[0])

    def jax_params(self) -> dict:
        return {k: jnp.asarray(v, jnp.float32) for k, v in self.params.items()}

    def check_model(self, config) -> None:
        fp = model_fingerprint(config)
        if fp != self.model:
            diff = {k: (self.model.get(k), fp[k]) for k in fp if self.model.get(k) != fp[k]}
            raise ControllerMismatchError(
                f"controller {self.path or ''} was trained on traces of another model (trained on vs this one: "
                f"{diff}); collect traces with this model (`dlmjax traces`) and train a controller on them")

    def check_block(self, block: int) -> None:
        if self.block is not None and block != self.block:
            raise ControllerMismatchError(
                f"controller {self.path or ''} was trained on traces decoded in blocks of {self.block}; this decode "
                f"uses block {block}: decode with block={self.block}, or collect traces at block {block} "
                "(`dlmjax traces --block`) and train a controller on them")

    def check_features(self, features) -> None:
        if features and tuple(features) != self.features:
            raise ControllerMismatchError(
                f"controller {self.path or ''} reads features {'+'.join(self.features)}, the decoder asks for "
                f"{'+'.join(features)}; drop the decoder's features= option or train a controller on that set")


def shape_problems(params: dict, features) -> list[str]:
    """What is wrong with the shapes of a controller's tensors (PyTorch layout) for `features`: a
    token controller reads the F named features and gives one logit; a block filter
    (BLOCK_FEATURES) reads a block's K confidences and gives K. Empty when they fit."""
    hidden, width = params["fc1_w"].shape
    if features != BLOCK_FEATURES and width != len(features):
        return [f"fc1.weight {params['fc1_w'].shape} reads {width} inputs, and {len(features)} features are named"]
    outputs = width if features == BLOCK_FEATURES else 1
    expected = {"fc1_b": (hidden,), "fc2_w": (outputs, hidden), "fc2_b": (outputs,), **{b: (width,) for b in _BUFFERS}}
    return [f"{_TORCH_NAMES[name]} is {tuple(params[name].shape)}, expected {shape}"
            for name, shape in expected.items() if tuple(params[name].shape) != shape]


def value_problems(params: dict, threshold) -> list[str]:
    """What is wrong with a controller's values: its threshold must lie in (0, 1) as the decoders'
    `threshold=` must (0 commits every masked token at once; 1 or NaN none, leaving the decode to
    the one-token guard), its feature scales be positive and its ranges ordered. Empty when fine."""
    problems = []
    number = isinstance(threshold, (int, float, np.floating)) and not isinstance(threshold, bool)
    if not number or threshold not in STRICT_UNIT:  # the decoders' `threshold=` limit
        problems.append(f"threshold {threshold!r} is not {STRICT_UNIT}")
    for name in ("fc1_w", "fc1_b", "fc2_w", "fc2_b", "mean"):
        if not np.all(np.isfinite(params[name])):
            problems.append(f"{_TORCH_NAMES[name]} holds values that are not finite")
    if not np.all(np.asarray(params["std"]) > 0) or not np.all(np.isfinite(params["std"])):
        problems.append("feature_std holds values that are not positive and finite")
    if np.any(np.asarray(params["lo"]) > np.asarray(params["hi"])) or np.any(np.isnan(params["lo"])) \
            or np.any(np.isnan(params["hi"])):
        problems.append("feature_min exceeds feature_max (or is NaN) for some feature")
    return problems


def save_controller(controller: Controller | dict, path: str | Path, *, features, threshold: float, model: dict,
                    block: int | None = None) -> Path:
    """Write the controller as one safetensors file in PyTorch layout (module docstring); `block`:
    the block its traces were decoded in."""
    params = controller.params() if isinstance(controller, Controller) else controller
    features = check_features(features)
    problems = shape_problems(params, features) or value_problems(params, threshold)
    if problems:
        raise InputError(f"controller for features {list(features)}: {'; '.join(problems)}")
    path = Path(path)
    if path.suffix != ".safetensors":
        path = path / CONTROLLER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {_TORCH_NAMES[k]: np.asarray(v, np.float32) for k, v in params.items()}
    save_file(tensors, path, metadata={"format": "pt", "dlmjax_controller": FORMAT_VERSION,
                                       "features": json.dumps(list(features)), "threshold": repr(float(threshold)),
                                       "model": json.dumps(model, sort_keys=True),
                                       **({"block": str(int(block))} if block is not None else {})})
    return path


def resolve_controller_path(name: str | Path) -> Path:
    """A .safetensors file, a directory holding `tspd_controller.safetensors`, or a preset name
    whose checkpoint ships one (toy-sdar)."""
    path = Path(name)
    if path.is_dir():
        path = path / CONTROLLER_FILE
    elif not path.exists() and path.suffix != ".safetensors":
        from dlmjax.presets import preset_names, resolve_model

        if str(name) in preset_names():
            path = resolve_model(str(name), "TSPD controller") / CONTROLLER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no TSPD controller at {name} ({path}); pass a tspd_controller.safetensors file or a directory with one "
            "(train one: dlmjax traces ... then dlmjax train configs/tspd/toy-sdar.yaml)")
    return path


def load_controller(name: str) -> ControllerWeights:
    """The controller stored at `name` (see `resolve_controller_path`), parsed once per content of
    the file (a controller re-trained into the same path in this process is read again)."""
    path = resolve_controller_path(name).resolve()
    return _read_controller(str(path), file_sha256(path))


@functools.lru_cache(maxsize=16)
def _read_controller(path: str, sha256: str) -> ControllerWeights:
    path = Path(path)
    f = SafetensorsFile(path)
    meta = f.metadata
    if meta.get("dlmjax_controller") is None:
        raise CheckpointError(f"{path} is not a TSPD controller (no dlmjax_controller metadata)")
    params = {}
    for ours, theirs in _TORCH_NAMES.items():
        if theirs in f.keys():
            params[ours] = np.array(f.get(theirs), np.float32)
        elif ours in _UNBOUNDED:
            params[ours] = np.full(f.get("feature_mean").shape, _UNBOUNDED[ours], np.float32)
        else:
            raise CheckpointError(f"{path}: TSPD controller is missing tensor {theirs!r}")
    features = check_features(json.loads(meta["features"]))
    problems = shape_problems(params, features)
    if problems:
        raise CheckpointError(f"{path} does not hold the controller its metadata names: {'; '.join(problems)}")
    threshold = float(meta["threshold"])
    problems = value_problems(params, threshold)
    if problems:
        raise CheckpointError(f"{path} is not a usable TSPD controller: {'; '.join(problems)}; retrain it (dlmjax "
                              "train configs/tspd/...) or fix the file")
    return ControllerWeights(params=params, features=features, threshold=threshold,
                             model=json.loads(meta["model"]), path=str(path),
                             block=int(meta["block"]) if "block" in meta else None, sha256=sha256)


def controller_module(weights: ControllerWeights) -> Controller:
    """A loaded controller as a trainable module (e.g. to fine-tune it)."""
    module = Controller(weights.params["fc1_w"].shape[1], weights.hidden, outputs=weights.params["fc2_w"].shape[0])
    for name, value in weights.params.items():
        getattr(module, name)[...] = jnp.asarray(value)
    return module


def export_controller(source: str | Path, out: str | Path) -> Path:
    """`dlmjax export`: copy a controller (file, directory or preset) to `out` (a .safetensors
    path or a directory), re-validated, in PyTorch layout."""
    w = load_controller(str(source))
    return save_controller(w.params, out, features=w.features, threshold=w.threshold, model=w.model, block=w.block)
