"""``mita taxonomy``: the paper's taxonomy table on the command line."""

from __future__ import annotations

from mita import attention as registry
from mita_experiments.cli import main as cli_main


def test_taxonomy_command_prints_markdown(capsys):
    assert cli_main(["taxonomy"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| method | implemented | scaling |")
    assert len(lines) == 2 + len(registry.names(implemented=False))
    implemented = set(registry.names())
    for name in registry.names(implemented=False):
        assert any(line.startswith(f"| {name} | {'yes' if name in implemented else 'no'} |") for line in lines)
    assert any(line.startswith("| ttt_mlp | yes | compression | 1 | arbitrary (a learned model) |") for line in lines)
    assert any("| no |" in line for line in lines)  # the paper's methods the library does not implement
