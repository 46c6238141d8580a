"""Damaged checkpoints (issue 29 item 4): a committed step whose files were truncated or deleted
resumes from the previous readable step with a warning; a save that cannot be written (disk full)
fails with one clear error and leaves the earlier steps intact."""

import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from flax import nnx

from tests.train.test_checkpoint import _assert_identical, _host, toy_state
from treegrpo_jax.train.checkpoint import (
    DAMAGED_DIR,
    CheckpointConfig,
    Checkpointer,
    CheckpointMismatchError,
    DamagedCheckpointError,
)


def _data_files(step_dir: pathlib.Path, item: str) -> list[pathlib.Path]:
    """The OCDBT data files of one item (where the array bytes live)."""
    return sorted(p for p in (step_dir / item).rglob("*") if p.is_file() and p.parent.name == "d")


def _truncate_params(step_dir):
    files = _data_files(step_dir, "params")
    assert files
    for f in files:
        os.truncate(f, f.stat().st_size // 2)


def _delete_params_file(step_dir):
    _data_files(step_dir, "params")[0].unlink()


def _truncate_extra(step_dir):
    os.truncate(step_dir / "extra" / "metadata", 3)  # the JSON item's one file


def _delete_opt_item(step_dir):
    import shutil

    shutil.rmtree(step_dir / "opt")


def _saved(tmp_path, steps=(1, 2, 3)):
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1, async_save=False)) as ckpt:
        for s in steps:
            ckpt.save(s, toy_state(float(s)), {"step": s})
    return tmp_path / "checkpoints"


_DAMAGES = [_truncate_params, _delete_params_file, _truncate_extra, _delete_opt_item]


@pytest.mark.parametrize("damage", _DAMAGES, ids=lambda f: f.__name__)
def test_damaged_latest_step_resumes_from_the_previous_one(tmp_path, caplog, damage):
    directory = _saved(tmp_path)
    damage(directory / "3")
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1)) as ckpt:
        with pytest.raises((ValueError, KeyError, OSError)):  # the plain restore of step 3 fails
            ckpt.restore(abstract_state=toy_state(0.0))
        with caplog.at_level(logging.WARNING):
            step, (state, extra, _) = ckpt.restore_latest_good(abstract_state=toy_state(0.0))
        assert step == 2 and extra == {"step": 2}
        _assert_identical(_host(state), _host(toy_state(2.0)))
        assert "checkpoint step 3" in caplog.text and "cannot be read" in caplog.text
        assert ckpt.all_steps() == [1, 2]
        # Nothing is lost: the damaged step sits beside the rotation, with what was wrong.
        moved = tmp_path / DAMAGED_DIR / "3"
        assert moved.is_dir() and (moved / "DAMAGE.txt").read_text().strip()
        # The resumed run writes step 3 again, and it reads back.
        assert ckpt.save(3, toy_state(3.5), {"step": 3})
        ckpt.wait()
        assert ckpt.restore_latest_good(abstract_state=toy_state(0.0))[0] == 3
        _assert_identical(_host(ckpt.restore(3, abstract_state=toy_state(0.0)).state), _host(toy_state(3.5)))


def test_two_damaged_steps_fall_back_twice(tmp_path):
    directory = _saved(tmp_path)
    _truncate_params(directory / "3")
    _truncate_extra(directory / "2")
    with Checkpointer(tmp_path) as ckpt:
        step, restored = ckpt.restore_latest_good(abstract_state=toy_state(0.0))
        assert step == 1 and restored.extra == {"step": 1}
    assert sorted(p.name for p in (tmp_path / DAMAGED_DIR).iterdir()) == ["2", "3"]


def test_every_step_damaged_is_an_error_and_nothing_moves(tmp_path):
    directory = _saved(tmp_path, steps=(1, 2))
    _truncate_params(directory / "1")
    _delete_params_file(directory / "2")
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(DamagedCheckpointError, match=r"step 2: .*; step 1: .*start the run afresh"):
            ckpt.restore_latest_good(abstract_state=toy_state(0.0))
        assert ckpt.all_steps() == [1, 2]
    assert not (tmp_path / DAMAGED_DIR).exists()


def test_a_mismatch_is_not_damage(tmp_path):
    _saved(tmp_path, steps=(1,))
    other = toy_state(0.0)
    other = other.replace(params=nnx.State({"w": other.params["w"][:, :4], "b": other.params["b"]}))
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointMismatchError, match="params/w has shape"):
            ckpt.restore_latest_good(abstract_state=other)
        assert ckpt.all_steps() == [1]


# A child process (the file-size limit is per process): step 1 commits, then every file write
# beyond 64 bytes fails with EFBIG, as writes on a full disk fail with ENOSPC.
_FULL_DISK_CHILD = textwrap.dedent(
    """
    import resource, signal, sys
    from tests.train.test_checkpoint import toy_state
    from treegrpo_jax.train.checkpoint import CheckpointConfig, Checkpointer, CheckpointWriteError

    ckpt = Checkpointer(sys.argv[1], CheckpointConfig(every_steps=1))
    ckpt.save(1, toy_state(1.0), {"step": 1})
    ckpt.wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
    try:
        ckpt.save(2, toy_state(2.0), {"step": 2})
        ckpt.wait()
    except CheckpointWriteError as e:
        print("WRITE-ERROR", e, flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    try:
        ckpt.close()
    except CheckpointWriteError:
        pass
    """
)


def test_a_save_on_a_full_disk_fails_clearly_and_keeps_the_previous_step(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_CHILD, str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith("WRITE-ERROR")]
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(lines) == 1, out.stdout + out.stderr[-3000:]
    assert "File too large" in lines[0] and "step 1 is the newest intact checkpoint" in lines[0]
    assert "\n" not in lines[0]
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1]
        step, restored = ckpt.restore_latest_good(abstract_state=toy_state(0.0))
        assert step == 1 and restored.extra == {"step": 1}
        _assert_identical(_host(restored.state), _host(toy_state(1.0)))


def test_closed_loop_noise_is_dropped_and_nothing_else(monkeypatch):
    """The failed read's late tensorstore callbacks print `Event loop is closed` through either
    hook; the filter (installed before the first read) drops exactly those and passes the rest."""
    from treegrpo_jax.train import checkpoint

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(("unraisable", str(u.exc_value))))
    monkeypatch.setattr(sys, "excepthook", lambda k, v, tb: seen.append(("except", str(v))))
    checkpoint._quiet_closed_loop_noise()
    checkpoint._quiet_closed_loop_noise()  # idempotent: one layer, not two

    class Unraisable:
        def __init__(self, error):
            self.exc_value = error

    sys.unraisablehook(Unraisable(RuntimeError("Event loop is closed")))
    sys.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)
    sys.unraisablehook(Unraisable(RuntimeError("something else")))
    sys.excepthook(ValueError, ValueError("Event loop is closed"), None)
    assert seen == [("unraisable", "something else"), ("except", "Event loop is closed")]
