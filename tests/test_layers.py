"""The import contracts of .importlinter hold: each layer imports only from the layers below it.

The subpackages live in top-level folders that pyproject.toml maps into `maco` (bounds/ ->
maco.bounds, ...). maco/ holds a symlink to each of them, so a bare `lint-imports` in the checkout
sees the package as `pip install .` lays it out; the tests run exactly that command."""
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    """A bare `lint-imports` in `cwd`, the way a developer runs it in the checkout."""
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--no-cache"], cwd=cwd, env={"PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)


def test_each_mapped_folder_has_its_symlink_in_maco():
    """The symlinks are what import-linter walks; one missing or pointing elsewhere hides a layer."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in mapping.items():
        if package == "maco":
            continue
        link = ROOT.joinpath(*package.split("."))
        assert link.is_symlink(), f"{link} is not a symlink to {folder}/"
        assert link.resolve() == (ROOT / folder).resolve(), f"{link} -> {os.readlink(link)}, not {folder}/"


def test_bare_lint_imports_in_the_checkout_keeps_the_contracts():
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout
    walked = int(proc.stdout.split("Analyzed ", 1)[1].split(" files", 1)[0])
    modules = sum(name.endswith(".py") for _, _, names in os.walk(ROOT / "maco", followlinks=True) for name in names)
    assert walked == modules, f"import-linter walked {walked} of the {modules} modules under maco/"


def test_an_upward_import_breaks_the_contracts(tmp_path):
    """The check can fail: the values layer importing the command line, even inside a function."""
    shutil.copytree(ROOT / "maco", tmp_path / "maco", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(ROOT / ".importlinter", tmp_path / ".importlinter")
    files = tmp_path / "maco" / "core" / "files.py"
    files.write_text(files.read_text() + "\n\ndef _up():\n    from maco.commands import common  # noqa\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0 and "maco.core.files -> maco.commands" in proc.stdout, proc.stdout[-2000:]


def test_the_contracts_name_every_module_of_the_library():
    """A module or subpackage missing from the layers would be unconstrained."""
    config = (ROOT / ".importlinter").read_text()
    listed = {name.strip() for line in config.split("layers =", 1)[1].splitlines()
              for name in line.split("|") if name.strip().startswith("maco.")}
    children = {f"maco.{p.stem}" for p in (ROOT / "maco").iterdir()
                if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert sorted(children - listed) == []
