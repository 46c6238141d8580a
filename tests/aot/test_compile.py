"""Compiles for a TPU topology with the real TPU compiler (libtpu), on this CPU host.

Each compile runs in its own process with the compile-only environment (`aot.targets`), as
`treegrpo-compile` does; without libtpu the tests skip and say how to get it.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from treegrpo_jax.aot import targets

LIBTPU = targets.find_libtpu()
needs_libtpu = pytest.mark.skipif(
    LIBTPU is None,
    reason="no TPU compiler: `make install` puts libtpu beside the venv, or pip install 'treegrpo_jax[tpu]'",
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = os.environ | {"TREEGRPO_TYPECHECK": "0"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_unknown_topology_is_one_line_listing_the_known_ones():
    with pytest.raises(targets.TargetError, match=r"v5e:2x4.*v5p:2x2x1") as e:
        targets.parse_topology("v5litepod-8")
    assert "\n" not in str(e.value)
    assert targets.parse_topology("v6e:4x4").device_kind == "TPU v6 lite"


def test_missing_compiler_says_how_to_get_one(monkeypatch):
    monkeypatch.setenv("TPU_LIBRARY_PATH", "")
    monkeypatch.setattr(targets, "find_libtpu", lambda: None)
    with pytest.raises(targets.TargetError, match="make install"):
        targets.compile_only_env()


@needs_libtpu
def test_compiler_figures_match_a_hand_counted_matmul_and_the_pallas_kernel_lowers_through_mosaic():
    out = _run([os.path.join("tests", "aot", "tpu_matmul_probe.py")], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["devices"], r["device_kind"]) == (4, "TPU v5 lite")
    m, k, n, devices = 1024, 2048, 512, 4
    assert r["compiled"]
    assert r["xla_flops"] == 2 * m * k * n / devices  # rows split over 4 chips
    assert r["argument_bytes"] == (m // devices * k + k * n) * 2  # a's shard + all of b, bf16
    assert r["output_bytes"] == m // devices * n * 2
    assert r["mosaic_kernel"] == {"bfloat16": True, "float32": True}


@needs_libtpu
@pytest.mark.slow
def test_tiny_run_compiles_for_v5e_and_its_report_adds_up(tmp_path):
    path = tmp_path / "report.json"
    args = [
        os.path.join("launch", "compile.py"),
        "--config=configs/multihop.py:tiny",
        "--topology=v5e:2x2",
        "--config.rl.length_buckets=128,256",
        "--config.run.context_len=256",
        "--programs=rl_step T=256,sft_step T=256,decode,fork",
        f"--json={path}",
    ]
    out = _run(args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "| update | rl_step T=256 |" in out.stdout
    report = json.loads(path.read_text())
    assert report["fits"] and report["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    programs = {p["name"]: p for p in report["programs"]}
    assert set(programs) == {"rl_step T=256", "sft_step T=256", "decode", "fork"}
    params = report["model"]["num_params"]
    step = programs["rl_step T=256"]
    # Data parallel: every device holds the params and both Adam moments (f32) plus its rows.
    assert step["argument_bytes"] >= 3 * 4 * params
    assert step["alias_bytes"] >= 3 * 4 * params  # the donated state is updated in place
    # The engine's pool is replicated: each device holds all of it.
    assert programs["fork"]["argument_bytes"] >= report["kv_pool_bytes"]
    assert all(p["live_bytes"] > 0 and p["compiled"] for p in programs.values())
    assert np.isclose(
        report["predicted_step_s"], sum(p["predicted_s"] * p["calls_per_step"] for p in programs.values())
    )


@needs_libtpu
def test_a_run_that_does_not_fit_exits_1_with_the_compilers_verdict(tmp_path):
    # Qwen2.5-7B with f32 weights and Adam on 4 v5e chips: ~30 GiB of state per chip alone.
    args = [
        os.path.join("launch", "compile.py"),
        "--config=configs/multihop.py",
        "--topology=v5e:2x2",
        "--config.model.path=qwen2.5-7b",
        "--config.rl.length_buckets=1024",
        "--config.run.context_len=1024",
        "--config.run.prompts_per_step=4",
        "--config.run.rollout_slots=24",
        "--config.rl.num_minibatches=1",
        "--config.rl.num_microbatches=1",
        "--programs=rl_step",
        f"--json={tmp_path / 'r.json'}",
    ]
    out = _run(args)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "DOES NOT FIT" in out.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert not report["fits"] and report["phases"][0]["phase"] == "update"


@needs_libtpu
@pytest.mark.slow
def test_search_sizes_the_pool_then_the_prompts_and_compiles_the_plan(tmp_path):
    # `:tiny` with a 131,072-token context on 4 v5e chips: 256 slots of replicated bf16 K/V are
    # 32 GiB per chip (1 KiB a token); the search halves the slots until the rollout fits, keeps the
    # prompts (the update alone fits) and compiles the two together.
    args = [
        os.path.join("launch", "compile.py"),
        "--config=configs/multihop.py:tiny",
        "--topology=v5e:2x2",
        "--config.rl.length_buckets=128,131072",
        "--config.run.context_len=131072",
        "--config.run.rollout_slots=256",
        "--programs=rl_step T=128,decode,fork",
        "--search",
        f"--json={tmp_path / 'r.json'}",
    ]
    out = _run(args, timeout=1200)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]  # as configured: no
    report = json.loads((tmp_path / "r.json").read_text())
    assert not report["fits"] and report["kv_pool_bytes"] == 256 * 131072 * 1024
    found = report["largest_fitting"]
    assert 6 <= found["rollout_slots"] < 256 and found["prompts_per_step"] == 8
    plan = found["plan"]
    assert plan["fits"] and plan["rollout_slots"] == found["rollout_slots"]
    assert "fits with" in out.stdout.splitlines()[-1]
