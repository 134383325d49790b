"""Schedules, records and spec text are data users share: a hostile string in any string-typed
field must be refused with a clear MacoError on every path that compiles, and nothing may run.

The payload closes the generated source's comment and adds a constructor that creates a marker
file when the kernel is loaded; `test_the_payload_is_live` shows it does exactly that when it
reaches gcc, so the marker staying absent everywhere else means the path refused it."""
import json
import subprocess
import sys

import pytest

from maco import ConvSpec, Target, kernels
from maco.core.errors import MacoError
from maco.kernels import cpu_build, cuda_codegen
from maco.kernels.cuda_schedule import default_schedule as cuda_default
from maco.kernels.source_text import comment
from maco.tune.records import best_in_files, RecordFile, make_record
from maco.core.schedule import Schedule
from maco.core.timing import Timing

SPEC = ConvSpec(1, 8, 10, 10, 16, 3, 3, padding=1)


def _payloads(marker):
    ctor = (f'__attribute__((constructor)) static void maco_pwn(void) {{ '
            f'FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}')
    return [f"*/ #include <stdio.h>\n{ctor} /*", f"x\n#include <stdio.h>\n{ctor}\n//",
            f"NHWC */ {ctor} /* "]


def _hostile_dicts(base: dict, payload: str):
    """The schedule dict with `payload` in each string-typed field, one field at a time."""
    fields = ["kind", "vector_axis", "layout", "weight_packing"]
    for name in fields:
        yield name, {**base, name: payload}
    yield "inner_order", {**base, "inner_order": [payload, "kh", "kw"]}
    yield "extra key", {**base, "extra": {payload: 1}}
    yield "extra value", {**base, "extra": {"buffers": payload}}
    yield "tiles axis", {**base, "tiles": {**base["tiles"], payload: [1, 1, 1, 1]}}


def _cpu_base():
    return kernels.default_schedule(SPEC, Target.host(), "NHWC")


def _cuda_base():
    return cuda_default(SPEC, Target.h100(), "NCHW")


def test_the_payload_is_live(tmp_path):
    """Positive control: the payload, once in compiled C, runs on load (in a child process)."""
    marker = tmp_path / "ran"
    source = "/* " + _payloads(marker)[0] + " */\nvoid f(void) {}\n"
    so = cpu_build.build(source, ["-O0", "-shared", "-fPIC"], out_dir=tmp_path)
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(so)!r})"], check=True)
    assert marker.exists()


@pytest.mark.parametrize("base", [_cpu_base, _cuda_base], ids=["cpu", "cuda"])
def test_hostile_schedule_fields_are_refused_everywhere(tmp_path, base):
    marker = tmp_path / "ran"
    good = base()
    for payload in _payloads(marker):
        for field, d in _hostile_dicts(good.to_dict(), payload):
            # 1. parsing a shared schedule (a file, a record, a worker job)
            with pytest.raises(MacoError):
                Schedule.from_dict(d)
            with pytest.raises(MacoError):
                Schedule.from_json(json.dumps(d))
            # 2. a Schedule built in Python with the same value, through every compiling entry point
            value = d.get(field, None) if field in ("kind", "vector_axis", "layout", "weight_packing") else None
            if value is None:
                continue
            hostile = Schedule(**{**good.__dict__, field: value})
            assert hostile.problems(SPEC), field
            with pytest.raises(MacoError):
                kernels.compile(SPEC, hostile, target="cpu")
            assert isinstance(kernels.build_many(SPEC, [hostile], "cpu")[0], MacoError)
            with pytest.raises(MacoError):
                cuda_codegen.CudaPlan(SPEC, hostile).unit("k")
        for knob in ((payload, 1), ("buffers", payload), ("split_c", [1, 2])):
            hostile = Schedule(**{**good.__dict__, "extra": (knob,)})
            assert any("knob" in p for p in hostile.problems(SPEC)), knob
            with pytest.raises(MacoError):
                kernels.compile(SPEC, hostile, target="cpu")
            with pytest.raises(MacoError):
                cuda_codegen.CudaPlan(SPEC, hostile).unit("k")
        inner = Schedule(**{**good.__dict__, "inner_order": (payload, "kh", "kw")})
        with pytest.raises(MacoError):
            kernels.compile(SPEC, inner, target="cpu")
    assert not marker.exists()


def test_cpu_schedules_take_no_extra_knobs():
    s = Schedule(**{**_cpu_base().__dict__, "extra": (("buffers", 2),)})
    assert any("the CPU backend has none" in p for p in s.problems(SPEC))


def test_hostile_records_are_skipped_with_their_line_and_never_compiled(tmp_path):
    marker = tmp_path / "ran"
    target = Target.host()
    good = make_record(SPEC, target, _cpu_base(), Timing(1e-3, 1e-3, 1e-3, 0.0, 3, 10))
    path = tmp_path / "r.jsonl"
    RecordFile(path).append(good)
    lines = []
    for payload in _payloads(marker):
        for _, d in _hostile_dicts(good.schedule.to_dict(), payload):
            rec = json.loads(good.to_json())
            rec["schedule"] = d
            rec["timing"]["median"] = rec["timing"]["min"] = 1e-9  # would rank best
            lines.append(json.dumps(rec))
    with open(path, "a") as fh:
        fh.write("\n".join(lines) + "\n")
    f = RecordFile(path)
    with pytest.warns(UserWarning, match=f"skipped {len(lines)} bad record"):
        assert f.load() == [good]
    assert [n for n, _ in f.bad_lines] == list(range(2, len(lines) + 2))
    with pytest.warns(UserWarning):
        best = best_in_files([path], target)
    assert [r.schedule for r in best.values()] == [good.schedule]  # what optimize and experiments use
    assert not marker.exists()


def test_hostile_spec_text_is_refused(tmp_path):
    marker = tmp_path / "ran"
    for payload in _payloads(marker):
        for text in (payload, f"c8_h10_w10_k16_r3_{payload}", f"c8_h10_w10_k16_r3x{payload}"):
            with pytest.raises(MacoError):
                ConvSpec.parse(text)
        with pytest.raises(MacoError):
            ConvSpec.from_dict({**SPEC.to_dict(), "c": payload})
    assert not marker.exists()


def test_generated_comments_take_plain_text_only():
    assert comment("n1_c8 tiles k=1x2x8 order=c,kh,kw") == "/* n1_c8 tiles k=1x2x8 order=c,kh,kw */"
    for bad in ("*/", "a\nb", "x // y", "#include", 'quote "', "back\\slash", None):
        with pytest.raises(MacoError):
            comment(bad)


def test_cli_bench_refuses_a_hostile_schedule_file(tmp_path):
    marker = tmp_path / "ran"
    d = _cpu_base().to_dict()
    d["extra"] = {_payloads(marker)[0]: 1}
    evil = tmp_path / "evil.json"
    evil.write_text(json.dumps(d))
    proc = subprocess.run([sys.executable, "-m", "maco.cli", "bench", str(SPEC), "--schedule", str(evil)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "unknown CPU schedule knob" in proc.stderr
    assert not marker.exists()


def test_a_schedule_with_a_number_python_will_not_read_or_deep_nesting_is_one_line(tmp_path):
    """An integer of more than 4300 digits, or 300,000 levels of nesting, in a schedule file or
    a shared spec is refused with one line (Python's parser raises a bare ValueError for the
    first and recurses on the second)."""
    d = _cpu_base().to_dict()
    text = json.dumps(d).replace('"unroll": 0', '"unroll": 1' + "0" * 5000)
    assert text != json.dumps(d)
    with pytest.raises(MacoError, match="integer of more than 4300 digits"):
        Schedule.from_json(text)
    with pytest.raises(MacoError, match="nested too deeply"):
        Schedule.from_json(json.dumps({**d, "extra": "DEEP"}).replace('"DEEP"', "[" * 300_000 + "]" * 300_000))
    with pytest.raises(MacoError, match="integer of more than 4300 digits"):
        ConvSpec.from_json(SPEC.to_json().replace('"c": 8', '"c": 8' + "0" * 5000))
    evil = tmp_path / "evil.json"
    evil.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "maco.cli", "bench", str(SPEC), "--schedule", str(evil)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and "4300 digits" in proc.stderr
