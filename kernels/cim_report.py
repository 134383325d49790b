"""Per layer of a network on a CIM chip: the compiler template's weight updates, MACO's default's,
the lower bound, DMA and buffer use (what `maco cim` prints and experiments/cim_weight_updates.py
plots)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from maco.bounds.cim import cim_weight_bound
from maco.kernels.cim_cost import cim_cost
from maco.kernels.cim_default import default_schedule, template_schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target


@dataclass(frozen=True)
class CimLayer:
    layer: str
    spec: str
    template_cells: int  # crossbar cells the template writes
    template_loads: int  # its block writes
    maco_cells: int
    maco_loads: int
    maco_crossbar_writes: int
    bound_cells: int
    mapped_bound_cells: int  # the bound for schedules with one row segment of a channel per crossbar
    template_transactions: int  # input DMA transactions
    maco_transactions: int
    maco_input_elements: int
    crossbars: int  # per block of MACO's schedule
    input_bytes: int  # peak of one core's input buffer
    psums: int  # peak of one core's psum buffer
    schedule: str

    @property
    def over_bound(self) -> float:
        return self.maco_cells / self.bound_cells

    @property
    def reduction(self) -> float:
        """Share of the template's cell writes MACO's schedule does not make."""
        return 1.0 - self.maco_cells / self.template_cells

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "over_bound": round(self.over_bound, 4), "reduction": round(self.reduction, 6)}


def analyse(layers: Sequence[tuple[str, ConvSpec]], target: Target) -> list[CimLayer]:
    out = []
    for name, spec in layers:
        template, maco = template_schedule(spec, target), default_schedule(spec, target)
        t, m = cim_cost(spec, template, target), cim_cost(spec, maco, target)
        out.append(CimLayer(name, str(spec), t.weight_cells, t.weight_loads, m.weight_cells, m.weight_loads,
                            m.crossbar_writes, cim_weight_bound(spec, target.cim_arch),
                            cim_weight_bound(spec, target.cim_arch, mapped=True),
                            t.input_transactions, m.input_transactions, m.input_elements,
                            m.crossbars_used, m.peak_input_bytes, m.peak_psums, maco.describe()))
    return out


def total_reduction(rows: Sequence[CimLayer]) -> float:
    """A network's share of template cell writes saved, over all its layers."""
    return 1.0 - sum(r.maco_cells for r in rows) / sum(r.template_cells for r in rows)
