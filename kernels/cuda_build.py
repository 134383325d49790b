"""Offline builds of generated CUDA kernels with nvcc (no GPU, no CuPy needed).

Why: CI has no GPU but has nvcc, so every generated variant is compiled for sm_90 there; on a
GPU machine the same path prebuilds many candidates in parallel (one translation unit holds
many kernels, several nvcc processes run at once) faster than NVRTC one by one.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from maco.core.errors import MacoError
from maco.core.files import write_atomic
from maco.kernels.cuda_codegen import CudaPlan, batch_source


@dataclass(frozen=True)
class Built:
    """Where one kernel lives after a batch build, and what ptxas said about it."""

    cubin: Path
    name: str
    registers: int | None
    spill_bytes: int | None


def find_nvcc() -> str | None:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def kernel_name(plan: CudaPlan) -> str:
    return f"maco_{plan.source_hash}"


def _ptxas_report(stderr: str) -> dict[str, tuple[int | None, int | None]]:
    """{kernel: (registers, spill store bytes)} from `-Xptxas -v` output."""
    out: dict[str, tuple[int | None, int | None]] = {}
    current = None
    spill = None
    for line in stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current, spill = m.group(1), None
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spill = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            out[current] = (int(m.group(1)), spill)
    return out


def _digest_file(cubin: Path) -> Path:
    return cubin.with_name(cubin.name + ".sha256")


def _intact(cubin: Path) -> bool:
    """Whether `cubin` matches the sha256 digest written beside it when it was built: a truncated
    or replaced cubin (or one whose digest was never written) is built again, not loaded."""
    try:
        data = cubin.read_bytes()
        want = _digest_file(cubin).read_text().strip()
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == want


def build(plans: list[CudaPlan], out_dir: str | Path | None = None, arch: str = "sm_90",
          per_unit: int = 8, jobs: int | None = None) -> dict[str, Built]:
    """Compile `plans` to cubins with nvcc, `per_unit` kernels per translation unit, `jobs`
    nvcc processes at a time. Returns {plan.source_hash: Built}. Raises MacoError with the
    compiler's message when a unit fails, or when nvcc is absent."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise MacoError("nvcc not found (set NVCC or put the CUDA toolkit's bin on PATH)")
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="maco-cubin-"))
    out.mkdir(parents=True, exist_ok=True)
    unique = list({p.source_hash: p for p in plans}.values())
    units = [unique[i:i + per_unit] for i in range(0, len(unique), per_unit)]
    jobs = jobs or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)
    result: dict[str, Built] = {}
    pending: list[tuple[subprocess.Popen, list[CudaPlan], Path]] = []

    def finish(proc: subprocess.Popen, group: list[CudaPlan], cubin: Path) -> None:
        _, err = proc.communicate()
        tmp = cubin.with_suffix(f".{os.getpid()}.tmp")
        if proc.returncode:
            tmp.unlink(missing_ok=True)
            raise MacoError(f"nvcc failed on {cubin.with_suffix('.cu')} ({group[0].spec} ...):\n{err[-4000:]}")
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        os.replace(tmp, cubin)  # the cubin first, its digest last: a crash between means "rebuild"
        write_atomic(_digest_file(cubin), digest + "\n")
        report = _ptxas_report(err)
        for p in group:
            regs, spill = report.get(kernel_name(p), (None, None))
            result[p.source_hash] = Built(cubin, kernel_name(p), regs, spill)

    for group in units:
        src = batch_source(group, [kernel_name(p) for p in group])
        digest = hashlib.sha256((src + arch).encode()).hexdigest()[:20]
        cu, cubin = out / f"unit_{digest}.cu", out / f"unit_{digest}.cubin"
        if _intact(cubin):  # built before (same source, same arch) and not damaged since
            for p in group:
                result[p.source_hash] = Built(cubin, kernel_name(p), None, None)
            continue
        write_atomic(cu, src)
        tmp = cubin.with_suffix(f".{os.getpid()}.tmp")
        cmd = [nvcc, f"-arch={arch}", "-cubin", "-std=c++17", "-Xptxas", "-v", "-o", str(tmp), str(cu)]
        while len(pending) >= jobs:
            finish(*pending.pop(0))
        pending.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True), group, cubin))
    while pending:
        finish(*pending.pop(0))
    return result
