"""The CLI prints user errors in one line with a non-zero exit, and every subcommand has help."""
import subprocess
import sys

import pytest

from maco.cli import COMMANDS, main


def test_layers_lists_a_network(capsys):
    assert main(["layers", "alexnet"]) == 0
    out = capsys.readouterr().out
    assert "n1_c64_h27_w27_k192_r5x5_p2" in out and "5 distinct conv layers" in out


def test_user_error_is_one_line_without_traceback(capsys):
    assert main(["layers", "not_a_net"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("maco layers: error: 'not_a_net'") and "Traceback" not in err


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_has_help(command):
    proc = subprocess.run([sys.executable, "-m", "maco.cli", command, "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: maco " + command in proc.stdout
