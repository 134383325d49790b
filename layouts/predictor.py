"""The layout latency predictor as planners use it: seconds of a conv in a layout from an ensemble
of MLPs or of XGBoost boosted trees on features of the conv and the layout (predictor_features),
predicting log latency, or log of the latency over the FMA reference timed in the same rounds
(the label that repeats across the VM's spells; seconds again with the reference speed measured
where it is used); saved to and loaded from a folder, checked before use. Training is
predictor_training (NAS in predictor_search), its command predictor_cli, its yardsticks
predictor_metrics and predictor_baselines.

    rows = maco.layouts.dataset.load_rows("results/dataset_cpu.csv")
    pred = maco.layouts.predictor_training.train_predictor(rows, trials=40)
    pred.predict(spec, "NHWC")  # seconds (a ratio-trained one at the speed it was trained at)
    latency_sources.at_speed_now(pred)  # ... or at the FMA reference's speed measured now
    pred.save("results/predictor_cpu"); LatencyPredictor.load("results/predictor_cpu")
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import pickle
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from maco.core.errors import MacoError
from maco.core.files import load_json, load_json_file, read_bytes, write_atomic
from maco.core.spec import ConvSpec
from maco.core.xgb_check import load_booster
from maco.layouts.latency import ConversionModel, predict_conversion
from maco.layouts.predictor_features import FEATURES, features
from maco.layouts.predictor_models import MLPConfig, TreeConfig, build_mlp, predict_one

FORMAT_VERSION = 1
LABELS = ("seconds", "ratio")  # what the MLPs learn: log seconds, or log of seconds over the reference
MAX_MODEL_BYTES = 256 << 20  # the ensemble's weights: a few MB in practice


@dataclass(frozen=True)
class ReferenceSpeed:
    """The FMA reference's seconds for `flops`: a fixed start-up (its OpenMP fork and join) plus
    the flops at `gflops`. Turns a ratio label back into seconds."""

    gflops: float
    overhead: float = 0.0  # seconds

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gflops) and self.gflops > 0 and math.isfinite(self.overhead)
                and self.overhead >= 0):
            raise MacoError(f"a reference speed needs gflops > 0 and overhead >= 0, got "
                            f"gflops={self.gflops!r}, overhead={self.overhead!r}")

    def seconds(self, flops: np.ndarray) -> np.ndarray:
        return self.overhead + np.asarray(flops, float) / (self.gflops * 1e9)

    @classmethod
    def fit(cls, flops: np.ndarray, reference: np.ndarray) -> "ReferenceSpeed":
        """Least squares of the references timed beside the data set's convs on their flops."""
        flops, reference = np.asarray(flops, float), np.asarray(reference, float)
        a = np.vstack([np.ones_like(flops), flops]).T
        (overhead, per_flop), *_ = np.linalg.lstsq(a, reference, rcond=None)
        if per_flop <= 0:
            raise MacoError("the references do not grow with the flops: cannot fit their speed")
        return cls(1e-9 / per_flop, max(0.0, float(overhead)))


@dataclass
class LatencyPredictor:
    """Seconds of a conv in a layout, from an ensemble of MLPs or of boosted trees (the search
    chooses) predicting standardised log latency or log ratio to the reference (their mean in
    log space), plus an optional conversion-cost model. A ratio predictor turns ratios into
    seconds at `reference`."""

    config: MLPConfig | TreeConfig
    x_mean: np.ndarray
    x_std: np.ndarray
    y_mean: float
    y_std: float
    models: list[Any]  # nn.Sequential for an MLPConfig, xgboost.Booster for a TreeConfig
    device: str = "cpu"
    conversion: ConversionModel | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    label: str = "seconds"
    reference: ReferenceSpeed | None = None

    def __post_init__(self) -> None:
        if self.label not in LABELS:
            raise MacoError(f"a predictor's label must be one of {LABELS}, got {self.label!r}")
        if self.label == "ratio" and self.reference is None:
            raise MacoError("a predictor trained on ratios needs the reference speed that turns them into seconds")

    def predict_labels(self, specs: Sequence[ConvSpec], layouts: Sequence[str]) -> np.ndarray:
        """What the MLPs learned, for each (spec, layout) pair: seconds or ratios."""
        if not len(specs):
            return np.zeros(0)
        x = (features(specs, layouts) - self.x_mean) / self.x_std
        z = np.mean([predict_one(m, x) for m in self.models], axis=0)
        return np.exp(z * self.y_std + self.y_mean)

    def predict_many(self, specs: Sequence[ConvSpec], layouts: Sequence[str]) -> np.ndarray:
        """Seconds for each (spec, layout) pair, as a float64 array."""
        labels = self.predict_labels(specs, layouts)
        if self.label == "seconds" or not len(specs):
            return labels
        return labels * self.reference.seconds(np.array([s.flops for s in specs], float))

    def at_speed(self, gflops: float) -> "LatencyPredictor":
        """This ratio predictor giving seconds with the reference at `gflops` (measured now)."""
        if self.label != "ratio":
            return self
        return replace(self, reference=ReferenceSpeed(gflops, self.reference.overhead))

    def foreign_to(self, cpu: str) -> str | None:
        """Why this predictor's picks may not hold on `cpu` (its labels were timed on other CPUs),
        else None; None too for a predictor saved without its data set's CPUs."""
        cpus = self.meta.get("cpus")
        if self.device != "cpu" or not cpus or cpu in cpus:
            return None
        return (f"the latency predictor was trained on convs timed on {', '.join(cpus)}, not on "
                f"this CPU ({cpu}), and the faster layout of a conv differs from CPU to CPU. For plans that fit "
                "this CPU, train one here: `maco collect data.csv` and `python -m maco.layouts.predictor_cli "
                "data.csv DIR`, then pass predictor=DIR or set $MACO_PREDICTOR")

    def predict(self, spec: ConvSpec, layout: str) -> float:
        return float(self.predict_many([spec], [layout])[0])

    def predict_conversion(self, shape: Sequence[int], src: str, dst: str) -> float:
        """The fitted conversion model saved with this predictor (calibrated here if none was)."""
        return predict_conversion(shape, src, dst, self.device, model=self.conversion)

    @property
    def family(self) -> str:
        return "trees" if isinstance(self.config, TreeConfig) else "mlp"

    # -- files: <dir>/model.pt (MLP state dicts) or <dir>/model.json.gz (boosters as XGBoost JSON),
    # and <dir>/predictor.json (config, scalers, checksum)
    def save(self, path: str | os.PathLike[str]) -> None:
        """Both files written atomically; the JSON (written last) holds the weights' sha256, so
        a directory caught between the two writes is refused on load, not misread."""
        folder = Path(path)
        if self.family == "trees":
            blob = gzip.compress(json.dumps([bytes(m.save_raw("json")).decode() for m in self.models]).encode(),
                                 mtime=0)
        else:
            buf = io.BytesIO()
            torch.save([m.state_dict() for m in self.models], buf)
            blob = buf.getvalue()
        write_atomic(folder / _MODEL_FILES[self.family], blob)
        doc = {"format": FORMAT_VERSION, "features": FEATURES, "family": self.family,
               "config": self.config.__dict__,
               "x_mean": self.x_mean.tolist(), "x_std": self.x_std.tolist(),
               "y_mean": self.y_mean, "y_std": self.y_std, "device": self.device,
               "ensemble": len(self.models), "model_sha256": hashlib.sha256(blob).hexdigest(),
               "conversion": self.conversion.to_dict() if self.conversion else None,
               "meta": self.meta, "label": self.label,
               "reference": self.reference.__dict__ if self.reference else None}
        write_atomic(folder / "predictor.json", json.dumps(doc, indent=1, default=str).encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "LatencyPredictor":
        folder = Path(path)
        doc = load_json_file(folder / "predictor.json", "latency predictor")
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION:
            found = doc.get("format") if isinstance(doc, dict) else doc
            raise MacoError(f"{str(path)!r}: unknown predictor format {found!r}")
        family = doc.get("family", "mlp")
        if family not in _MODEL_FILES:
            raise MacoError(f"{str(path)!r}: unknown model family {family!r}; choose from {', '.join(_MODEL_FILES)}")
        name = _MODEL_FILES[family]
        blob = read_bytes(folder / name, "latency predictor model", MAX_MODEL_BYTES)  # a regular file, capped
        if doc.get("features") != FEATURES:
            raise MacoError(f"{str(path)!r} was trained on other features than this MACO computes")
        if hashlib.sha256(blob).hexdigest() != doc.get("model_sha256"):
            raise MacoError(f"{str(path)!r}: {name} does not match predictor.json (a torn save?)")
        try:
            config = (TreeConfig if family == "trees" else MLPConfig)(**doc["config"])
            models = _load_trees(blob) if family == "trees" else _load_mlps(config, blob)
            conv = ConversionModel.from_dict(doc["conversion"]) if doc.get("conversion") else None
            reference = ReferenceSpeed(**doc["reference"]) if doc.get("reference") else None
            meta = doc.get("meta") or {}
            cpus = meta.get("cpus", [])
            if not (isinstance(cpus, list) and all(isinstance(c, str) for c in cpus)):
                raise ValueError(f"meta.cpus must be a list of CPU names, got {cpus!r}")
            return cls(config, np.array(doc["x_mean"]), np.array(doc["x_std"]), float(doc["y_mean"]),
                       float(doc["y_std"]), models, str(doc.get("device", "cpu")), conv,
                       meta, doc.get("label", "seconds"), reference)
        except (KeyError, TypeError, ValueError, RuntimeError, MacoError, pickle.UnpicklingError, EOFError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise MacoError(f"{str(path)!r}: not a valid latency predictor: {first}") from None


_MODEL_FILES = {"mlp": "model.pt", "trees": "model.json.gz"}


def _load_mlps(config: MLPConfig, blob: bytes) -> list[nn.Module]:
    models = []
    for state in torch.load(io.BytesIO(blob), weights_only=True):  # tensors only, no pickled code
        model = build_mlp(config, len(FEATURES))
        model.load_state_dict(state)
        models.append(model.eval())
    return models


def _load_trees(blob: bytes) -> list[Any]:
    """Boosters from XGBoost's JSON model format (data only), each checked to be proper trees
    reading FEATURES (maco.core.xgb_check) before XGBoost's native code sees it."""
    inflate = zlib.decompressobj(wbits=31)  # gzip; a bomb stops at the size cap
    text = inflate.decompress(blob, MAX_MODEL_BYTES)
    if inflate.unconsumed_tail or not inflate.eof:
        raise ValueError(f"model.json.gz is cut or inflates past {MAX_MODEL_BYTES} bytes")
    texts = load_json(text, "list of XGBoost models (model.json.gz)", MAX_MODEL_BYTES)
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("model.json.gz must hold a list of XGBoost JSON models")
    models = []
    for i, text in enumerate(texts):
        try:
            models.append(load_booster(text, f"model {i} of model.json.gz", len(FEATURES), MAX_MODEL_BYTES))
        except MacoError as exc:
            raise ValueError(f"an XGBoost model does not load: {exc}") from None
    return models
