"""The sharded RL step equals the single-device step (8 fake CPU devices, own process); the
packed layout on a mesh equals the single-device paths step."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "tests.rl.sharded_step_check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shape", ["(8, 1, 1)", "(2, 2, 2)", "(1, 4, 2)", "packed (2, 2, 2)"])
def test_sharded_step_equals_single_device(results, shape):
    assert results["num_devices"] == 8
    r = results[shape]
    assert r["params"] < 1e-5 and r["metrics"] < 1e-4, r
    assert r["skipped"] == 0


def test_outputs_keep_their_shardings(results):
    # wq is [L, E, H, D] = [2, 32, 4, 8]: embed over fsdp, heads over tensor; Adam's moment alike.
    assert results["(1, 4, 2)"]["wq_shard_shape"] == [2, 8, 2, 8]
    assert results["(1, 4, 2)"]["mu_shard_shape"] == [2, 8, 2, 8]
    assert results["(2, 2, 2)"]["wq_shard_shape"] == [2, 16, 2, 8]
    assert results["(8, 1, 1)"]["wq_shard_shape"] == [2, 32, 4, 8]  # pure data parallel: replicated
