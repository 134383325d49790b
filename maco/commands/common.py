"""Helpers shared by subcommands: turning a layer or network argument into conv specs, tables."""
from __future__ import annotations

from typing import Any, Iterable

from maco.errors import MacoError
from maco.spec import ConvSpec


def resolve_layers(text: str, batch: int = 1) -> list[tuple[str, ConvSpec]]:
    """A built-in network name (every distinct conv layer) or a layer spec like n1_c64_h56_w56_k64_r3_p1."""
    from maco.layouts.networks import NETWORKS, distinct_convs, network_convs

    if text in NETWORKS:
        return [(names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1})", spec)
                for spec, names in distinct_convs(network_convs(text, batch))]
    try:
        spec = ConvSpec.parse(text)
    except MacoError as exc:
        raise MacoError(f"{text!r} is neither a network ({', '.join(NETWORKS)}) nor a layer spec: {exc}") from None
    return [(str(spec), spec.with_batch(batch) if batch != 1 else spec)]


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
