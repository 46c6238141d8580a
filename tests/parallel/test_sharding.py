"""Sharded forward equals single-device forward on 8 fake CPU devices (own process)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P

from treegrpo_jax.parallel import MeshConfig, logical_to_spec


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("sharded_check.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shape", ["(8, 1, 1)", "(2, 2, 2)", "(1, 4, 2)", "(1, 1, 8)", "(2, 4, 1)"])
def test_sharded_equals_single_device(results, shape):
    assert results["num_devices"] == 8
    r = results[shape]
    assert r["full"] < 1e-5 and r["cached"] < 1e-5, r


def test_params_are_really_sharded(results):
    # wq is [L, E, H, D] = [2, 64, 8, 8]: embed over fsdp, heads over tensor.
    assert results["(1, 4, 2)"]["wq_shard_shape"] == [2, 16, 4, 8]
    assert results["(1, 1, 8)"]["wq_shard_shape"] == [2, 64, 1, 8]
    assert results["(8, 1, 1)"]["wq_shard_shape"] == [2, 64, 8, 8]  # pure data parallel: replicated


def test_mesh_that_does_not_divide_devices_is_one_line_error(results):
    msg = results["bad_mesh_error"]
    assert msg and "needs 3 devices but 8 are available" in msg and "\n" not in msg


def test_rules_drop_axes_that_do_not_divide():
    class FakeMesh:  # logical_to_spec only reads mesh.shape
        shape = {"data": 2, "fsdp": 1, "tensor": 2}

    # 3 kv heads on a tensor axis of 2: replicate that dimension instead of failing.
    spec = logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), shape=(2, 64, 3, 8), mesh=FakeMesh())
    assert spec == P(None, "fsdp", None, None)
    spec = logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), shape=(2, 64, 4, 8), mesh=FakeMesh())
    assert spec == P(None, "fsdp", "tensor", None)


def test_mesh_config_validation():
    with pytest.raises(ValueError, match="at most one -1"):
        MeshConfig(shape=(-1, -1, 1))
    with pytest.raises(ValueError, match="do not divide"):
        MeshConfig(shape=(-1, 3, 1)).resolve(8)
    assert MeshConfig(shape=(-1, 2, 2)).resolve(8) == (2, 2, 2)
