"""Runs `test_loop.py` in a fresh interpreter (see the note there): all of its tests must pass."""

import os
import pathlib
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.slow
def test_loop_tests_pass_in_their_own_process():
    env = {**os.environ, "TREEGRPO_LOOP_OWN_PROCESS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-o",
        "addopts=",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/train/test_loop.py",
    ]
    done = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "6 passed" in out and "skipped" not in out, out[-2000:]
