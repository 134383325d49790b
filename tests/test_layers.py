"""The import contracts of .importlinter hold: each layer imports only from the layers below it.

The subpackages live in top-level folders that pyproject.toml maps into `maco` (bounds/ ->
maco.bounds, ...), which import-linter cannot see through an editable install, so the test
stages the package as `pip install .` would lay it out and checks that copy."""
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _stage(dest: Path) -> None:
    """Copy the .py files of every package to where the package-dir mapping installs them."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in mapping.items():
        target = dest.joinpath(*package.split("."))
        for src in (ROOT / folder).rglob("*.py"):
            rel = src.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts or (target / rel).exists():
                continue
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target / rel)


def _lint(staged: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--config", str(ROOT / ".importlinter"), "--no-cache"],
                          cwd=staged, env={"PYTHONPATH": str(staged), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)


def test_import_contracts_hold(tmp_path):
    _stage(tmp_path)
    proc = _lint(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_an_upward_import_breaks_the_contracts(tmp_path):
    """The check can fail: the values layer importing the command line, even inside a function."""
    _stage(tmp_path)
    files = tmp_path / "maco" / "files.py"
    files.write_text(files.read_text() + "\n\ndef _up():\n    from maco.commands import common  # noqa\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0 and "maco.files -> maco.commands" in proc.stdout, proc.stdout[-2000:]


def test_the_contracts_name_every_module_of_the_library(tmp_path):
    """A module or subpackage missing from the layers would be unconstrained."""
    _stage(tmp_path)
    config = (ROOT / ".importlinter").read_text()
    listed = {name.strip() for line in config.split("layers =", 1)[1].splitlines()
              for name in line.split("|") if name.strip().startswith("maco.")}
    children = {f"maco.{p.stem}" for p in (tmp_path / "maco").iterdir()
                if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert sorted(children - listed) == []


if __name__ == "__main__":  # `python tests/test_layers.py`: import-linter's report on the staged package
    import tempfile

    with tempfile.TemporaryDirectory() as staged:
        _stage(Path(staged))
        report = _lint(Path(staged))
        print(report.stdout + report.stderr)
        raise SystemExit(report.returncode)
