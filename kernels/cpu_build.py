"""gcc builds of generated C into a content-addressed cache of shared objects.

The file name is a hash of the source, the flags and the compiler version, so a kernel is built
once per machine; builds go to a temporary file that is renamed into place (atomic, safe when
several processes build the same kernel), and many sources build in parallel, one gcc per core.

A cached object is trusted only when the sha256 digest stored beside it (k_<key>.so.sha256)
matches its bytes and it holds its own key (the exported string `maco_kernel_key`): a truncated
object would crash the process that dlopens it, and another kernel's object under this name would
silently compute the wrong thing. Anything else is rebuilt. An unwritable cache falls back to a
private temporary one, with one warning; a full one (gcc's "No space left on device", ENOSPC) is a
NoSpaceError naming the folder, which the tuner stops on instead of recording a failed kernel.

`-march=native` is resolved to what it means on this machine (gcc's own expansion: the -march
target, every ISA feature, the cache sizes, -mtune) before it is hashed and compiled, so the key
names the machine's -march target: an object built on another node for this one's expansion has
this node's key (a cluster build, maco.tune.cluster_measure), one built for another ISA never does.
`install` puts such an object into the cache only after the same digest and key checks.
"""
from __future__ import annotations

import atexit
import ctypes
import errno
import hashlib
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

from maco.core.errors import MacoError
from maco.core.files import write_atomic
from maco.core.target import Target

BASE_FLAGS = ("-O3", "-std=gnu11", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno",
              "-fno-predictive-commoning")  # it reuses broadcasts across steps and spills
KEY_SYMBOL = "maco_kernel_key"
STALE_AGE = 3600.0  # seconds: a temporary this old belongs to a build that died, not a running one
_LIBS: dict[str, ctypes.CDLL] = {}
# What the generated kernels of one process share, loaded before any of them with its symbols
# global (a kernel that calls it would not load otherwise): each thread's scratch buffer. Kernels
# that run one after another in a model then reuse the same memory, found in cache, where a buffer
# of each kernel's own was cold on every call (its lines fetched from DRAM before the first write).
RUNTIME = """#include <immintrin.h>
#include <pthread.h>
#include <stdlib.h>
static __thread float *scratch;
static __thread long scratch_floats;
static pthread_key_t owner;  /* frees a thread's scratch when the thread exits */
static pthread_once_t owner_once = PTHREAD_ONCE_INIT;
static long buffers;  /* scratch buffers not freed yet, all threads together */
static void release(void *p) { free(p); __atomic_sub_fetch(&buffers, 1, __ATOMIC_RELAXED); }
static void make_owner(void) { pthread_key_create(&owner, release); }
/* at least `floats` floats on a cache line, the calling thread's own and kept; NULL where out of memory */
float *maco_thread_scratch(long floats) {
  if (floats > scratch_floats) {
    pthread_once(&owner_once, make_owner);
    if (scratch) { free(scratch); __atomic_sub_fetch(&buffers, 1, __ATOMIC_RELAXED); }
    scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    scratch_floats = scratch ? floats : 0;
    if (scratch) __atomic_add_fetch(&buffers, 1, __ATOMIC_RELAXED);
    pthread_setspecific(owner, scratch);
  }
  return scratch;
}
long maco_scratch_buffers(void) { return __atomic_load_n(&buffers, __ATOMIC_RELAXED); }
/* every cache line of [p, p + bytes) written back and dropped from every cache level (clflushopt
   where the CPU has it; clflush, ~30x slower on a long range, where not) */
__attribute__((target("clflushopt"))) static void flush_opt(const char *p, const char *end) {
  for (; p < end; p += 64) _mm_clflushopt((void *)p);
  _mm_sfence();
}
static void flush_plain(const char *p, const char *end) {
  for (; p < end; p += 64) _mm_clflush(p);
  _mm_mfence();
}
void maco_flush(const char *p, long bytes) {
  static int opt = -1;
  if (opt < 0) { __builtin_cpu_init(); opt = __builtin_cpu_supports("clflushopt") != 0; }
  const char *start = (const char *)((unsigned long)p & ~63UL);
  if (bytes > 0) (opt ? flush_opt : flush_plain)(start, p + bytes);
}
"""
_RUNTIME: list[ctypes.CDLL] = []
_USABLE: dict[str, Path] = {}  # cache folder asked for -> folder used (itself, or the fallback)
_SWEPT: set[str] = set()  # folders whose stale temporaries this process has removed
_LOCK = threading.Lock()
_PRIVATE: tuple[int, Path] | None = None  # (pid, folder): this process's temporary folder


class NoSpaceError(MacoError):
    """A build that failed because a disk is full (gcc's "No space left on device", or ENOSPC
    writing the object or its digest): a fault of the machine, not of the kernel, so the tuner
    stops with this one line instead of recording the schedule as failed."""


NO_SPACE = "No space left on device"


def _no_space(folder: Path, detail: str) -> NoSpaceError:
    return NoSpaceError(f"the kernel cache {str(folder)!r} has no space left ({detail}); "
                        "free some space there or point MACO_CACHE at another folder")


def cache_dir() -> Path:
    """$MACO_CACHE if set, else ~/.cache/maco/kernels. When that cannot be written, a private
    temporary folder (one warning), which also goes into MACO_CACHE so that worker processes
    share it: an unwritable cache costs rebuilds, never a traceback."""
    env = os.environ.get("MACO_CACHE")
    path = Path(env) if env else Path.home() / ".cache" / "maco" / "kernels"
    used = _usable(path)
    if used != path:
        os.environ["MACO_CACHE"] = str(used)
    return used


def _usable(path: Path) -> Path:
    """`path` if a file can be created in it (tried for real: permission bits do not stop root),
    else the private fallback, warned about once per path."""
    with _LOCK:
        if str(path) not in _USABLE:
            reason = _unwritable(path)
            if reason is None:
                _USABLE[str(path)] = path
            else:
                fallback = _private_dir()
                warnings.warn(f"the kernel cache {path} cannot be written ({reason}); using a "
                              f"private temporary cache {fallback} for this run", stacklevel=3)
                _USABLE[str(path)] = fallback
        return _USABLE[str(path)]


def _unwritable(path: Path) -> str | None:
    """Why no file can be created in `path`, or None when one can."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix="tmp", suffix=".probe.tmp", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _private_dir() -> Path:
    """This process's temporary folder (made once, removed at exit)."""
    global _PRIVATE
    if _PRIVATE is None or _PRIVATE[0] != os.getpid():
        folder = Path(tempfile.mkdtemp(prefix="maco-kernels-"))
        atexit.register(shutil.rmtree, folder, True)
        _PRIVATE = (os.getpid(), folder)
    return _PRIVATE[1]


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


def resolved_flags(flags: list[str]) -> list[str]:
    """`flags` with -march=native / -mtune=native replaced by gcc's expansion of them on this
    machine (the explicit -march, ISA features, cache sizes and -mtune it hands cc1). Another
    node's gcc compiles the result into the same object; unchanged where there is nothing native
    or the compiler does not say (then `key` adds the CPU model, and the object stays node-bound)."""
    arch = tuple(f for f in flags if f.startswith("-m"))
    if not any("native" in f for f in arch):
        return list(flags)
    expansion = _expand(arch, compiler())
    if expansion is None:
        return list(flags)
    return [f for f in flags if not f.startswith("-m")] + list(expansion)


@lru_cache(maxsize=16)
def _expand(arch: tuple[str, ...], cc: str) -> tuple[str, ...] | None:
    """The machine options gcc's driver passes to cc1 for `arch` (`gcc -###`), or None."""
    try:
        run = subprocess.run([cc, *arch, "-###", "-x", "c", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    cc1 = next((line for line in run.stderr.splitlines() if "/cc1 " in line), None)
    if run.returncode != 0 or cc1 is None:
        return None
    out, tokens = [], shlex.split(cc1)
    for i, token in enumerate(tokens):
        if token.startswith("-m"):
            out.append(token)
        elif token == "--param" and i + 1 < len(tokens):
            out.append(f"--param={tokens[i + 1]}")
    if any("native" in t for t in out) or not any(t.startswith("-march=") for t in out):
        return None
    return tuple(out)


def key(source: str, flags: list[str]) -> str:
    """Cache key: source + flags as resolved on this machine (so the -march target) + compiler
    version (+ the CPU model where -march=native could not be resolved)."""
    flags = resolved_flags(flags)
    h = hashlib.sha256()
    for part in (source, " ".join(flags), compiler_version()):
        h.update(part.encode())
        h.update(b"\0")
    if any("native" in f for f in flags):
        h.update(Target.host().model.encode())
    return h.hexdigest()[:32]


def build(source: str, flags: list[str], out_dir: Path | None = None, timeout: float = 300.0) -> Path:
    """The shared object of `source` (built now unless the cache has an intact one); MacoError with
    gcc's message when it does not compile, or when gcc runs past `timeout` seconds (the tuner gives
    a short one: a variant that takes minutes to compile is not worth its measurement)."""
    out_dir = _usable(Path(out_dir)) if out_dir else cache_dir()
    k = key(source, flags)
    so = out_dir / f"k_{k}.so"
    if _intact(so, k) is None:
        _compile(_with_key(source, k), resolved_flags(flags), so, timeout)
    return so


def shipped(so: Path) -> bytes:
    """The checked bytes of a cached object, to hand to another node's `install`."""
    data = _intact(so, so.name[2:-3])
    if data is None:
        raise MacoError(f"kernel {so} is missing or damaged; building the kernel again replaces it")
    return data


def install(source: str, flags: list[str], data: bytes, digest: str,
            out_dir: Path | None = None) -> Path | None:
    """Put an object built on another node into this node's cache: only when `data` matches
    `digest` and holds the key this node computes for (source, flags), i.e. the same source,
    flags, compiler and -march target. Its path, or None when it is not this node's kernel (the
    caller builds it here). load() checks it again before dlopen, as every cached object."""
    out_dir = _usable(Path(out_dir)) if out_dir else cache_dir()
    k = key(source, flags)
    so = out_dir / f"k_{k}.so"
    if _intact(so, k) is not None:
        return so
    if hashlib.sha256(data).hexdigest() != digest or k.encode() + b"\0" not in data:
        return None
    # as in _compile: the object first, its digest last, each whole or not at all
    try:
        write_atomic(so, data)
        write_atomic(_digest_file(so), digest + "\n")
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _no_space(out_dir, f"installing {so.name}: {exc.strerror}") from None
        raise MacoError(f"cannot write to the kernel cache {str(out_dir)!r}: {exc.strerror or exc}") from None
    return so


def _with_key(source: str, k: str) -> str:
    """The source gcc compiles: `source` plus an exported string holding its cache key, so that a
    loaded object can be asked whose kernel it is."""
    return (f'{source}\n__attribute__((visibility("default"), used)) '
            f'const char {KEY_SYMBOL}[] = "{k}";\n')


def _digest_file(so: Path) -> Path:
    return so.with_name(so.name + ".sha256")


def _intact(so: Path, k: str) -> bytes | None:
    """The bytes of `so` when they match the digest beside them and hold the key `k`; None when
    the object or its digest is missing, truncated, or another kernel's."""
    try:
        data = so.read_bytes()
        want = _digest_file(so).read_text().strip()
    except OSError:
        return None
    if hashlib.sha256(data).hexdigest() != want or k.encode() + b"\0" not in data:
        return None
    return data


def _compile(source: str, flags: list[str], so: Path, timeout: float) -> None:
    """gcc `source` (read from stdin, so the object does not depend on a temporary file's name:
    two processes building one kernel write the same bytes) into `so` and its digest, atomically."""
    _sweep(so.parent)
    try:
        so.parent.mkdir(parents=True, exist_ok=True)  # it may have been deleted since it was checked
        fd, tmp_so = tempfile.mkstemp(prefix="tmp", suffix=".so.tmp", dir=so.parent)
        os.close(fd)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _no_space(so.parent, f"creating a file for {so.name}: {exc.strerror}") from None
        raise MacoError(f"cannot write to the kernel cache {so.parent}: {exc.strerror}") from None
    try:
        cmd = [compiler(), *flags, "-x", "c", "-", "-o", tmp_so]
        # a session of its own, so that a timeout kills cc1 and as too, not only the gcc driver
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(source, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise MacoError(f"gcc took longer than {timeout:g} s on {so.name}") from None
        if proc.returncode != 0:
            msg = (stderr or stdout).strip()
            if NO_SPACE in msg:  # in the cache, or in gcc's own temporaries (TMPDIR): named in its line
                line = next(x for x in msg.splitlines() if NO_SPACE in x)
                raise _no_space(so.parent, f"gcc: {line.strip()[:300]}")
            raise MacoError(f"gcc failed ({' '.join(cmd[:-5])[:300]}):\n{msg[-4000:]}")
        digest = hashlib.sha256(Path(tmp_so).read_bytes()).hexdigest()
        # the object first, its digest last: a crash in between leaves an old or no digest,
        # which reads as "rebuild", never as "trust"
        os.replace(tmp_so, so)
        write_atomic(_digest_file(so), digest + "\n")
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _no_space(so.parent, f"writing {so.name}: {exc.strerror}") from None
        raise
    finally:
        try:
            os.unlink(tmp_so)
        except FileNotFoundError:
            pass


def _sweep(folder: Path) -> None:
    """Remove temporaries of builds that died (gcc or Python killed) more than STALE_AGE ago,
    once per folder and process; younger ones may belong to a build running elsewhere."""
    if str(folder) in _SWEPT:
        return
    _SWEPT.add(str(folder))
    now = time.time()
    for pattern in ("tmp*.c", "tmp*.tmp", ".*.tmp"):
        for path in folder.glob(pattern):
            try:
                if now - path.lstat().st_mtime > STALE_AGE:
                    path.unlink()
            except OSError:
                pass  # gone already, or another process's business


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


def runtime() -> ctypes.CDLL:
    """RUNTIME, built and loaded once per process with its symbols global (before any kernel)."""
    if not _RUNTIME:
        _RUNTIME.append(_open(build(RUNTIME, list(BASE_FLAGS)), global_symbols=True))
    return _RUNTIME[0]


def load(so: Path, function: str) -> ctypes._CFuncPtr:
    """The C function `function` of a kernel from `build` (each loaded once per process). The
    object is checked before dlopen (digest and key: a damaged file would crash this process)
    and after it (the exported key: dlopen may hand back another object loaded before under this
    path); a check that fails is a MacoError, build() again to rebuild."""
    lib = _LIBS.get(str(so))
    if lib is None:
        runtime()
        lib = _LIBS[str(so)] = _open(Path(so))
    fn = getattr(lib, function)
    fn.restype = None
    return fn


def pointer_function(source: str, target: Target, function: str, args: int, what: str) -> ctypes._CFuncPtr:
    """`function` of `source` built for `target` (from the cache when built before), taking `args`
    pointers: the generated `what` kernels (linear, pooling, depthwise, Winograd), CPU code only."""
    if target.kind != "cpu":
        raise MacoError(f"generated {what} kernels are CPU code, not for {target.name!r}")
    fn = load(build(source, flags_for(target)), function)
    fn.argtypes = [ctypes.c_void_p] * args
    return fn


def _open(so: Path, global_symbols: bool = False) -> ctypes.CDLL:
    m = re.fullmatch(r"k_([0-9a-f]{32})\.so", so.name)
    if m is None:
        raise MacoError(f"{so} is not a kernel object of maco's build cache (k_<key>.so)")
    k = m.group(1)
    data = _intact(so, k)
    if data is None:
        raise MacoError(f"kernel {so} is missing, damaged or another kernel's (its digest or key does "
                        "not match); building the kernel again replaces it")
    lib = _dlopen(so, global_symbols)
    if _embedded_key(lib) != k:
        # glibc reuses a handle already open under this path (an object replaced since) or the
        # file changed after the check: run the checked bytes from a path of their own
        fd, fresh = tempfile.mkstemp(prefix="reload-", suffix=".so", dir=_private_dir())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        lib = _dlopen(Path(fresh), global_symbols)
        if _embedded_key(lib) != k:
            raise MacoError(f"kernel {so} does not hold its key {k}; building the kernel again replaces it")
    return lib


def _dlopen(so: Path, global_symbols: bool = False) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL if global_symbols else ctypes.RTLD_LOCAL)
    except OSError as exc:
        raise MacoError(f"cannot load kernel {so}: {exc}") from None


def _embedded_key(lib: ctypes.CDLL) -> str | None:
    try:
        return (ctypes.c_char * 33).in_dll(lib, KEY_SYMBOL).value.decode()
    except (ValueError, UnicodeDecodeError):
        return None
