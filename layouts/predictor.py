"""The layout latency predictor: torch MLPs or XGBoost boosted trees, the family, architecture
and training chosen by NAS (Optuna, TPE sampler, Hyperband pruner for the MLPs), on features of a
conv and a layout, predicting log latency, or log of the latency over the FMA reference timed in
the same rounds (the label that repeats across the VM's spells; seconds again with the reference
speed measured where it is used). Also the baselines the paper compares with (SVR, linear
regression, gradient-boosted trees, on the raw latency target as the paper did and on the log
target) and the metrics that matter to a planner: R2 on latency and log latency, and how often a
model picks the slower layout and what that costs.

    rows = maco.layouts.dataset.load_rows("results/dataset_cpu.csv")
    pred = train_predictor(rows, trials=40)
    pred.predict(spec, "NHWC")  # seconds (a ratio-trained one at the speed it was trained at)
    latency_sources.at_speed_now(pred)  # ... or at the FMA reference's speed measured now
    pred.save("results/predictor_cpu"); LatencyPredictor.load("results/predictor_cpu")
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import math
import os
import pickle
import random
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from maco.core.errors import MacoError
from maco.core.files import load_json, load_json_file, read_bytes, write_atomic
from maco.kernels.baselines import torch_backend
from maco.layouts.dataset import cpus_of, load_rows
from maco.layouts.latency import LAYOUTS, ConversionModel, check_layout, predict_conversion
from maco.core.spec import ConvSpec
from maco.core.xgb_check import load_booster

FEATURES = ["layout", "n", "c", "h", "w", "k", "kh", "kw", "stride_h", "stride_w", "pad_h",
            "pad_w", "dil_h", "dil_w", "groups", "flops", "input_bytes", "weight_bytes",
            "output_bytes", "c_per_group", "k_per_group", "out_h", "out_w", "depthwise",
            "c_pad8", "c_pad16", "k_pad8", "k_pad16", "padded_flops", "out_pixels",
            "torch_onednn", "torch_im2col", "torch_dilated"]
# torch_*: which CPU implementation torch's conv2d picks (kernels.baselines.torch_backend): oneDNN,
# or its own im2col + GEMM paths; torch switches on size thresholds the other features only approximate.
_BACKENDS = {"torch_onednn": "Mkldnn", "torch_im2col": "Slow2d", "torch_dilated": "SlowDilated2d"}
# Sizes that span orders of magnitude enter the MLP as logs; small integers stay as they are.
_LOGGED = {"n", "c", "h", "w", "k", "groups", "flops", "input_bytes", "weight_bytes",
           "output_bytes", "c_per_group", "k_per_group", "out_h", "out_w", "padded_flops", "out_pixels"}


def _pad(v: int, block: int) -> float:
    """How much a channel count grows when padded to `block`: vendor libraries (oneDNN's nChw16c,
    cuDNN's vector loads) work in channel blocks, and a ragged count pays for the full block."""
    return math.ceil(v / block) * block / v
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh, "elu": nn.ELU}
FORMAT_VERSION = 1
LABELS = ("seconds", "ratio")  # what the MLPs learn: log seconds, or log of seconds over the reference
MAX_MODEL_BYTES = 256 << 20  # the ensemble's weights: a few MB in practice
# The NAS's widest layer: 5 hidden layers of 256 in a 3-model ensemble save to ~3 MB, small
# enough to keep a trained predictor in the repository.
MAX_WIDTH = 256


def layout_id(layout: str) -> int:
    return LAYOUTS.index(check_layout(layout))


def features(specs: Sequence[ConvSpec], layouts: Sequence[str], log: bool = True) -> np.ndarray:
    """(N, len(FEATURES)) float64: the conv's shape numbers and sizes, logs of the large ones
    when `log` (the MLP's input), raw values otherwise (the paper's baselines)."""
    if len(specs) != len(layouts):
        raise MacoError(f"{len(specs)} specs but {len(layouts)} layouts")
    out = np.empty((len(specs), len(FEATURES)))
    for i, (s, lay) in enumerate(zip(specs, layouts)):
        vals = {"layout": layout_id(lay), "n": s.n, "c": s.c, "h": s.h, "w": s.w, "k": s.k,
                "kh": s.kh, "kw": s.kw, "stride_h": s.stride[0], "stride_w": s.stride[1],
                "pad_h": s.padding[0], "pad_w": s.padding[1], "dil_h": s.dilation[0],
                "dil_w": s.dilation[1], "groups": s.groups, "flops": s.flops,
                "input_bytes": s.input_bytes, "weight_bytes": s.weight_bytes,
                "output_bytes": s.output_bytes, "c_per_group": s.c_per_group,
                "k_per_group": s.k_per_group, "out_h": s.out_h, "out_w": s.out_w,
                "depthwise": int(s.is_depthwise), "c_pad8": _pad(s.c_per_group, 8),
                "c_pad16": _pad(s.c_per_group, 16), "k_pad8": _pad(s.k_per_group, 8),
                "k_pad16": _pad(s.k_per_group, 16), "out_pixels": s.n * s.out_h * s.out_w,
                "padded_flops": s.flops * _pad(s.c_per_group, 16) * _pad(s.k_per_group, 16)}
        try:
            backend = torch_backend(s, lay)
        except RuntimeError:  # torch allocates the (untouched) input and weights to choose
            raise MacoError(f"cannot predict {s}: torch cannot hold its {s.input_bytes / 2**30:.4g} GiB input "
                            f"and {s.weight_bytes / 2**30:.4g} GiB weights to say which conv it runs") from None
        vals.update({name: float(backend == picked) for name, picked in _BACKENDS.items()})
        out[i] = [math.log(vals[f]) if log and f in _LOGGED else float(vals[f]) for f in FEATURES]
    return out


# -- the MLP --------------------------------------------------------------------------------------
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
def _one_thread() -> Iterator[None]:
    """Small MLPs train ~4x faster on one torch thread than on two busy cores (no fork-join)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _mlp_predict(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(x, dtype=torch.float32))[:, 0].double().numpy()


# -- boosted trees: the other family the search may choose ----------------------------------------
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


def train_trees(config: TreeConfig, x: np.ndarray, y: np.ndarray, *, seed: int = 0) -> Any:
    """An XGBoost booster on standardised inputs and target (one thread, as the MLPs train)."""
    import xgboost as xgb

    return xgb.train(config.params(seed), xgb.DMatrix(x, label=y), num_boost_round=config.trees)


def _predict_one(model: Any, x: np.ndarray) -> np.ndarray:
    if isinstance(model, nn.Module):
        return _mlp_predict(model, x)
    return np.asarray(model.inplace_predict(x), dtype=np.float64)


# -- the predictor ------------------------------------------------------------------------------
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
        z = np.mean([_predict_one(m, x) for m in self.models], axis=0)
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
                "this CPU, train one here: `maco collect data.csv` and `python -m maco.layouts.predictor data.csv "
                "DIR`, then pass predictor=DIR or set $MACO_PREDICTOR")

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
    with _one_thread():
        models = [train(config, xs, ys, seed=seed + i) for i in range(ensemble)]
    return LatencyPredictor(config, x_mean, x_std, y_mean, y_std, models, device, conversion,
                            meta or {}, label, reference)


# -- NAS ----------------------------------------------------------------------------------------
FAMILIES = ("mlp", "trees")


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

    train_idx, val_idx = split_by_spec(specs, val_fraction, seed)
    x = features(specs, layouts)
    mean, std = x[train_idx].mean(axis=0), x[train_idx].std(axis=0)
    std[std == 0] = 1.0
    x = (x - mean) / std
    y = np.log(np.asarray(labels, dtype=float))
    ym, ysd = y[train_idx].mean(), y[train_idx].std() or 1.0
    y = (y - ym) / ysd
    report_every = max(1, epochs // 20)

    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise MacoError(f"model families must be among {', '.join(FAMILIES)}, got {list(families)!r}")

    def objective(trial: "optuna.Trial") -> float:
        if trial.suggest_categorical("family", list(families)) == "trees":
            trees = _tree_config({
                "tree_depth": trial.suggest_int("tree_depth", 3, 10),
                "tree_count": trial.suggest_int("tree_count", 100, 4000, log=True),
                "tree_lr": trial.suggest_float("tree_lr", 0.01, 0.2, log=True),
                "tree_subsample": trial.suggest_float("tree_subsample", 0.5, 1.0),
                "tree_colsample": trial.suggest_float("tree_colsample", 0.5, 1.0),
                "tree_min_child": trial.suggest_float("tree_min_child", 0.5, 10.0, log=True)})
            booster = train_trees(trees, x[train_idx], y[train_idx], seed=seed)
            loss = float(np.mean((_predict_one(booster, x[val_idx]) - y[val_idx]) ** 2))
            return loss if math.isfinite(loss) else 1e9
        config = MLPConfig(
            layers=trial.suggest_int("layers", 1, 5),
            width=trial.suggest_int("width", 16, MAX_WIDTH, log=True),
            activation=trial.suggest_categorical("activation", sorted(ACTIVATIONS)),
            dropout=trial.suggest_float("dropout", 0.0, 0.3),
            lr=trial.suggest_float("lr", 1e-4, 3e-2, log=True),
            weight_decay=trial.suggest_float("weight_decay", 1e-8, 1e-2, log=True),
            batch_size=trial.suggest_categorical("batch_size", [32, 64, 128, 256]),
            epochs=epochs)
        def val_loss(model: nn.Module) -> float:
            loss = float(np.mean((_mlp_predict(model, x[val_idx]) - y[val_idx]) ** 2))
            return loss if math.isfinite(loss) else 1e9

        def report(epoch: int, model: nn.Module) -> bool:
            trial.report(val_loss(model), epoch)
            return trial.should_prune()

        model = train_mlp(config, x[train_idx], y[train_idx], seed=seed, report=report,
                          report_every=report_every)
        if trial.should_prune():
            raise optuna.TrialPruned()
        return val_loss(model)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.HyperbandPruner(min_resource=report_every, max_resource=epochs,
                                              reduction_factor=3))
    with _one_thread():
        study.optimize(objective, n_trials=trials, timeout=timeout, show_progress_bar=progress)
    best = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not best:
        raise MacoError("the NAS completed no trial; give it more trials or time")
    params = dict(study.best_params)
    if params.pop("family", "mlp") == "trees":
        return _tree_config(params), study
    return MLPConfig(**params, epochs=epochs), study


def _tree_config(params: dict[str, Any]) -> TreeConfig:
    """The searched settings, the tree count cut to MAX_LEAVES at that depth."""
    depth = params["tree_depth"]
    return TreeConfig(depth=depth, trees=min(params["tree_count"], MAX_LEAVES >> depth), lr=params["tree_lr"],
                      subsample=params["tree_subsample"], colsample=params["tree_colsample"],
                      min_child_weight=params["tree_min_child"])


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


# -- splits, baselines and metrics ---------------------------------------------------------------
def split_by_spec(specs: Sequence[ConvSpec], test_fraction: float = 0.2,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (train, test) with every layout of a conv on the same side, so a test conv
    is unseen and its layouts can be compared."""
    if not 0 < test_fraction < 1:
        raise MacoError(f"test fraction must lie in (0, 1), got {test_fraction}")
    distinct = sorted({str(s) for s in specs})
    random.Random(seed).shuffle(distinct)
    test = set(distinct[:max(1, int(round(len(distinct) * test_fraction)))])
    is_test = np.array([str(s) in test for s in specs])
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)


@dataclass
class Metrics:
    """How well predicted seconds match measured ones, and what a planner would lose."""

    r2: float  # on seconds
    r2_log: float  # on log seconds
    median_rel_error: float
    wrong_picks: float  # fraction of convs whose predicted-faster layout is the slower one
    wrong_picks_5pct: float  # the same, counting only convs whose layouts differ by > 5%
    pick_cost: float  # extra seconds of the wrong picks / seconds of the best layouts
    pairs: int  # convs with every layout measured
    within_10pct: float = float("nan")  # share of rows predicted within +-10%
    wrong_clear: float = float("nan")  # wrong picks among the convs whose layouts differ by > 5%
    clear_pairs: int = 0  # those convs
    rel_errors: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in self.__dict__.items() if k != "rel_errors"}


def r2_score(y: np.ndarray, p: np.ndarray) -> float:
    ss_res = float(np.sum((y - p) ** 2))
    ss_tot = float(np.sum((y - np.mean(y)) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")


def evaluate(specs: Sequence[ConvSpec], layouts: Sequence[str], measured: np.ndarray,
             predicted: np.ndarray) -> Metrics:
    measured, predicted = np.asarray(measured, float), np.asarray(predicted, float)
    safe = np.maximum(predicted, 1e-12)  # a raw-target model can predict <= 0
    errors = np.abs(predicted - measured) / measured
    by_spec: dict[str, dict[str, tuple[float, float]]] = {}
    for s, lay, m, p in zip(specs, layouts, measured, predicted):
        by_spec.setdefault(str(s), {})[lay] = (m, p)
    wrong = wrong5 = pairs = clear = 0
    extra = best_total = 0.0
    for d in by_spec.values():
        if len(d) < 2:
            continue
        pairs += 1
        best = min(d, key=lambda k: d[k][0])
        chosen = min(d, key=lambda k: d[k][1])
        best_total += d[best][0]
        clear += max(m for m, _ in d.values()) > 1.05 * d[best][0]
        if chosen != best:
            wrong += 1
            extra += d[chosen][0] - d[best][0]
            wrong5 += d[chosen][0] > 1.05 * d[best][0]
    return Metrics(r2=r2_score(measured, predicted),
                   r2_log=r2_score(np.log(measured), np.log(safe)),
                   median_rel_error=float(np.median(errors)),
                   wrong_picks=wrong / pairs if pairs else float("nan"),
                   wrong_picks_5pct=wrong5 / pairs if pairs else float("nan"),
                   pick_cost=extra / best_total if best_total else float("nan"), pairs=pairs,
                   within_10pct=float(np.mean(errors <= 0.10)) if len(errors) else float("nan"),
                   wrong_clear=wrong5 / clear if clear else float("nan"), clear_pairs=clear,
                   rel_errors=errors)


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


def main(argv: Sequence[str] | None = None) -> int:
    """python -m maco.layouts.predictor DATA.csv OUT_DIR: NAS, retrain, calibrate conversions, save."""
    p = argparse.ArgumentParser(prog="python -m maco.layouts.predictor",
                                description="Train a layout latency predictor on a `maco collect` data set.")
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--timeout", type=float, default=None, help="NAS time limit in seconds")
    p.add_argument("--ensemble", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", choices=LABELS, default=None,
                   help="what to learn (default: ratio to the reference where every row has one, else seconds)")
    args = p.parse_args(argv)
    try:
        conv = ConversionModel.calibrate(args.device)
        rows = [r for r in load_rows(args.data) if r.device == args.device]
        pred = train_predictor(rows, trials=args.trials, epochs=args.epochs,
                               timeout=args.timeout, ensemble=args.ensemble, seed=args.seed,
                               device=args.device, conversion=conv, label=args.label)
        pred.meta["cpus"] = cpus_of(args.data, rows)
        pred.save(args.out)
    except MacoError as exc:
        print(f"error: {exc}")
        return 2
    print(f"saved {args.out}: {pred.config} {pred.meta}")
    return 0


__all__ = ["FEATURES", "FAMILIES", "MAX_LEAVES", "LABELS", "MLPConfig", "TreeConfig", "ReferenceSpeed",
           "LatencyPredictor", "row_labels", "Metrics",
           "features", "build_mlp",
           "train_mlp", "train_trees", "fit_predictor", "search_config", "train_predictor", "split_by_spec",
           "evaluate", "r2_score", "baseline_models", "fit_baseline"]


if __name__ == "__main__":
    raise SystemExit(main())
