"""Memory hierarchies the bounds and the schedule space are fitted to.

A Target lists its memory levels from the fastest (registers) outwards. A level's capacity
is one instance's size in bytes; `processors` is how many processors share that instance, so
each processor's share is capacity / processors (the paper's S / Np).
"""
from __future__ import annotations

import os
import platform
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from maco.errors import MacoError
from maco.spec import DTYPE_BYTES


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

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "cuda"):
            raise MacoError(f"Target.kind must be 'cpu' or 'cuda', got {self.kind!r}")
        if not self.levels:
            raise MacoError("a Target needs at least one memory level")

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

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this machine in tuning records."""
        return {"name": self.name, "kind": self.kind, "model": self.model, "isa": self.isa,
                "cores": self.cores, "levels": [[lvl.name, lvl.capacity, lvl.processors]
                                                for lvl in self.levels]}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["levels"] = [asdict(lvl) for lvl in self.levels]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Target":
        d = dict(d)
        d["levels"] = tuple(MemoryLevel(**lvl) for lvl in d["levels"])
        return cls(**d)

    # -- built-in targets ----------------------------------------------------
    @classmethod
    def host(cls, threads: int | None = None) -> "Target":
        """The CPU this process runs on, read from /proc/cpuinfo and sysfs (falls back to typical values),
        with `threads` threads (default: every CPU this process may use). The thread count is part of
        the fingerprint, so records tuned on 2 threads are not taken for 1."""
        flags, model, mhz = _cpuinfo()
        if "avx512f" in flags:
            isa, width, nregs = "avx512", 16, 32
        elif "avx2" in flags and "fma" in flags:
            isa, width, nregs = "avx2", 8, 16
        else:
            isa, width, nregs = "generic", 4, 16
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
