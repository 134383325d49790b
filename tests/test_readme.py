"""The README's torch.compile example runs as written, as a user's script, and checks its own
output against eager torch (its last line asserts it)."""
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _example(name: str) -> str:
    m = re.search(rf"<!-- README example: {name} -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert m, f"README has no '{name}' example"
    return m.group(1)


def test_the_backend_example_runs(tmp_path):
    script = tmp_path / "deploy.py"
    script.write_text(_example("backend") + "print('shape', tuple(y.shape))\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "shape (1, 1000)" in run.stdout
    assert "maco: " in run.stderr and "x the graph" in run.stderr  # the one log line per graph


def test_the_cim_example_runs_and_its_chip_computes_the_conv(tmp_path):
    script = tmp_path / "cim.py"
    script.write_text(_example("cim") + "import torch\n"
                      "ref = torch.nn.functional.conv2d(torch.tensor(x, dtype=torch.float64), "
                      "torch.tensor(w, dtype=torch.float64), padding=1).round().long().numpy()\n"
                      "assert (y == ref).all()\nprint('exact')\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-1] == "exact" and "CimCost(weight_loads=" in run.stdout


def test_the_setup_commands_are_the_ones_ci_runs():
    text = README.read_text()
    base = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
    assert f"```bash\n{base}pip install -e . && maco optimize\n```" in text
    test_command = "pip install torch==2.13.0 && pip install -e '.[test,nas,cluster]' && python -m pytest -q"
    assert f"```bash\n{base}pip install -e '.[test,nas,cluster]' && python -m pytest -q\n```" in text
    assert test_command in (README.parent / ".ci" / "run").read_text()


def test_the_readme_stays_a_guide():
    """Short, with short table cells, and every relative link names a file the repository has."""
    text = README.read_text()
    assert len(text.splitlines()) <= 220
    cells = [c for line in text.splitlines() if line.startswith("|") for c in line.strip("|").split(" | ")]
    assert max(map(len, cells)) <= 300
    for doc in [README, *sorted((README.parent / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links {target}, which the repository lacks"
        assert "DESIGN.md" not in doc.read_text()
