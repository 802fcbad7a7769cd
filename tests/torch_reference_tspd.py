"""An independent PyTorch reference of an exported TSPD controller, from the specification.

ALGORITHMS.md section 4: a 2-layer MLP over a masked token's standardised trajectory features,
p = sigmoid(fc2(gelu(fc1((clamp(f, min, max) - mean) / std)))) with each feature clamped to the
range of the training traces, GELU in its tanh form; a token is committed when
p > the calibrated threshold (the progress guard aside). A Learn2PD-style "block" controller reads
the K confidences of a block and scores all K positions at once (fc2 has K outputs). The file is
read as PyTorch would hold it: torch.nn.Linear weights [out, in], named fc1.* / fc2.*, the
standardisation in feature_mean / feature_std, the range in feature_min / feature_max, the threshold and feature names in the metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from torch_reference_mrp import read_safetensors


class RefController(nn.Module):
    def __init__(self, num_features: int, hidden: int, outputs: int):
        super().__init__()
        self.fc1 = nn.Linear(num_features, hidden)
        self.fc2 = nn.Linear(hidden, outputs)
        self.register_buffer("feature_mean", torch.zeros(num_features))
        self.register_buffer("feature_std", torch.ones(num_features))
        self.register_buffer("feature_min", torch.full((num_features,), -torch.inf))
        self.register_buffer("feature_max", torch.full((num_features,), torch.inf))
        self.threshold = 0.5
        self.features: list[str] = []

    @classmethod
    def load(cls, path) -> "RefController":
        path = Path(path)
        if path.is_dir():
            path = path / "tspd_controller.safetensors"
        tensors = read_safetensors(path)
        raw = path.read_bytes()
        meta = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
        hidden, num_features = tensors["fc1.weight"].shape
        module = cls(num_features, hidden, tensors["fc2.weight"].shape[0])
        module.load_state_dict(tensors)
        module.threshold = float(meta["threshold"])
        module.features = json.loads(meta["features"])
        return module.eval()

    def forward(self, features):
        """Logits [..., outputs] for features [..., F]."""
        x = (features.clamp(self.feature_min, self.feature_max) - self.feature_mean) / self.feature_std
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))

    def commits(self, features):
        """Which tokens the controller lets through: sigmoid(logit) > threshold."""
        return torch.sigmoid(self(features)) > self.threshold
