"""gcc builds of generated C into a content-addressed cache of shared objects.

The file name is a hash of the source, the flags and the compiler version, so a kernel is built
once per machine; builds go to a temporary file that is renamed into place (atomic, safe when
several processes build the same kernel), and many sources build in parallel, one gcc per core.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import signal
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

from maco.errors import MacoError
from maco.target import Target

BASE_FLAGS = ("-O3", "-std=gnu11", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno",
              "-fno-predictive-commoning")  # it reuses broadcasts across steps and spills
_LIBS: dict[str, ctypes.CDLL] = {}


def cache_dir() -> Path:
    """$MACO_CACHE/kernels-style folder: $MACO_CACHE if set, else ~/.cache/maco/kernels."""
    env = os.environ.get("MACO_CACHE")
    path = Path(env) if env else Path.home() / ".cache" / "maco" / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def compiler() -> str:
    return os.environ.get("CC", "gcc")


@lru_cache(maxsize=4)
def compiler_version(cc: str | None = None) -> str:
    cc = cc or compiler()
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MacoError(f"the CPU backend needs a C compiler; running {cc!r} failed: {exc}") from None
    return out.stdout.splitlines()[0] if out.stdout else cc


def isa_flags(target: Target) -> list[str]:
    """-march=native when the target is this host's ISA, else the ISA's baseline plus host tuning
    (an AVX2 kernel on an AVX-512 host really is AVX2 code)."""
    host = Target.host()
    x86 = platform.machine() in ("x86_64", "AMD64", "i686")
    if target.isa == host.isa or not x86:
        return ["-march=native"]
    arch = {"avx512": "x86-64-v4", "avx2": "x86-64-v3"}.get(target.isa, "x86-64")
    return [f"-march={arch}", "-mtune=native"]


def flags_for(target: Target) -> list[str]:
    return list(BASE_FLAGS) + isa_flags(target)


def key(source: str, flags: list[str]) -> str:
    """Cache key: source + flags + compiler version (+ the CPU model when tuned for -march=native)."""
    h = hashlib.sha256()
    for part in (source, " ".join(flags), compiler_version()):
        h.update(part.encode())
        h.update(b"\0")
    if any("native" in f for f in flags):
        h.update(Target.host().model.encode())
    return h.hexdigest()[:32]


def build(source: str, flags: list[str], out_dir: Path | None = None, timeout: float = 300.0) -> Path:
    """The shared object of `source` (built now unless the cache has it); MacoError with gcc's
    message when it does not compile, or when gcc runs past `timeout` seconds (the tuner gives
    a short one: a variant that takes minutes to compile is not worth its measurement)."""
    out_dir = out_dir or cache_dir()
    so = out_dir / f"k_{key(source, flags)}.so"
    if so.exists():
        return so
    fd, tmp_c = tempfile.mkstemp(suffix=".c", dir=out_dir)
    tmp_so = tmp_c[:-2] + ".so.tmp"
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(source)
        cmd = [compiler(), *flags, tmp_c, "-o", tmp_so]
        # a session of its own, so that a timeout kills cc1 and as too, not only the gcc driver
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise MacoError(f"gcc took longer than {timeout:g} s on {so.name}") from None
        if proc.returncode != 0:
            msg = (stderr or stdout).strip()
            raise MacoError(f"gcc failed ({' '.join(cmd[:-3])}):\n{msg[-4000:]}")
        os.replace(tmp_so, so)
        return so
    finally:
        for path in (tmp_c, tmp_so):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def build_parallel(jobs: list[tuple[str, list[str]]], workers: int | None = None,
                   timeout: float = 300.0) -> list[Path | MacoError]:
    """Build many sources at once (one gcc per core); per job its .so path or its MacoError."""
    def one(job: tuple[str, list[str]]) -> Path | MacoError:
        try:
            return build(*job, timeout=timeout)
        except MacoError as exc:
            return exc

    workers = workers or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                             else (os.cpu_count() or 1))
    if len(jobs) <= 1:
        return [one(j) for j in jobs]
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        return list(pool.map(one, jobs))


def load(so: Path, function: str) -> ctypes._CFuncPtr:
    """The C function `function` of a built kernel (each .so is loaded once per process)."""
    lib = _LIBS.get(str(so))
    if lib is None:
        try:
            lib = ctypes.CDLL(str(so))
        except OSError as exc:
            raise MacoError(f"cannot load kernel {so}: {exc}") from None
        _LIBS[str(so)] = lib
    fn = getattr(lib, function)
    fn.restype = None
    return fn
