"""The layout predictor's NAS (Optuna: TPE sampler, Hyperband pruner for the MLPs): which model
family, architecture and training fit a data set's rows best on a spec-grouped validation part."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from torch import nn

from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.layouts.predictor_features import features
from maco.layouts.predictor_fit import one_thread, train_mlp, train_trees
from maco.layouts.predictor_metrics import split_by_spec
from maco.layouts.predictor_models import ACTIVATIONS, MAX_LEAVES, MLPConfig, TreeConfig, mlp_predict, predict_one

FAMILIES = ("mlp", "trees")
# The NAS's widest layer: 5 hidden layers of 256 in a 3-model ensemble save to ~3 MB, small
# enough to keep a trained predictor in the repository.
MAX_WIDTH = 256


@dataclass(frozen=True)
class _Standardised:
    """The rows' features and log labels, standardised on the training part, split in two."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray


def search_config(specs: Sequence[ConvSpec], layouts: Sequence[str], labels: np.ndarray, *,
                  trials: int = 30, epochs: int = 200, timeout: float | None = None,
                  val_fraction: float = 0.2, seed: int = 0, progress: bool = True,
                  families: Sequence[str] = FAMILIES) -> tuple[MLPConfig | TreeConfig, Any]:
    """Optuna NAS: TPE over the model family, then for an MLP its depth, width, activation,
    dropout, learning rate, weight decay and batch size (Hyperband prunes MLPs whose validation
    loss lags), for boosted trees their depth, count, learning rate, subsampling and leaf weight;
    all on log `labels` (seconds or ratios). The validation rows are a spec-grouped part of the
    given rows (both layouts of a conv on one side). Returns the best config (an MLP's with
    `epochs`) and the study."""
    import optuna

    data = _standardise(specs, layouts, labels, val_fraction, seed)
    report_every = max(1, epochs // 20)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise MacoError(f"model families must be among {', '.join(FAMILIES)}, got {list(families)!r}")

    def objective(trial: "optuna.Trial") -> float:
        if trial.suggest_categorical("family", list(families)) == "trees":
            return _tree_trial(trial, data, seed)
        return _mlp_trial(trial, data, seed, epochs, report_every)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.HyperbandPruner(min_resource=report_every, max_resource=epochs,
                                              reduction_factor=3))
    with one_thread():
        study.optimize(objective, n_trials=trials, timeout=timeout, show_progress_bar=progress)
    best = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not best:
        raise MacoError("the NAS completed no trial; give it more trials or time")
    params = dict(study.best_params)
    if params.pop("family", "mlp") == "trees":
        return _tree_config(params), study
    return MLPConfig(**params, epochs=epochs), study


def _standardise(specs: Sequence[ConvSpec], layouts: Sequence[str], labels: np.ndarray,
                 val_fraction: float, seed: int) -> _Standardised:
    train_idx, val_idx = split_by_spec(specs, val_fraction, seed)
    x = features(specs, layouts)
    mean, std = x[train_idx].mean(axis=0), x[train_idx].std(axis=0)
    std[std == 0] = 1.0
    x = (x - mean) / std
    y = np.log(np.asarray(labels, dtype=float))
    ym, ysd = y[train_idx].mean(), y[train_idx].std() or 1.0
    y = (y - ym) / ysd
    return _Standardised(x[train_idx], y[train_idx], x[val_idx], y[val_idx])


def _val_loss(predicted: np.ndarray, data: _Standardised) -> float:
    """Mean squared error on the validation rows; a diverged model's counts as 1e9."""
    loss = float(np.mean((predicted - data.y_val) ** 2))
    return loss if math.isfinite(loss) else 1e9


def _tree_trial(trial: Any, data: _Standardised, seed: int) -> float:
    trees = _tree_config({
        "tree_depth": trial.suggest_int("tree_depth", 3, 10),
        "tree_count": trial.suggest_int("tree_count", 100, 4000, log=True),
        "tree_lr": trial.suggest_float("tree_lr", 0.01, 0.2, log=True),
        "tree_subsample": trial.suggest_float("tree_subsample", 0.5, 1.0),
        "tree_colsample": trial.suggest_float("tree_colsample", 0.5, 1.0),
        "tree_min_child": trial.suggest_float("tree_min_child", 0.5, 10.0, log=True)})
    booster = train_trees(trees, data.x_train, data.y_train, seed=seed)
    return _val_loss(predict_one(booster, data.x_val), data)


def _mlp_trial(trial: Any, data: _Standardised, seed: int, epochs: int, report_every: int) -> float:
    """One MLP, reporting its validation loss every `report_every` epochs to Hyperband, which
    may prune it."""
    import optuna

    config = MLPConfig(
        layers=trial.suggest_int("layers", 1, 5),
        width=trial.suggest_int("width", 16, MAX_WIDTH, log=True),
        activation=trial.suggest_categorical("activation", sorted(ACTIVATIONS)),
        dropout=trial.suggest_float("dropout", 0.0, 0.3),
        lr=trial.suggest_float("lr", 1e-4, 3e-2, log=True),
        weight_decay=trial.suggest_float("weight_decay", 1e-8, 1e-2, log=True),
        batch_size=trial.suggest_categorical("batch_size", [32, 64, 128, 256]),
        epochs=epochs)

    def report(epoch: int, model: nn.Module) -> bool:
        trial.report(_val_loss(mlp_predict(model, data.x_val), data), epoch)
        return trial.should_prune()

    model = train_mlp(config, data.x_train, data.y_train, seed=seed, report=report, report_every=report_every)
    if trial.should_prune():
        raise optuna.TrialPruned()
    return _val_loss(mlp_predict(model, data.x_val), data)


def _tree_config(params: dict[str, Any]) -> TreeConfig:
    """The searched settings, the tree count cut to MAX_LEAVES at that depth."""
    depth = params["tree_depth"]
    return TreeConfig(depth=depth, trees=min(params["tree_count"], MAX_LEAVES >> depth), lr=params["tree_lr"],
                      subsample=params["tree_subsample"], colsample=params["tree_colsample"],
                      min_child_weight=params["tree_min_child"])
