"""XGBoost boosters from files users share (a latency predictor, the cost model's prior), checked
in Python before XGBoost sees them.

XGBoost's loader trusts a model's structure: a tree child index past the node array, a cycle
or a split on a feature the model does not have reads out of bounds in native code (a
segfault, not an exception), and its JSON parser recurses once per nesting level. A sha256 only
proves a file is the one some JSON names, so every booster MACO loads is parsed here (size and
nesting capped), checked to be single-target regression trees that are proper trees (each node
reached once from the root, children in range, parents consistent, depth capped, splits on
features the model reads, finite leaves and base score), and handed to XGBoost re-serialised
from exactly what was checked (duplicate keys and all resolved the way they were checked).
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from maco.core.errors import MacoError
from maco.core.files import MAX_JSON_BYTES, load_json, short

MAX_TREES = 1 << 16
MAX_NODES = 1 << 22  # all trees together: the shipped predictors hold ~200k nodes
MAX_DEPTH = 64  # MACO trains depth <= 10; XGBoost walks a tree level by level
MAX_FEATURES = 1 << 16
ROOT_PARENT = 2147483647  # what XGBoost writes as the root's parent (its invalid node id)
CHECKSUM_ATTR = "sha256"  # a learner attribute: content_sha256 of the rest of the model

_INT_ARRAYS = ("left_children", "right_children", "parents", "split_indices", "default_left", "split_type")
_FLOAT_ARRAYS = ("split_conditions", "base_weights", "loss_changes", "sum_hessian")
_CATEGORY_ARRAYS = ("categories", "categories_nodes", "categories_segments", "categories_sizes")


def _bad(what: str, why: str) -> MacoError:
    return MacoError(f"{what} is not a usable XGBoost model: {why}")


def _dict(value: Any, what: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(what, f"{where} must be a JSON object, got {short(value)}")
    return value


def _get(d: dict[str, Any], key: str, what: str, where: str) -> Any:
    if key not in d:
        raise _bad(what, f"{where} has no {key!r}")
    return d[key]


def _int_text(value: Any, what: str, where: str, lo: int, hi: int) -> int:
    """XGBoost writes its model parameters as strings of digits."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 12:
        number = int(value)
        if lo <= number <= hi:
            return number
    raise _bad(what, f"{where} must be an integer in [{lo}, {hi}], got {short(value)}")


def _ints(values: Any, n: int, what: str, where: str):
    import numpy as np

    if not isinstance(values, list) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, list) else short(values)
        raise _bad(what, f"{where} must be a list of {n} integers, got {got}")
    if not all(type(v) is int for v in values):
        bad = next(v for v in values if type(v) is not int)
        raise _bad(what, f"{where} holds {short(bad)}, not an integer")
    if values and (min(values) < -(1 << 62) or max(values) > 1 << 62):
        raise _bad(what, f"{where} holds {short(max(values, key=abs))}, out of any node's range")
    return np.array(values, dtype=np.int64)


def _floats(values: Any, n: int, what: str, where: str):
    import numpy as np

    if not isinstance(values, list) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, list) else short(values)
        raise _bad(what, f"{where} must be a list of {n} numbers, got {got}")
    if not all(type(v) in (int, float) for v in values):
        bad = next(v for v in values if type(v) not in (int, float))
        raise _bad(what, f"{where} holds {short(bad)}, not a number")
    try:
        out = np.array(values, dtype=np.float64)
    except OverflowError:
        raise _bad(what, f"{where} holds a number out of float range") from None
    if not np.all(np.isfinite(out)):
        raise _bad(what, f"{where} holds {float(out[~np.isfinite(out)][0])!r} at node "
                   f"{int(np.flatnonzero(~np.isfinite(out))[0])}")
    return out


def _base_score(value: Any, what: str) -> None:
    """'0.5' (XGBoost < 3) or '[2.8623992E-1]' (one per target); finite either way."""
    text = value if isinstance(value, str) else ""
    parts = text[1:-1].split(",") if text.startswith("[") and text.endswith("]") else [text]
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) != 1 or not math.isfinite(numbers[0]):
        raise _bad(what, f"base_score must be one finite number, got {short(value)}")


def _check_tree(i: int, tree: Any, num_feature: int, what: str) -> int:
    """One regression tree (XGBoost's JSON): a proper tree of its num_nodes nodes. Returns them."""
    where = f"tree {i}"
    n, ints = _tree_arrays(i, tree, num_feature, what, where)
    left, right = ints["left_children"], ints["right_children"]
    leaf, inner = _check_links(n, left, right, ints["split_indices"], num_feature, what, where)
    _check_proper(n, left, right, ints["parents"], leaf, inner, what, where)
    return n


def _tree_arrays(i: int, tree: Any, num_feature: int, what: str, where: str) -> tuple[int, dict[str, Any]]:
    """A tree's node count and integer arrays, after checking its parameters and that every array
    holds one in-range value per node: what XGBoost indexes with must not be trusted to agree."""
    import numpy as np

    tree = _dict(tree, what, where)
    if type(tree.get("id")) is not int or tree["id"] != i:
        raise _bad(what, f"{where} has id {short(tree.get('id'))}")
    param = _dict(_get(tree, "tree_param", what, where), what, f"{where} tree_param")
    n = _int_text(_get(param, "num_nodes", what, where), what, f"{where} num_nodes", 1, MAX_NODES)
    _int_text(_get(param, "num_deleted", what, where), what, f"{where} num_deleted", 0, 0)
    if param.get("num_feature") != str(num_feature):
        raise _bad(what, f"{where} reads {short(param.get('num_feature'))} features, the model {num_feature}")
    if param.get("size_leaf_vector", "1") not in ("0", "1"):
        raise _bad(what, f"{where} has leaf vectors of {short(param.get('size_leaf_vector'))} "
                   "(MACO's boosters are single-target)")
    ints = {k: _ints(_get(tree, k, what, where), n, what, f"{where} {k}") for k in _INT_ARRAYS}
    for k in _FLOAT_ARRAYS:
        _floats(_get(tree, k, what, where), n, what, f"{where} {k}")
    for k in _CATEGORY_ARRAYS:
        if tree.get(k, []) != []:
            raise _bad(what, f"{where} has categorical splits ({k}); MACO's features are numbers")
    if np.any(ints["split_type"] != 0):
        raise _bad(what, f"{where} has categorical splits (split_type); MACO's features are numbers")
    if np.any((ints["default_left"] != 0) & (ints["default_left"] != 1)):
        raise _bad(what, f"{where} default_left holds values other than 0 and 1")
    return n, ints


def _check_links(n: int, left: Any, right: Any, split: Any, num_feature: int, what: str,
                 where: str) -> tuple[Any, Any]:
    """Children and split features in range (XGBoost follows them without a bounds check).
    Returns the leaf mask and the indices of the inner nodes."""
    import numpy as np

    leaf = left == -1
    for name, child in (("left", left), ("right", right)):
        wrong = ~leaf & ((child < 1) | (child >= n)) | leaf & (child != -1)
        if np.any(wrong):
            node = int(np.flatnonzero(wrong)[0])
            raise _bad(what, f"{where} node {node}: {name} child {int(child[node])} is neither -1 (a leaf) "
                       f"nor another node of its {n}")
    inner = np.flatnonzero(~leaf)
    bad_split = (split[inner] < 0) | (split[inner] >= num_feature)
    if np.any(bad_split):
        node = int(inner[np.flatnonzero(bad_split)[0]])
        raise _bad(what, f"{where} node {node} splits on feature {int(split[node])} of {num_feature}")
    if np.any((split < 0) | (split > ROOT_PARENT)):
        raise _bad(what, f"{where} split_indices holds {int(split[(split < 0) | (split > ROOT_PARENT)][0])}")
    return leaf, inner


def _check_proper(n: int, left: Any, right: Any, parents: Any, leaf: Any, inner: Any, what: str,
                  where: str) -> None:
    """A proper tree: every node but the root is the child of exactly one node, which is its parent,
    and every node is reached from the root within MAX_DEPTH levels (no cycle, nothing cut off),
    so XGBoost's walks end."""
    import numpy as np

    children = np.concatenate([left[inner], right[inner]])
    counts = np.bincount(children, minlength=n)
    if counts[0] or np.any(counts[1:] != 1):
        node = 0 if counts[0] else 1 + int(np.flatnonzero(counts[1:] != 1)[0])
        raise _bad(what, f"{where} node {node} is the child of {int(counts[node])} nodes, not of one")
    if parents[0] != ROOT_PARENT or np.any(parents[left[inner]] != inner) or np.any(parents[right[inner]] != inner):
        raise _bad(what, f"{where}: the parents do not match the children")
    frontier, reached = np.array([0]), 1
    for _ in range(MAX_DEPTH):
        frontier = frontier[~leaf[frontier]]
        frontier = np.concatenate([left[frontier], right[frontier]])
        if not len(frontier):
            break
        reached += len(frontier)
    else:
        raise _bad(what, f"{where} is deeper than {MAX_DEPTH} levels")
    if reached != n:
        raise _bad(what, f"{where}: {n - reached} of its {n} nodes are not reached from the root (a cycle?)")


def check_booster(doc: Any, what: str, num_feature: int | None = None) -> int:
    """MacoError naming the first problem unless `doc` (a parsed XGBoost JSON model) is gbtree
    regression trees XGBoost can run without reading out of bounds; returns its feature count
    (which must be `num_feature` when given)."""
    doc = _dict(doc, what, "the model")
    version = _get(doc, "version", what, "the model")
    if not (isinstance(version, list) and len(version) == 3 and all(type(v) is int and 0 <= v < 1000
                                                                    for v in version)):
        raise _bad(what, f"version must be three small integers, got {short(version)}")
    learner = _dict(_get(doc, "learner", what, "the model"), what, "learner")
    features = _learner_features(learner, what, num_feature)
    objective = _dict(_get(learner, "objective", what, "learner"), what, "objective")
    if not isinstance(objective.get("name"), str):
        raise _bad(what, f"objective has no name: {short(objective)}")
    gbm = _dict(_get(learner, "gradient_booster", what, "learner"), what, "gradient_booster")
    if gbm.get("name") != "gbtree":
        raise _bad(what, f"booster {short(gbm.get('name'))} is not gbtree")
    model = _dict(_get(gbm, "model", what, "gradient_booster"), what, "gradient_booster model")
    trees = _forest_trees(model, what)
    nodes = 0
    for i, tree in enumerate(trees):
        nodes += _check_tree(i, tree, features, what)
        if nodes > MAX_NODES:
            raise _bad(what, f"more than {MAX_NODES} nodes")
    return features


def _learner_features(learner: dict[str, Any], what: str, num_feature: int | None) -> int:
    """The model's feature count (which must be `num_feature` when given), after checking the
    learner parameters say single-target regression with a finite base score and the names,
    types and attributes are strings."""
    params = _dict(_get(learner, "learner_model_param", what, "learner"), what, "learner_model_param")
    features = _int_text(_get(params, "num_feature", what, "learner_model_param"), what, "num_feature",
                         1, MAX_FEATURES)
    if num_feature is not None and features != num_feature:
        raise _bad(what, f"it reads {features} features, not {num_feature}")
    _int_text(params.get("num_class", "0"), what, "num_class", 0, 0)
    _int_text(params.get("num_target", "1"), what, "num_target", 1, 1)
    _base_score(_get(params, "base_score", what, "learner_model_param"), what)
    for key in ("feature_names", "feature_types"):
        names = learner.get(key, [])
        if not (isinstance(names, list) and len(names) in (0, features) and all(isinstance(s, str) for s in names)):
            raise _bad(what, f"{key} must be 0 or {features} strings")
    attrs = learner.get("attributes", {})
    if not (isinstance(attrs, dict) and all(isinstance(v, str) for v in attrs.values())):
        raise _bad(what, "attributes must map names to strings")
    return features


def _forest_trees(model: dict[str, Any], what: str) -> list:
    """The gbtree model's list of trees (not yet checked one by one), after checking the counts,
    output groups and round boundaries that describe them agree with it and nothing is
    categorical."""
    import numpy as np

    trees = _get(model, "trees", what, "the model")
    if not isinstance(trees, list) or len(trees) > MAX_TREES:
        raise _bad(what, f"trees must be a list of at most {MAX_TREES} trees")
    gparam = _dict(_get(model, "gbtree_model_param", what, "the model"), what, "gbtree_model_param")
    _int_text(gparam.get("num_trees"), what, "num_trees", len(trees), len(trees))
    per_round = _int_text(gparam.get("num_parallel_tree", "1"), what, "num_parallel_tree", 1, MAX_TREES)
    info = _ints(_get(model, "tree_info", what, "the model"), len(trees), what, "tree_info")
    if np.any(info != 0):
        raise _bad(what, "tree_info names an output group other than 0 (MACO's boosters are single-target)")
    if "iteration_indptr" in model:
        indptr = model["iteration_indptr"]
        if not isinstance(indptr, list):
            raise _bad(what, f"iteration_indptr must be a list, got {short(indptr)}")
        bounds = _ints(indptr, len(indptr), what, "iteration_indptr")
        if len(bounds) < 1 or bounds[0] != 0 or bounds[-1] != len(trees) or np.any(np.diff(bounds) < 0):
            raise _bad(what, f"iteration_indptr must rise from 0 to the {len(trees)} trees")
    elif len(trees) % per_round:
        raise _bad(what, f"{len(trees)} trees are not rounds of {per_round}")
    cats = model.get("cats", {})
    if not (isinstance(cats, dict) and all(v == [] for v in cats.values())):
        raise _bad(what, "it encodes categorical features; MACO's features are numbers")
    return trees


def content_sha256(doc: dict[str, Any]) -> str:
    """sha256 of a parsed model without its checksum attribute, in canonical JSON (sorted keys):
    the same for every file XGBoost writes of that model, whatever its key order or float text."""
    learner = doc.get("learner") if isinstance(doc, dict) else None
    attrs = learner.get("attributes") if isinstance(learner, dict) else None
    if isinstance(attrs, dict) and CHECKSUM_ATTR in attrs:
        doc = {**doc, "learner": {**learner, "attributes": {k: v for k, v in attrs.items() if k != CHECKSUM_ATTR}}}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def check_checksum(doc: Any, what: str) -> None:
    """MacoError unless the model's checksum attribute matches its content (a damaged file)."""
    try:
        stored = doc["learner"]["attributes"][CHECKSUM_ATTR]
    except (KeyError, TypeError):
        raise MacoError(f"{what} has no checksum (learner attribute {CHECKSUM_ATTR!r}); "
                        "it is damaged or from before checksums") from None
    if stored != content_sha256(doc):
        raise MacoError(f"{what} is damaged: its content does not match its sha256 {short(stored, 20)}")


def booster_from_doc(doc: Any, what: str, num_feature: int | None = None) -> Any:
    """An xgboost.Booster (one thread) of a parsed model, after check_booster."""
    import xgboost as xgb

    features = check_booster(doc, what, num_feature)
    try:
        text = json.dumps(doc, allow_nan=False)
    except ValueError:
        raise _bad(what, "it holds NaN or infinity") from None
    booster = xgb.Booster(params={"nthread": 1})
    try:
        booster.load_model(bytearray(text.encode()))
    except xgb.core.XGBoostError as exc:
        raise _bad(what, str(exc).strip().splitlines()[0] if str(exc).strip() else "XGBoost refuses it") from None
    if booster.num_features() != features:
        raise _bad(what, f"XGBoost reads {booster.num_features()} features, the model names {features}")
    return booster


def load_booster(text: str | bytes, what: str, num_feature: int | None = None,
                 max_bytes: int = MAX_JSON_BYTES) -> Any:
    """An xgboost.Booster from XGBoost JSON text, parsed with size and nesting capped, then checked."""
    return booster_from_doc(load_json(text, what, max_bytes), what, num_feature)


__all__ = ["check_booster", "booster_from_doc", "load_booster", "content_sha256", "check_checksum",
           "CHECKSUM_ATTR", "MAX_DEPTH", "MAX_NODES", "MAX_TREES"]
