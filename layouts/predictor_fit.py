"""Training the layout predictor's models of one chosen config on standardised features and log
labels: MLPs (AdamW) or one booster, on one torch thread."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.layouts.latency import ConversionModel
from maco.layouts.predictor import LatencyPredictor, ReferenceSpeed
from maco.layouts.predictor_features import features
from maco.layouts.predictor_models import MLPConfig, TreeConfig, build_mlp

def train_mlp(config: MLPConfig, x: np.ndarray, y: np.ndarray, *, seed: int = 0,
              report: Callable[[int, nn.Module], bool] | None = None,
              report_every: int = 10) -> nn.Sequential:
    """AdamW with cosine-annealed learning rate on MSE of standardised inputs and target.
    `report(epoch, model)` is called (model in eval mode) every `report_every` epochs;
    returning True stops training early (the NAS pruner's hook)."""
    torch.manual_seed(seed)
    model = build_mlp(config, x.shape[1])
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=config.epochs)
    xt, yt = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32)[:, None]
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(1, config.epochs + 1):
        model.train()
        perm = torch.randperm(len(xt), generator=gen)
        for i in range(0, len(xt), config.batch_size):
            idx = perm[i:i + config.batch_size]
            loss = nn.functional.mse_loss(model(xt[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
        if report is not None and epoch % report_every == 0:
            model.eval()
            if report(epoch, model):
                break
    return model.eval()


@contextmanager
def one_thread() -> Iterator[None]:
    """Small MLPs train ~4x faster on one torch thread than on two busy cores (no fork-join)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def train_trees(config: TreeConfig, x: np.ndarray, y: np.ndarray, *, seed: int = 0) -> Any:
    """An XGBoost booster on standardised inputs and target (one thread, as the MLPs train)."""
    import xgboost as xgb

    return xgb.train(config.params(seed), xgb.DMatrix(x, label=y), num_boost_round=config.trees)


def fit_predictor(specs: Sequence[ConvSpec], layouts: Sequence[str], labels: np.ndarray,
                  config: MLPConfig | TreeConfig, *, ensemble: int = 1, seed: int = 0, device: str = "cpu",
                  conversion: ConversionModel | None = None, meta: dict[str, Any] | None = None,
                  label: str = "seconds", reference: ReferenceSpeed | None = None) -> LatencyPredictor:
    """Train `ensemble` MLPs of one config (different seeds), or one booster, on all the given rows'
    `labels` (seconds, or ratios to the reference with `reference` its speed over the same rows)."""
    labels = np.asarray(labels, dtype=float)
    if len(specs) < 2 or len(specs) != len(labels) or not np.all(labels > 0):
        raise MacoError(f"need >= 2 rows with positive {label}, got {len(specs)} rows")
    x = features(specs, layouts)
    x_mean, x_std = x.mean(axis=0), x.std(axis=0)
    x_std[x_std == 0] = 1.0
    y = np.log(labels)
    y_mean, y_std = float(y.mean()), float(y.std() or 1.0)
    xs, ys = (x - x_mean) / x_std, (y - y_mean) / y_std
    if isinstance(config, TreeConfig):  # one booster: boosters of other seeds added size, not accuracy
        train, ensemble = train_trees, 1
    else:
        train = train_mlp
    with one_thread():
        models = [train(config, xs, ys, seed=seed + i) for i in range(ensemble)]
    return LatencyPredictor(config, x_mean, x_std, y_mean, y_std, models, device, conversion,
                            meta or {}, label, reference)
