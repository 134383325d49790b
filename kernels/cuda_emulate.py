"""Run a generated CUDA kernel's own index arithmetic on the CPU (host C++ build, threads run one
after another between barriers). Why: the codegen can be checked against torch without a GPU."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from maco.core.errors import MacoError
from maco.kernels.cuda_codegen import CudaPlan, pack_weight

_CACHE = Path(tempfile.gettempdir()) / f"maco-cuda-emulate-{os.getuid()}"


def build(plan: CudaPlan) -> Path:
    """Compile the host emulation (cached by source hash)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise MacoError("no host C++ compiler (g++) found for the CUDA emulation")
    src = plan.host_emulation_source()
    exe = _CACHE / f"emu_{hashlib.sha256(src.encode()).hexdigest()[:20]}"
    if exe.exists():
        return exe
    _CACHE.mkdir(parents=True, exist_ok=True)
    tmp = exe.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run([compiler, "-O1", "-std=c++17", "-x", "c++", "-", "-o", str(tmp)],
                          input=src, capture_output=True, text=True)
    if proc.returncode:
        raise MacoError(f"host emulation of {plan.spec} failed to compile:\n{proc.stderr[-3000:]}")
    os.replace(tmp, exe)
    return exe


def run(plan: CudaPlan, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None,
        residual: np.ndarray | None = None) -> np.ndarray:
    """Output of the emulated kernel. x, residual and the result are in the plan's layout
    (NCHW arrays (N, C, H, W) or NHWC arrays (N, H, W, C)); weight is in torch layout."""
    exe = build(plan)
    s = plan.spec
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for name, arr in (("x", x), ("w", pack_weight(plan, weight)), ("b", bias), ("r", residual)):
            if arr is None:
                paths.append("-")
                continue
            p = Path(tmp) / name
            np.ascontiguousarray(arr, dtype=np.float32).tofile(p)
            paths.append(str(p))
        proc = subprocess.run([str(exe), *paths], capture_output=True)
    if proc.returncode:
        raise MacoError(f"emulation of {s} failed: {proc.stderr.decode()[-2000:]}")
    out = np.frombuffer(proc.stdout, dtype=np.float32)
    shape = (s.n, s.k, s.out_h, s.out_w) if plan.schedule.layout == "NCHW" else \
        (s.n, s.out_h, s.out_w, s.k)
    return out.reshape(shape)
