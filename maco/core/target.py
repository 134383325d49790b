"""Memory hierarchies the bounds and the schedule space are fitted to.

A Target lists its memory levels from the fastest (registers) outwards. A level's capacity
is one instance's size in bytes; `processors` is how many processors share that instance, so
each processor's share is capacity / processors (the paper's S / Np).

A compute-in-memory target (kind "cim", `Target.cim`) also carries its `CimArch` (`cim_arch`): the weights
sit in memristor crossbars, and rewriting them is the move its schedules minimise.
"""
from __future__ import annotations

import os
import platform
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from maco.core.errors import MacoError
from maco.core.spec import DTYPE_BYTES


TARGET_KINDS = ("cpu", "cuda", "cim")
CPU_ISAS = {"avx512": (16, 32), "avx2": (8, 16), "generic": (4, 16)}  # isa: fp32 lanes, vector registers


@dataclass(frozen=True)
class MemoryLevel:
    name: str
    capacity: int  # bytes of one instance
    processors: int = 1  # processors sharing one instance
    vector_width: int = 1  # fp32 elements per access (SIMD lanes, or a warp's coalesced lanes)

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise MacoError(f"MemoryLevel {self.name!r}: capacity must be positive, got {self.capacity}")
        if self.processors <= 0:
            raise MacoError(f"MemoryLevel {self.name!r}: processors must be positive, got {self.processors}")
        if self.vector_width <= 0:
            raise MacoError(f"MemoryLevel {self.name!r}: vector_width must be positive, got {self.vector_width}")

    @property
    def elements(self) -> int:
        """fp32 elements one instance holds (the S of the bounds)."""
        return self.capacity // DTYPE_BYTES

    @property
    def elements_per_processor(self) -> int:
        """S / Np: the share of one processor."""
        return self.elements // self.processors


def _positive_ints(owner: str, values: dict[str, Any]) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MacoError(f"{owner}: {name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class CimArch:
    """A weight-rewritable ReRAM compute-in-memory tile: `cores` cores share a global memory;
    each core holds `crossbars` logical crossbars of `rows` x `columns` cells of `cell_bits`
    bits, an input buffer and a partial-sum buffer (bytes per core). A weight of `weight_bits`
    bits spans `cells_per_weight` cells of one row (weight_bits / cell_bits by default; twice that
    for a differential mapping of signed weights), so a crossbar holds rows x weight_columns
    weights. One activation of a crossbar is the hardware's matrix-vector multiply: one input
    vector of `rows` `input_bits`-bit values against every weight column. A DMA transaction moves
    one contiguous run of global memory of at most `dma_burst` bytes.

    The defaults are the published design MACO models (4 cores, 9 crossbars of 64x64 2-bit
    cells, 8-bit weights: 64x16 weights per crossbar); the buffer sizes and the burst are this
    model's own choices, since the design does not state them."""

    cores: int = 4
    crossbars: int = 9
    rows: int = 64
    columns: int = 64
    cell_bits: int = 2
    weight_bits: int = 8
    cells_per_weight: int = 0  # 0: weight_bits // cell_bits
    input_bits: int = 8
    psum_bytes: int = 4  # one partial sum (int32)
    input_buffer: int = 64 << 10
    psum_buffer: int = 64 << 10
    dma_burst: int = 256

    def __post_init__(self) -> None:
        if self.cells_per_weight == 0 and not isinstance(self.cell_bits, bool) \
                and isinstance(self.cell_bits, int) and isinstance(self.weight_bits, int) \
                and self.cell_bits > 0:
            object.__setattr__(self, "cells_per_weight", -(-self.weight_bits // self.cell_bits))
        _positive_ints("CimArch", {f: getattr(self, f) for f in CIM_FIELDS})
        fewest = -(-self.weight_bits // self.cell_bits)
        if self.cells_per_weight not in (fewest, 2 * fewest):
            raise MacoError(f"CimArch: a {self.weight_bits}-bit weight takes {fewest} cells of "
                            f"{self.cell_bits} bits (offset binary) or {2 * fewest} (a differential "
                            f"pair), not {self.cells_per_weight}")
        if self.cells_per_weight > self.columns:
            raise MacoError(f"CimArch: a weight of {self.cells_per_weight} cells does not fit a "
                            f"crossbar row of {self.columns} cells")

    @property
    def weight_columns(self) -> int:
        """Weights side by side in one crossbar row (16 by default)."""
        return self.columns // self.cells_per_weight

    @property
    def core_weights(self) -> int:
        """Weights one core's crossbars hold at once (S_w of the weight-update bound)."""
        return self.crossbars * self.rows * self.weight_columns

    @property
    def psum_capacity(self) -> int:
        """Partial sums one core's buffer holds (S_p of the bound)."""
        return self.psum_buffer // self.psum_bytes

    @property
    def input_bytes(self) -> int:
        """Bytes of one input element in global memory and the input buffer."""
        return -(-self.input_bits // 8)

    def to_dict(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in CIM_FIELDS}


CIM_FIELDS = ("cores", "crossbars", "rows", "columns", "cell_bits", "weight_bits", "cells_per_weight",
              "input_bits", "psum_bytes", "input_buffer", "psum_buffer", "dma_burst")


@dataclass(frozen=True)
class Target:
    """A machine as the tuner sees it: kind ("cpu" or "cuda"), memory levels, parallelism, peak."""

    name: str
    kind: str
    levels: tuple[MemoryLevel, ...]
    cores: int  # CPU threads the kernels run on, or GPU streaming multiprocessors
    simd_width: int  # fp32 lanes of one vector instruction (CPU) or one warp (GPU)
    isa: str = "generic"  # "avx512", "avx2", "generic" on CPU; "sm_90" etc. on GPU
    freq_ghz: float = 0.0
    fma_units: int = 2  # vector FMA pipes per core (CPU) or fp32 FMA lanes per SM / simd_width (GPU)
    model: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    cim_arch: CimArch | None = None  # the crossbar architecture of a "cim" target

    def __post_init__(self) -> None:
        if self.kind not in TARGET_KINDS:
            raise MacoError(f"Target.kind must be one of {TARGET_KINDS}, got {self.kind!r}")
        if not self.levels:
            raise MacoError("a Target needs at least one memory level")
        if (self.kind == "cim") != (self.cim_arch is not None):
            raise MacoError("a 'cim' target needs its CimArch (Target.cim), and only it has one")

    def level(self, name: str) -> MemoryLevel:
        for lvl in self.levels:
            if lvl.name == name:
                return lvl
        raise MacoError(f"target {self.name!r} has no memory level {name!r}; "
                        f"it has {[lvl.name for lvl in self.levels]}")

    def level_bytes(self, name: str, default: int) -> int:
        """Bytes of level `name` that one processor has to itself (`default` where there is none)."""
        try:
            lvl = self.level(name)
        except MacoError:
            return default
        return lvl.capacity // lvl.processors

    @property
    def peak_gflops(self) -> float:
        """Nominal fp32 FMA peak: cores * pipes * lanes * 2 flops * GHz (0 when the clock is unknown)."""
        return self.cores * self.fma_units * self.simd_width * 2 * self.freq_ghz

    @property
    def device(self) -> str:
        """The torch device its kernels run on: "cuda" for a GPU target, else "cpu"."""
        return "cuda" if self.kind == "cuda" else "cpu"

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this machine in tuning records."""
        out = {"name": self.name, "kind": self.kind, "model": self.model, "isa": self.isa,
               "cores": self.cores, "levels": [[lvl.name, lvl.capacity, lvl.processors]
                                               for lvl in self.levels]}
        if self.cim_arch is not None:
            out["cim_arch"] = self.cim_arch.to_dict()
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["levels"] = [asdict(lvl) for lvl in self.levels]
        if self.cim_arch is None:
            del d["cim_arch"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Target":
        d = dict(d)
        d["levels"] = tuple(MemoryLevel(**lvl) for lvl in d["levels"])
        if d.get("cim_arch") is not None:
            d["cim_arch"] = CimArch(**d["cim_arch"])
        return cls(**d)

    @classmethod
    def from_fingerprint(cls, fp: dict[str, Any]) -> "Target":
        """The CPU a record's fingerprint names, as far as it names it (no clock): enough to compute
        a schedule's features for the machine it was measured on."""
        if fp.get("kind") != "cpu" or fp.get("isa") not in CPU_ISAS:
            raise MacoError(f"not a CPU fingerprint MACO knows: kind {fp.get('kind')!r}, isa {fp.get('isa')!r}")
        width = CPU_ISAS[fp["isa"]][0]
        levels = tuple(MemoryLevel(str(name), int(capacity), int(processors), width)
                       for name, capacity, processors in fp["levels"])
        return cls(name=str(fp["name"]), kind="cpu", levels=levels, cores=int(fp["cores"]), simd_width=width,
                   isa=fp["isa"], model=str(fp["model"]))

    # -- built-in targets ----------------------------------------------------
    @classmethod
    def host(cls, threads: int | None = None) -> "Target":
        """The CPU this process runs on, read from /proc/cpuinfo and sysfs (falls back to typical values),
        with `threads` threads (default: every CPU this process may use). The thread count is part of
        the fingerprint, so records tuned on 2 threads are not taken for 1."""
        flags, model, mhz = _cpuinfo()
        isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags and "fma" in flags else "generic"
        width, nregs = CPU_ISAS[isa]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise MacoError(f"threads must be a positive int, got {threads!r}")
            cores = threads
        levels = [MemoryLevel("registers", nregs * width * DTYPE_BYTES, 1, width)]
        for level, size, shared in _caches():
            levels.append(MemoryLevel(f"L{level}", size, max(1, min(shared, cores)), width))
        if len(levels) == 1:  # no sysfs: assume a common desktop hierarchy
            levels += [MemoryLevel("L1", 32 << 10, 1, width), MemoryLevel("L2", 1 << 20, 1, width),
                       MemoryLevel("L3", 32 << 20, cores, width)]
        return cls(name="host", kind="cpu", levels=tuple(levels), cores=cores, simd_width=width,
                   isa=isa, freq_ghz=round(mhz / 1000.0, 3), fma_units=2,
                   model=model or platform.processor() or "unknown")

    @classmethod
    def h100(cls) -> "Target":
        """NVIDIA H100 SXM/PCIe 80GB: 132 SMs, 64K registers and 228 KiB shared memory per SM, 50 MiB L2.

        Registers are modelled per thread (255 x 4 bytes); shared memory is shared by the two
        blocks MACO keeps resident per SM to hide latency; L2 by all 132 SMs.
        """
        return cls(name="h100", kind="cuda",
                   levels=(MemoryLevel("registers", 255 * DTYPE_BYTES, 1, 1),
                           MemoryLevel("shared", 228 << 10, 2, 32),
                           MemoryLevel("L2", 50 << 20, 132, 32)),
                   cores=132, simd_width=32, isa="sm_90", freq_ghz=1.98, fma_units=4,
                   model="NVIDIA H100 80GB")

    @classmethod
    def cim(cls, arch: CimArch | None = None, **sizes: int) -> "Target":
        """A ReRAM compute-in-memory tile (see CimArch; `sizes` override its fields, e.g.
        psum_buffer=16384). Levels per core: the crossbars (weights at weight_bits each), the
        input buffer and the partial-sum buffer."""
        if arch is None:
            unknown = set(sizes) - set(CIM_FIELDS)
            if unknown:
                raise MacoError(f"unknown CIM size(s) {sorted(unknown)}; known: {', '.join(CIM_FIELDS)}")
            arch = CimArch(**sizes)
        elif sizes:
            raise MacoError("pass either a CimArch or sizes, not both")
        weight_bytes = arch.core_weights * arch.weight_bits // 8
        return cls(name="cim", kind="cim",
                   levels=(MemoryLevel("crossbars", weight_bytes, 1, arch.weight_columns),
                           MemoryLevel("input_buffer", arch.input_buffer, 1, arch.rows),
                           MemoryLevel("psum_buffer", arch.psum_buffer, 1, arch.weight_columns)),
                   cores=arch.cores, simd_width=arch.weight_columns, isa="reram",
                   model=f"ReRAM CIM tile, {arch.cores} cores x {arch.crossbars} crossbars "
                         f"{arch.rows}x{arch.columns}x{arch.cell_bits}b", cim_arch=arch)

    @classmethod
    def named(cls, name: str, threads: int | None = None) -> "Target":
        """'host'/'cpu' (with `threads` threads, see host) or 'h100'/'cuda': the names the CLI accepts."""
        if name in ("host", "cpu"):
            return cls.host(threads)
        if name in ("h100", "cuda"):
            return cls.h100()
        raise MacoError(f"unknown target {name!r}; choose host, cpu, h100 or cuda")


def available_memory() -> int:
    """Bytes this host can still allocate (MemAvailable), or a large number where unknown."""
    try:
        text = Path("/proc/meminfo").read_text()
        m = re.search(r"^MemAvailable:\s*(\d+) kB", text, re.M)
        if m:
            return int(m.group(1)) << 10
    except OSError:
        pass
    return 1 << 62


def require_memory(nbytes: int, what: str) -> None:
    """Fail fast, with the size named, where `what` would need more memory than the host has
    (torch would raise a bare RuntimeError, or the OOM killer end the run, minutes later)."""
    have = available_memory()
    if nbytes > have:
        raise MacoError(f"{what} needs about {nbytes / 2**30:.1f} GiB of memory, "
                        f"more than the {have / 2**30:.1f} GiB available")


def _cpuinfo() -> tuple[set[str], str, float]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set(), "", 0.0
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    mhz = re.search(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M)
    return (set(flags.group(1).split()) if flags else set(),
            model.group(1).strip() if model else "",
            float(mhz.group(1)) if mhz else 0.0)


def _caches() -> list[tuple[int, int, int]]:
    """(level, bytes, cpus sharing) of cpu0's data and unified caches, from sysfs."""
    out = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            if kind == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = _parse_size((index / "size").read_text().strip())
            shared = _count_cpus((index / "shared_cpu_list").read_text().strip())
        except (OSError, ValueError):
            continue
        out.append((level, size, shared))
    return sorted(out)


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]?)", text)
    if not m:
        raise ValueError(text)
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def _count_cpus(cpu_list: str) -> int:
    count = 0
    for part in cpu_list.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count
