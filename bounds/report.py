"""Bound, optimal tile and dataflow I/O of one conv at every memory level: what `maco bound` and
experiments/bounds_table.py print.

Each level is taken at one processor's share S/Np, the memory its tile is sized for; the ratio
is the dataflow's loads + stores with that tile over the best lower bound at S/Np."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from maco.bounds.conv import BoundReport, bound_report
from maco.bounds.tiles import Tile, dataflow_io, optimal_tile
from maco.core.spec import ConvSpec
from maco.core.target import MemoryLevel


@dataclass(frozen=True)
class LevelResult:
    level: str
    S: int  # elements per processor (S/Np)
    processors: int
    bound: BoundReport
    tile: Tile
    footprint: int
    io: int  # dataflow loads + stores with `tile`

    @property
    def ratio(self) -> float:
        """Dataflow I/O over the best valid lower bound (>= 1)."""
        return self.io / self.bound.best

    @property
    def ratio_eq7(self) -> float:
        """Dataflow I/O over the paper's eq. (7) bound alone (inf where that bound is 0)."""
        return self.io / self.bound.pebble if self.bound.pebble > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "S": self.S, "processors": self.processors,
                "bound": self.bound.to_dict(), "tile": self.tile.to_dict(),
                "footprint": self.footprint, "dataflow_io": self.io, "ratio": self.ratio,
                "ratio_eq7": self.ratio_eq7 if self.bound.pebble > 0 else None}


def analyse_levels(spec: ConvSpec, levels: Sequence[MemoryLevel]) -> list[LevelResult]:
    """Bound, optimal tile, its footprint and exact dataflow I/O at each level's S/Np."""
    out = []
    for lvl in levels:
        share = lvl.elements_per_processor
        tile = optimal_tile(spec, lvl.elements, lvl.processors)
        out.append(LevelResult(lvl.name, share, lvl.processors, bound_report(spec, share), tile,
                               tile.footprint(spec), dataflow_io(spec, tile)))
    return out
