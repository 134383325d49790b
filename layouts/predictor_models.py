"""The two model families the layout predictor's search chooses from: torch MLPs and XGBoost
boosted trees, their settings, and how each predicts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from maco.core.errors import MacoError

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh, "elu": nn.ELU}


@dataclass
class MLPConfig:
    """An architecture and its training: what the NAS chooses."""

    layers: int = 3
    width: int = 128
    activation: str = "silu"
    dropout: float = 0.0
    lr: float = 3e-3
    weight_decay: float = 1e-5
    batch_size: int = 64
    epochs: int = 300

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise MacoError(f"unknown activation {self.activation!r}; choose from {', '.join(ACTIVATIONS)}")
        if self.layers < 1 or self.width < 1 or self.epochs < 1 or self.batch_size < 1:
            raise MacoError(f"layers, width, epochs and batch_size must be positive: {self}")


def build_mlp(config: MLPConfig, n_in: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    width_in = n_in
    for _ in range(config.layers):
        mods += [nn.Linear(width_in, config.width), ACTIVATIONS[config.activation]()]
        if config.dropout > 0:
            mods.append(nn.Dropout(config.dropout))
        width_in = config.width
    mods.append(nn.Linear(width_in, 1))
    return nn.Sequential(*mods)


def mlp_predict(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(x, dtype=torch.float32))[:, 0].double().numpy()


MAX_LEAVES = 1 << 17  # trees x 2^depth: a booster stays ~3 MB gzipped, small enough to ship. On the
# committed data set the NAS's best under it picks 4.8% of clear layout pairs wrongly; boosters of
# 20-50 MB (JSON) picked 4.4-4.7%, not worth ten times the bytes
@dataclass
class TreeConfig:
    """Gradient-boosted trees (XGBoost) and their training. On the committed data set (5,038
    convs) they beat the NAS's MLPs on validation and place layout pairs better (fig13); a conv's
    time jumps where oneDNN's blocking or torch's backend changes, and splits follow jumps."""

    depth: int = 6
    trees: int = 1500
    lr: float = 0.05
    subsample: float = 0.8
    colsample: float = 0.8
    min_child_weight: float = 2.0

    def __post_init__(self) -> None:
        if self.depth < 1 or self.trees < 1 or not 0 < self.lr <= 1 or not 0 < self.subsample <= 1 \
                or not 0 < self.colsample <= 1 or self.min_child_weight < 0:
            raise MacoError(f"tree settings out of range: {self}")
        if self.trees << self.depth > MAX_LEAVES:
            raise MacoError(f"{self.trees} trees of depth {self.depth} exceed {MAX_LEAVES} leaves")

    def params(self, seed: int) -> dict[str, Any]:
        return {"max_depth": self.depth, "eta": self.lr, "subsample": self.subsample,
                "colsample_bytree": self.colsample, "min_child_weight": self.min_child_weight,
                "nthread": 1, "seed": seed, "objective": "reg:squarederror"}


def predict_one(model: Any, x: np.ndarray) -> np.ndarray:
    if isinstance(model, nn.Module):
        return mlp_predict(model, x)
    return np.asarray(model.inplace_predict(x), dtype=np.float64)
