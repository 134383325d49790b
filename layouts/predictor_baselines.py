"""The models the paper compares the layout predictor with (SVR, linear regression, gradient-boosted
trees, XGBoost), on the raw latency target as the paper did or on the log target."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.layouts.predictor_features import features


def baseline_models(seed: int = 0) -> dict[str, Any]:
    """The paper's comparison models (scikit-learn), each behind a feature scaler, and XGBoost."""
    from sklearn.ensemble import GradientBoostingRegressor
    from sklearn.linear_model import LinearRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVR

    from xgboost import XGBRegressor

    return {"SVR": make_pipeline(StandardScaler(), SVR()),
            "linear": make_pipeline(StandardScaler(), LinearRegression()),
            "GBRT": GradientBoostingRegressor(random_state=seed),
            # boosted trees set up to win, not as sklearn's defaults: many deep, shrunk, subsampled trees
            "XGBoost": XGBRegressor(n_estimators=2000, max_depth=8, learning_rate=0.03, subsample=0.8,
                                    colsample_bytree=0.8, min_child_weight=2, n_jobs=1, random_state=seed)}


def fit_baseline(model: Any, specs: Sequence[ConvSpec], layouts: Sequence[str],
                 seconds: np.ndarray, target: str) -> Callable[[Sequence[ConvSpec], Sequence[str]], np.ndarray]:
    """Fit on `target` "raw" (raw features, seconds: the paper's setting) or "log" (log
    features, log seconds); returns a function giving predicted seconds."""
    if target not in ("raw", "log"):
        raise MacoError(f"target must be 'raw' or 'log', got {target!r}")
    log = target == "log"
    y = np.log(seconds) if log else np.asarray(seconds, float)
    model.fit(features(specs, layouts, log=log), y)

    def predict(s: Sequence[ConvSpec], lays: Sequence[str]) -> np.ndarray:
        p = model.predict(features(s, lays, log=log))
        return np.exp(p) if log else p

    return predict
