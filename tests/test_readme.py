"""The README runs as written: every ``python`` block executes, and its test command is CI's."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(lang: str) -> list[str]:
    return [body for tag, body in BLOCK.findall(README) if tag == lang]


PYTHON_BLOCKS = _blocks("python")


def test_readme_has_python_blocks():
    assert PYTHON_BLOCKS, "README.md has no python code block"


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_block_runs(index):
    # A fresh namespace per block, as a user pasting it into a new interpreter.
    code = compile(PYTHON_BLOCKS[index], f"README.md python block {index}", "exec")
    exec(code, {"__name__": "__readme__"})


def test_readme_test_command_is_what_ci_runs():
    """The README's test command (the line that runs pytest) appears as such in .ci/run."""
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for body in _blocks("bash") for line in body.splitlines()
                if "pytest" in line and not line.strip().startswith("#")]
    assert commands, "README.md gives no test command"
    for command in commands:
        install, _, run = command.partition(" && ")
        extras = re.search(r'-e "\.\[([^\]]*)\]"', install)
        assert extras, f"README test command installs no extras: {command!r}"
        assert f'-e ".[{extras.group(1)}]"' in ci, f".ci/run installs other extras than {command!r}"
        assert run.replace("python ", "python3 ") in ci, f".ci/run does not run {run!r}"
