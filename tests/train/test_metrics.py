"""Metric logs: strict-JSON rows, TensorBoard events, resume truncation, torn lines, multi-process reduce."""

import json
import logging
import math
import os
import struct
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import portpicker
import pytest
from tensorboardX.proto import event_pb2

from treegrpo_jax.train.metrics import MetricsWriter, read_metrics, reduce_across_processes


def _strict_rows(path):
    """Parses metrics.jsonl refusing NaN/Infinity literals (what strict JSON readers do)."""

    def refuse(name):
        raise ValueError(f"non-JSON constant {name}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def _tb_scalars(tb_dir):
    """(tag, step, value) of every scalar in the TensorBoard event files (TFRecord framing)."""
    out, starts = [], []
    for name in sorted(os.listdir(tb_dir)):
        data = (tb_dir / name).read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4  # length, its crc, the record, its crc
            if event.HasField("session_log"):
                starts.append(event.step)
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out, starts


def test_rows_are_strict_json_and_read_back(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(
            1,
            {
                "train/reward_mean": np.float32(0.25),
                "train/tool_calls_mean": jnp.asarray(2.5),
                "rollout/decoded_tokens": np.int64(12345),
                "train/loss": float("nan"),
                "train/grad_norm": np.float64("inf"),
                "train/neg": -math.inf,
                "note": "ok",
            },
        )
        writer.write(2, {"eval/em": 0.5, "eval/em/hotpotqa": jnp.float32(0.75)})
    rows = _strict_rows(tmp_path / "metrics.jsonl")
    assert rows[0]["step"] == 1 and rows[0]["rollout/decoded_tokens"] == 12345
    assert (rows[0]["train/loss"], rows[0]["train/grad_norm"], rows[0]["train/neg"]) == (
        "NaN",
        "Infinity",
        "-Infinity",
    )
    back = read_metrics(tmp_path / "metrics.jsonl")
    assert back[0]["train/reward_mean"] == 0.25 and back[0]["train/tool_calls_mean"] == 2.5
    assert math.isnan(back[0]["train/loss"]) and back[0]["train/grad_norm"] == math.inf
    assert back[0]["note"] == "ok" and back[1] == {"step": 2, "eval/em": 0.5, "eval/em/hotpotqa": 0.75}

    scalars, _ = _tb_scalars(tmp_path / "tb")
    got = {(tag, step): value for tag, step, value in scalars}
    assert got[("train/reward_mean", 1)] == 0.25 and got[("eval/em/hotpotqa", 2)] == 0.75
    assert got[("rollout/decoded_tokens", 1)] == 12345 and math.isnan(got[("train/loss", 1)])
    assert ("note", 1) not in got  # strings go to the JSONL only


def test_truncate_after_for_resume(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in range(1, 6):
            writer.write(step, {"train/reward_mean": step / 10})
        writer.write(4, {"eval/em": 0.4})
    with MetricsWriter(tmp_path) as writer:  # the run restarts from checkpoint 3
        writer.truncate_after(3)
        writer.write(4, {"train/reward_mean": 0.45})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r.get("train/reward_mean")) for r in rows] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
        (4, 0.45),
    ]
    _, starts = _tb_scalars(tmp_path / "tb")
    assert 4 in starts  # TensorBoard drops the first run's events from step 4 on
    assert not list(tmp_path.glob(".metrics.jsonl*"))  # no temporary file left behind
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.truncate_after(-1)
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_torn_last_line_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.')  # killed mid-write
    assert read_metrics(path) == [{"step": 1, "a": 1.0}]
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(2, {"a": 2.5})
    assert read_metrics(path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.5}]
    path.write_text('{"step": 1}\ngarbage\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON object"):
        read_metrics(path)
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_non_primary_writes_nothing_and_bad_values_are_named(tmp_path):
    with MetricsWriter(tmp_path / "p1", is_primary=False) as writer:
        writer.write(1, {"a": 1.0})
        writer.truncate_after(0)
    assert not (tmp_path / "p1").exists()
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        with pytest.raises(ValueError, match="'train/x' must be a scalar"):
            writer.write(1, {"train/x": np.zeros(3)})
        with pytest.raises(TypeError, match="'train/y' must be a number"):
            writer.write(1, {"train/y": [1]})


def test_wandb_missing_is_a_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with caplog.at_level(logging.WARNING), MetricsWriter(tmp_path, wandb_project="treegrpo") as writer:
        writer.write(1, {"a": 1.0})
    assert "wandb is not installed" in caplog.text
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "a": 1.0}]


def test_reduce_single_process_is_a_conversion():
    out = reduce_across_processes({"a": jnp.float32(0.5), "n": np.int64(3)}, sum_keys={"n"})
    assert out == {"a": 0.5, "n": 3.0} and all(type(v) is float for v in out.values())


_REDUCE = textwrap.dedent(
    """
    import json, sys
    import jax
    pid, port = int(sys.argv[1]), sys.argv[2]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from treegrpo_jax.train.metrics import reduce_across_processes
    metrics = {"loss": 1.0 + pid, "tokens": 2**40 + 1 + pid, "calls": 3}
    print("RESULT" + json.dumps(reduce_across_processes(metrics, sum_keys={"tokens", "calls"})))
    """
)


def test_reduce_across_two_processes():
    port = portpicker.pick_unused_port()
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _REDUCE, str(i), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    results = [json.loads(o.split("RESULT")[1].splitlines()[0]) for o in outs if "RESULT" in o]
    assert len(results) == 2, outs
    # Means for losses; exact sums for counters beyond float32's 2**24.
    assert results[0] == results[1] == {"loss": 1.5, "tokens": 2.0**41 + 3, "calls": 6.0}
