"""The kernel build cache trusts nothing it did not verify (issue 16).

A cached object is used only when the digest beside it matches and it holds its own key; a
damaged or swapped object is rebuilt, an unwritable cache falls back to a private one with one
warning, and temporaries of dead builds are swept.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from maco import ConvSpec, MacoError, Target
from maco.kernels import cpu_build, cuda_build

FLAGS = cpu_build.flags_for(Target.host())
SRC_42 = "void f(float *x) { x[0] = 42; }"
SRC_7 = "void f(float *x) { x[0] = 7; }"


def call_f(so: Path) -> float:
    x = (ctypes.c_float * 1)()
    cpu_build.load(so, "f")(x)
    return x[0]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MACO_CACHE", str(tmp_path))
    return tmp_path


def test_a_truncated_object_is_rebuilt_not_loaded(cache: Path) -> None:
    so = cpu_build.build(SRC_42, FLAGS)
    size = so.stat().st_size
    os.truncate(so, size // 2)  # ELF headers intact, segments cut: dlopen "works", then SIGBUS
    # in a child process, so that a crash fails this test instead of killing pytest
    script = textwrap.dedent(f"""
        import ctypes
        from maco import MacoError
        from maco.kernels import cpu_build
        so = cpu_build.build({SRC_42!r}, {FLAGS!r})
        x = (ctypes.c_float * 1)()
        cpu_build.load(so, "f")(x)
        print(x[0], so.stat().st_size)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.split() == ["42.0", str(size)]


def test_load_checks_the_object_before_dlopen(cache: Path) -> None:
    so = cpu_build.build(SRC_42, FLAGS)
    os.truncate(so, 40)  # shorter than an ELF header: today's dlopen fails without crashing
    with pytest.raises(MacoError, match="damaged"):
        cpu_build.load(so, "f")
    assert cpu_build.build(SRC_42, FLAGS) == so and call_f(so) == 42


def test_a_truncated_real_kernel_is_rebuilt_and_agrees_with_torch(cache: Path) -> None:
    from maco import kernels

    spec = ConvSpec.parse("n1_c4_h6_w6_k8_r3x3_p1")
    so = kernels.compile(spec).so
    os.truncate(so, 40)
    kernel = kernels.compile(spec)
    assert kernel.so == so and so.stat().st_size > 40
    x, w = torch.randn(spec.input_shape), torch.randn(spec.weight_shape)
    y = kernel.bind(w)(x)
    ref = torch.nn.functional.conv2d(x, w, None, spec.stride, spec.padding)
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4)


def test_another_kernels_object_with_its_digest_is_caught_by_the_key(cache: Path) -> None:
    so42, so7 = cpu_build.build(SRC_42, FLAGS), cpu_build.build(SRC_7, FLAGS)
    shutil.copy(so7, so42)
    shutil.copy(so7.with_name(so7.name + ".sha256"), so42.with_name(so42.name + ".sha256"))
    with pytest.raises(MacoError, match="another kernel"):
        cpu_build.load(so42, "f")  # the digest matches: only the key tells them apart
    assert cpu_build.build(SRC_42, FLAGS) == so42
    assert call_f(so42) == 42 and call_f(so7) == 7


def test_a_path_dlopen_already_holds_runs_the_rebuilt_object(cache: Path) -> None:
    """glibc hands back the handle already open under a path even after the file was replaced,
    so load() checks the key of what it got and runs the rebuilt object from a path of its own."""
    so42, so7 = cpu_build.build(SRC_42, FLAGS), cpu_build.build(SRC_7, FLAGS)
    shutil.copy(so7, so42)
    ctypes.CDLL(str(so42))  # someone opened the wrong object under this path
    assert cpu_build.build(SRC_42, FLAGS) == so42  # no digest of the copy: rebuilt
    assert call_f(so42) == 42


def test_a_missing_digest_means_rebuild(cache: Path) -> None:
    so = cpu_build.build(SRC_42, FLAGS)
    digest = so.with_name(so.name + ".sha256")
    before = so.stat().st_ino
    digest.unlink()  # as after a crash between writing the object and its digest
    assert cpu_build.build(SRC_42, FLAGS) == so
    assert so.stat().st_ino != before and digest.exists()
    assert call_f(so) == 42


def test_builds_are_byte_identical_so_concurrent_builders_agree(tmp_path: Path) -> None:
    """Two processes building one kernel replace each other's object and digest; identical bytes
    (no temporary file name inside) keep any interleaving of those renames consistent."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = cpu_build.build(SRC_42, FLAGS, out_dir=tmp_path / "a")
    b = cpu_build.build(SRC_42, FLAGS, out_dir=tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()


def test_stale_temporaries_are_swept_fresh_ones_kept(cache: Path) -> None:
    old = [cache / "tmpdead.c", cache / "tmpdead.so.tmp", cache / "tmpdead.sha256.tmp"]
    fresh = [cache / "tmplive.c", cache / "tmplive.so.tmp"]
    other = cache / "notes.txt"
    for path in old + fresh + [other]:
        path.write_text("x")
    hours_ago = time.time() - 2 * cpu_build.STALE_AGE
    for path in old + [other]:
        os.utime(path, (hours_ago, hours_ago))
    cpu_build.build(SRC_42, FLAGS)
    assert [p for p in old if p.exists()] == []
    assert all(p.exists() for p in fresh) and other.exists()


def _unwritable_cases(tmp_path: Path) -> list[Path]:
    (tmp_path / "a_file").write_text("")
    cases = [tmp_path / "a_file" / "kernels", tmp_path / "a_file"]
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        (locked / "probe").touch()  # root writes through permission bits: not a case then
        (locked / "probe").unlink()
    except OSError:
        cases.append(locked)
    return cases


def test_an_unwritable_cache_falls_back_with_one_warning(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in _unwritable_cases(tmp_path):
        monkeypatch.setattr(cpu_build, "_USABLE", {})
        monkeypatch.setenv("MACO_CACHE", str(bad))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            so42 = cpu_build.build(SRC_42, FLAGS)
            so7 = cpu_build.build(SRC_7, FLAGS)
        assert len(caught) == 1, [str(w.message) for w in caught]
        assert str(bad) in str(caught[0].message)
        assert bad not in so42.parents and so42.parent == so7.parent
        assert call_f(so42) == 42 and call_f(so7) == 7
    (tmp_path / "locked").chmod(0o700)


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="nvcc is not installed")
def test_a_truncated_cubin_is_rebuilt(tmp_path: Path) -> None:
    from maco.kernels.cuda_codegen import plan
    from maco.kernels.cuda_schedule import default_schedule

    spec = ConvSpec(1, 16, 8, 8, 32, 1, 1)
    p = plan(spec, default_schedule(spec, layout="NCHW"))
    first = cuda_build.build([p], tmp_path)[p.source_hash]
    size = first.cubin.stat().st_size
    assert cuda_build.build([p], tmp_path)[p.source_hash].registers is None  # a cache hit
    os.truncate(first.cubin, size // 2)
    again = cuda_build.build([p], tmp_path)[p.source_hash]
    assert again.cubin == first.cubin and again.cubin.stat().st_size == size
    assert again.registers is not None  # ptxas ran again


# -- objects built on another node (issue 23: maco.tune.cluster_measure ships them with their key) --
def _shipped(tmp_path: Path, source: str, flags: list[str]) -> tuple[bytes, str]:
    import hashlib

    data = cpu_build.shipped(cpu_build.build(source, flags, out_dir=tmp_path / "builder"))
    return data, hashlib.sha256(data).hexdigest()


def test_the_key_names_the_march_target_native_resolves_to(cache: Path) -> None:
    resolved = cpu_build.resolved_flags(FLAGS)
    assert not any("native" in f for f in resolved) and any(f.startswith("-march=") for f in resolved)
    assert cpu_build.key(SRC_42, FLAGS) == cpu_build.key(SRC_42, resolved)  # another node builds it
    assert cpu_build.key(SRC_42, FLAGS) != cpu_build.key(SRC_42, [*FLAGS[:-1], "-march=x86-64"])


def test_a_shipped_object_is_installed_only_when_it_is_this_nodes_kernel(cache: Path, tmp_path: Path) -> None:
    data, digest = _shipped(tmp_path, SRC_42, cpu_build.resolved_flags(FLAGS))
    assert cpu_build.install(SRC_7, FLAGS, data, digest) is None  # another source's key
    other = [f for f in FLAGS if not f.startswith("-march")] + ["-march=x86-64"]
    assert cpu_build.install(SRC_42, other, data, digest) is None  # built for another ISA
    assert cpu_build.install(SRC_42, FLAGS, data[:-1] + b"x", digest) is None  # damaged on the way
    assert not list(cache.glob("k_*"))
    so = cpu_build.install(SRC_42, FLAGS, data, digest)
    assert so == cache / f"k_{cpu_build.key(SRC_42, FLAGS)}.so" and call_f(so) == 42
    assert cpu_build.build(SRC_42, FLAGS) == so and so.read_bytes() == data  # a cache hit
