"""Training a layout predictor on a data set's rows: the label (ratios to the reference where the
rows have them), the NAS's choice of model, that model retrained on every row as an ensemble."""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from maco.core.errors import MacoError
from maco.layouts.latency import ConversionModel
from maco.layouts.predictor import LABELS, LatencyPredictor, ReferenceSpeed
from maco.layouts.predictor_fit import fit_predictor
from maco.layouts.predictor_search import search_config


def row_labels(rows: Sequence[Any], label: str | None = None
               ) -> tuple[str, np.ndarray, ReferenceSpeed | None]:
    """(label, each row's label, the reference speed over the rows) for data set rows: ratios
    where every row has one (label None or "ratio"), else seconds."""
    if label is None:
        label = "ratio" if rows and all(r.ratio is not None for r in rows) else "seconds"
    if label not in LABELS:
        raise MacoError(f"label must be one of {LABELS}, got {label!r}")
    if label == "seconds":
        return label, np.array([r.seconds for r in rows]), None
    missing = sum(r.ratio is None for r in rows)
    if missing:
        raise MacoError(f"{missing} of {len(rows)} rows were timed without the reference and have no "
                        "ratio: collect them again, or train on seconds")
    reference = ReferenceSpeed.fit(np.array([r.spec.flops for r in rows], float),
                                   np.array([r.timing.reference for r in rows]))
    return label, np.array([r.ratio for r in rows]), reference


def train_predictor(rows: Sequence[Any], *, trials: int = 30, epochs: int = 200,
                    timeout: float | None = None, ensemble: int = 3, seed: int = 0,
                    device: str = "cpu", conversion: ConversionModel | None = None,
                    progress: bool = True, label: str | None = None) -> LatencyPredictor:
    """NAS on the given data set rows (layouts.dataset.Row) of one device, then the best config
    retrained on all of them as an ensemble; on ratios where the rows have them (row_labels)."""
    rows = [r for r in rows if r.device == device]
    if len(rows) < 10:
        raise MacoError(f"need at least 10 rows measured on {device!r} to train, got {len(rows)}")
    specs, lays = [r.spec for r in rows], [r.layout for r in rows]
    label, values, reference = row_labels(rows, label)
    start = time.perf_counter()
    config, study = search_config(specs, lays, values, trials=trials, epochs=epochs, timeout=timeout,
                                  seed=seed, progress=progress)
    meta = {"rows": len(rows), "trials": len(study.trials), "nas_best_val_mse": study.best_value,
            "nas_seconds": time.perf_counter() - start}
    return fit_predictor(specs, lays, values, config, ensemble=ensemble, seed=seed, device=device,
                         conversion=conversion, meta=meta, label=label, reference=reference)
