"""`resilience.py --parts=multihost`: SIGTERM to one process of a two-process job.

Two JAX processes on 127.0.0.1 (one CPU device each, `tests/train/multihost_run.py`: the toy
`:tiny` run, 2 RL steps) train one job. Once checkpoint 0 is committed, one process — alternately
the coordinator and the other — gets SIGTERM. Every process must exit 0 within 60 s, the newest
checkpoint must read back, and the same two commands must then resume and finish.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import portpicker

from treegrpo_jax.testing import preemption

REPO = pathlib.Path(__file__).resolve().parents[1]
LIMIT_S = 60.0


def _launch(workdir: pathlib.Path, process_id: int, port: int, log: pathlib.Path) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.train.multihost_run", *map(str, (workdir, process_id, 2, port))],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _job(workdir: pathlib.Path, tag: str) -> list[subprocess.Popen]:
    port = portpicker.pick_unused_port()
    return [_launch(workdir, p, port, workdir.parent / f"{workdir.name}-{tag}-p{p}.log") for p in (0, 1)]


def _trial(workdir: pathlib.Path, signalled: int) -> dict:
    procs = _job(workdir, "interrupted")
    record = {"trial": workdir.name, "signalled_process": signalled}
    try:
        deadline = time.monotonic() + 600
        while not (workdir / "checkpoints" / "0").is_dir():
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                return {**record, "ok": False, "error": "a process ended before checkpoint 0"}
            time.sleep(0.05)
        t0 = time.monotonic()
        procs[signalled].send_signal(signal.SIGTERM)
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, LIMIT_S - (time.monotonic() - t0))))
            except subprocess.TimeoutExpired:
                codes.append(None)  # hung (in a collective): the failure this part looks for
        exit_s = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    try:
        readable = bool(preemption.final_params(workdir))
    except Exception:  # noqa: BLE001 — an unreadable checkpoint is a failed trial
        readable = False
    resumed = _job(workdir, "resumed")
    resumed_codes = [p.wait(timeout=900) for p in resumed]
    finished = (workdir / "final_eval.json").is_file()
    ok = codes == [0, 0] and exit_s <= LIMIT_S and readable and resumed_codes == [0, 0] and finished
    return {
        **record,
        "exit_codes": codes,
        "all_exited_s": round(exit_s, 2),
        "checkpoint_readable": readable,
        "resumed_codes": resumed_codes,
        "finished": finished,
        "ok": ok,
    }


def multihost_signal(tmp: pathlib.Path, *, trials: int) -> dict:
    details = []
    for i in range(trials):
        record = _trial(tmp / f"multihost_{i:02d}", signalled=i % 2)
        details.append(record)
        print(
            f"  {i + 1}/{trials} SIGTERM to process {record['signalled_process']}: exit codes "
            f"{record.get('exit_codes')} after {record.get('all_exited_s')} s, ok={record['ok']}",
            flush=True,
        )
    return {
        "multihost_sigterm_trials": len(details),
        "multihost_sigterm_ok": sum(d["ok"] for d in details),
        "multihost_sigterm_max_exit_s": max((d.get("all_exited_s") or 0.0 for d in details), default=None),
        "multihost_details": details,
    }
