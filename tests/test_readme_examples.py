"""Example outputs the README shows are what the current code prints (regenerate them when this fails)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO, train_env

README = (REPO / "README.md").read_text()


def shown_examples():
    """(command, expected output) for each `$ train ...` block in the README's code blocks."""
    found = []
    for block in re.findall(r"```\n(.*?)```", README, re.S):
        lines = block.splitlines()
        if lines and lines[0].startswith("$ train "):
            found.append((lines[0][2:], lines[1:]))
    return found


@pytest.mark.parametrize("command, expected", shown_examples(), ids=lambda x: x if isinstance(x, str) else "")
def test_readme_example_output_is_current(command, expected, tmp_path):
    argv = shlex.split(command)[1:]
    proc = subprocess.run([sys.executable, "-m", "launcher", *argv, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                          env=train_env(tmp_path), capture_output=True, text=True, timeout=120)
    printed = (proc.stdout + proc.stderr).splitlines()
    assert printed[:len(expected)] == expected, "\n".join(printed)


def test_the_readme_shows_an_example():
    assert shown_examples(), "the README's bad-config example is gone: update this test with it"
