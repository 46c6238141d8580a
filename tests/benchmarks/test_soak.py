"""benchmarks/soak.py: its growth figure against hand-made series, and a short real run end to end."""

import importlib.util
import json
import pathlib
import sys

import pytest

_ROOT = pathlib.Path(__file__).parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, _ROOT / f"benchmarks/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


soak = _load("soak")


def test_growth_reads_the_steady_state_not_the_warmup_or_a_spike():
    flat = [{"step": s, "m": 100.0 + (50.0 if s == 70 else 0.0)} for s in range(1, 201)]
    flat[:10] = [{"step": s, "m": 10.0} for s in range(1, 11)]  # warm-up: allocations before step 50
    g = soak.growth(flat, "m", warmup=50, window=20)
    assert g["first"] == g["last"] == 100.0 and g["growth"] == 0.0  # the spike at step 70 is no leak
    assert g["max_after"] == 150.0
    leak = [{"step": s, "m": 100.0 + s} for s in range(1, 201)]  # +1 per step
    g = soak.growth(leak, "m", warmup=50, window=20)
    assert g["growth"] == pytest.approx(290.5 / 160.5 - 1, rel=1e-9)  # medians of 151..170, 281..300
    assert g["slope_per_100_steps"] == pytest.approx(100.0)


@pytest.mark.slow
def test_a_short_soak_runs_the_real_command_and_reports(tmp_path):
    out = tmp_path / "soak.json"
    rc = soak.main(
        ["--steps=6", "--warmup=2", "--window=2", "--eval_every=3", "--checkpoint_every=2"]
        + [f"--workdir={tmp_path / 'run'}", f"--out={out}"]
    )
    result = json.loads(out.read_text())
    assert result["steps_done"] == 6 and result["returncode"] == 0 and not result["crashed"]
    assert set(result["growth"]) == {"rss_mb", "threads", "open_files", "memory_maps", "compiled_programs"}
    assert [r["step"] for r in result["per_step"]] == [1, 2, 3, 4, 5, 6]
    assert out.with_suffix(".png").is_file()
    assert rc == (0 if result["met"] else 1)
