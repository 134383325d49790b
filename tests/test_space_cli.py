"""`maco space` and the Fig. 6 experiment: the printed sizes are the exact counts of maco.space.schedules."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from maco.space import prune, schedules as space
from maco.cli import main
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target


def test_space_prints_both_sizes_and_samples(capsys):
    assert main(["space", "n1_c64_h56_w56_k64_r3_p1", "--samples", "3", "--seed", "4"]) == 0
    out = capsys.readouterr().out
    spec, host = ConvSpec.parse("n1_c64_h56_w56_k64_r3_p1"), Target.host()
    assert str(space.space_size(spec, host)) in out
    assert str(space.space_size(spec, host, pruned=True)) in out
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 3
    for line in lines:
        s = Schedule.from_dict(line["schedule"])
        assert ConvSpec.from_dict(line["spec"]) == spec and space.contains(s, spec, host, pruned=True)


def test_space_gpu_target_and_tolerance(capsys):
    assert main(["space", "n1_c64_h56_w56_k64_r3_p1", "--target", "h100", "--tolerance", "4"]) == 0
    spec = ConvSpec.parse("n1_c64_h56_w56_k64_r3_p1")
    loose = space.space_size(spec, Target.h100(), True, prune.PruneConfig(tolerance=4))
    assert str(loose) in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [(["--target", "tpu"], "unknown target 'tpu'"),
                                         (["--batch", "0"], "--batch"), (["--tolerance", "0.5"], "tolerance"),
                                         (["--samples", "-2"], "--samples")])
def test_space_user_errors(capsys, argv, needle):
    assert main(["space", "n1_c8_h8_w8_k8_r3"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("maco space: error:") and needle in err and "Traceback" not in err


@pytest.mark.slow
def test_fig06_experiment_writes_csv_and_png(tmp_path):
    script = Path(__file__).resolve().parents[1] / "experiments" / "fig06_space_size.py"
    proc = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(open(tmp_path / "fig06_space_size.csv")))
    assert {r["network"] for r in rows} == {"alexnet", "resnet18", "vgg11"}
    assert {r["target"] for r in rows} == {"host", "h100"}
    for r in rows[:6]:
        spec, target = ConvSpec.parse(r["spec"]), Target.named(r["target"])
        assert int(r["unpruned"]) == space.space_size(spec, target)
        assert 0 < int(r["pruned"]) == space.space_size(spec, target, pruned=True) < int(r["unpruned"])
    assert (tmp_path / "fig06_space_size.png").stat().st_size > 10_000
