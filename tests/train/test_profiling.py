"""`run.profile_steps` and `run.compile_cache_dir` (issue 32 item 5), on the real command line."""

import gzip
import json

import pytest

from treegrpo_jax.testing import preemption
from treegrpo_jax.testing.preemption import TrainCommand
from treegrpo_jax.train.profiling import parse_profile_steps


def test_parse_profile_steps():
    assert parse_profile_steps("") is None
    assert parse_profile_steps("3:5") == (3, 5)
    assert parse_profile_steps("7") == (7, 7)
    for bad in ("5:3", "0:2", "a:b", "3:", ":4", "1:2:3"):
        with pytest.raises(ValueError, match="config.run.profile_steps"):
            parse_profile_steps(bad)


def test_profile_steps_past_the_run_is_a_config_error():
    from tests.train.toy import toy_config_dict
    from treegrpo_jax.train.config import from_config_dict

    c = toy_config_dict(steps=3)
    c.run.profile_steps = "4:5"
    with pytest.raises(ValueError, match=r"profile_steps='4:5' starts after the last step \(run.steps=3\)"):
        from_config_dict(c)


@pytest.mark.slow
def test_a_run_writes_a_trace_of_its_steps_with_named_regions_and_fills_the_compile_cache(tmp_path):
    cache = tmp_path / "jit_cache"
    cmd = TrainCommand(
        config="configs/resilience.py",
        overrides=("--config.run.profile_steps=2:3", f"--config.run.compile_cache_dir={cache}"),
    )
    w = tmp_path / "run"
    assert cmd.run(w, "run") == 0, preemption.log_tail(w, "run")
    log = preemption.log_tail(w, "run", 50000)
    assert "profiler: tracing RL steps 2..3" in log and "trace written under" in log, log[-3000:]
    (run_dir,) = list((w / "tb" / "plugins" / "profile").iterdir())
    assert list(run_dir.glob("*.xplane.pb")), list(run_dir.iterdir())  # TensorBoard's profile plugin
    perfetto = run_dir / "perfetto_trace.json.gz"  # for ui.perfetto.dev
    events = json.loads(gzip.decompress(perfetto.read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    # Host regions of steps 2 and 3 (step 3 is the run's last: its evaluation is traced too).
    for region in ("rollout", "batch", "update", "evaluation", "checkpoint"):
        assert region in names, sorted(n for n in names if n)[:50]
    assert sum(1 for e in events if e.get("name") == "rollout") == 2  # steps 2 and 3, not step 1
    assert any(f.is_file() for f in cache.rglob("*")), "the persistent compilation cache stayed empty"
