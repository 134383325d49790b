"""Helpers shared by subcommands: turning a layer or network argument into conv specs, tables."""
from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Iterable

from maco.core.errors import MacoError
from maco.core.files import short
from maco.core.spec import ConvSpec

# The built-in networks (maco.layouts.networks.NETWORKS, named here so that --help needs no torch).
NETWORK_NAMES = ("resnet18", "alexnet", "vgg11", "resnet50", "mobilenet_v2", "efficientnet_b0",
                 "mobilenet_v3_large", "convnext_tiny")
NETWORKS_TEXT = ", ".join(NETWORK_NAMES)


def _number(kind: type, low: float, low_ok: bool, high: float = math.inf) -> Callable[[str], Any]:
    """An argparse type that refuses values that make no sense before any work starts."""
    bound = f">= {low:g}" if low_ok else f"> {low:g}"
    if high < math.inf:
        bound = f"in [{low:g}, {high:g}]"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an int' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not low_ok) or value > high:
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value
    parse.__name__ = kind.__name__
    return parse


positive_int = _number(int, 1, True)
nonnegative_int = _number(int, 0, True)
positive_float = _number(float, 0, False)
nonnegative_float = _number(float, 0, True)


def add_cluster_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default=None, metavar="ADDRESS", type=cluster_address,
                   help="build on every node of a Ray cluster and measure on its machines of this "
                   "machine's kind: ray://HOST:PORT, HOST:PORT (as `ray start --head` prints) or "
                   "auto (RAY_ADDRESS); needs pip install 'maco[cluster]'")


def cluster_address(text: str) -> str:
    """--cluster, checked where it is parsed, before any work (maco.tune.cluster.check_address; Ray
    is imported only when --cluster is given)."""
    from maco.tune.cluster import check_address

    try:
        return check_address(text)
    except MacoError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def resolve_layers(text: str, batch: int = 1, every: bool = False) -> list[tuple[str, ConvSpec]]:
    """A built-in network name (its distinct conv layers, or with `every` each of its conv layers),
    a model file `path/to/file.py:ClassName` (with `every`: each of its conv layers), or a layer
    spec like n1_c64_h56_w56_k64_r3_p1 (parsed first: it needs no torch, which takes seconds to
    import)."""
    try:
        spec = ConvSpec.parse(text)
        return [(str(spec), spec.with_batch(batch) if batch != 1 else spec)]
    except MacoError as exc:
        error = exc
    from maco.layouts.networks import NETWORKS, conv_layers, distinct_convs, example_input, load_model, network_convs

    if text in NETWORKS:
        layers = network_convs(text, batch)
        if every:
            return layers
        return [(names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1})", spec)
                for spec, names in distinct_convs(layers)]
    if every and ":" in text:
        _, model = load_model(text)
        found = conv_layers(model.eval(), example_input(batch))
        if not found:
            raise MacoError(f"{short(text)} has no conv layers")
        return found
    raise MacoError(f"{short(text)} is neither a network ({', '.join(NETWORKS)})"
                    + (", a model file (path/to/file.py:ClassName)" if every else "")
                    + f" nor a layer spec: {error}")


def print_table(title: str, columns: list[str], rows: Iterable[Iterable[Any]]) -> None:
    """A rich table on the terminal (plain text when piped)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in ("layer", "spec", "name") else "right")
    for row in rows:
        table.add_row(*[_fmt(v) for v in row])
    Console(width=200).print(table)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
