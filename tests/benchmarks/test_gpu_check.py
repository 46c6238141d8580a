"""`benchmarks/gpu_check.py --smoke`: the prepared GPU script runs end to end here (toy sizes, Pallas
kernels interpreted), its exactness checks pass, and its JSON has every figure the GPU run reports."""

import json
import subprocess
import sys

import pytest

from treegrpo_jax.testing.preemption import REPO


@pytest.mark.slow
def test_gpu_check_smoke_runs_and_its_exactness_checks_pass(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke", "--parts=exact,decode,mfu",
         f"--out={out}"],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ceilings"]["read_bytes_per_s"] > 0 and result["ceilings"]["bf16_flops_per_s"] > 0
    checks = {k: v for k, v in result["exact"].items() if isinstance(v, dict) and "pass" in v}
    assert {
        "cached_vs_full",
        "fork_vs_recompute",
        "pallas_slots",
        "pallas_pages",
        "packed_vs_paths_loss",
    } <= set(checks)
    assert all(c["pass"] for c in checks.values()), checks
    rows = result["decode"]["rows"]
    assert [r["batch"] for r in rows] == [4, 8]
    for r in rows:
        assert r["of_roofline"] > 0 and r["ours_ms_per_step"] > 0
        assert "speedup_vs_transformers" in r  # torch (the test extra) is the peer here
    assert result["mfu"]["mfu"] > 0 and result["mfu"]["tokens"] == 4 * 128
    assert "error" not in json.dumps(result)
    assert "decode batch    8" in done.stdout and "train step MFU" in done.stdout
