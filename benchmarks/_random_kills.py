"""`resilience.py --parts=random`: signals at random moments of a real run, then resume.

One reference run of `configs/resilience.py` (in-process BM25: the moments are the run's own,
no server in the way) compiles everything into a persistent cache; a second, warm run measures
how long a run lasts (and must end bitwise equal to the reference: a cached program is the same
program). Then each trial starts the same command in a fresh workdir and, at a moment drawn
uniformly over the warm run's length (seeded), sends

  * SIGKILL — nothing runs after it; the same command is run again and must end with the
    reference's parameters, logged losses and final evaluation, bit for bit;
  * SIGTERM — the run must exit within 30 s having saved the start of the step it was in (the
    newest checkpoint reads back and is no older than the newest one committed at the signal;
    before the first checkpoint there is nothing to save and the re-run repeats the cold start),
    then the re-run must end bitwise equal too.

Besides the uniform draws, a few trials aim at the moments a uniform draw rarely hits: while a
checkpoint is being written and while an evaluation runs. Each trial records where the signal
landed (cold start, rollout, update/eval, checkpoint write), read from the run's log and workdir.
"""

from __future__ import annotations

import pathlib
import random
import re
import signal
import time
from collections.abc import Callable

from treegrpo_jax.testing import preemption
from treegrpo_jax.testing.preemption import TrainCommand

CONFIG = "configs/resilience.py"
TERM_EXIT_LIMIT_S = 30.0
_BAR = re.compile(r"(cold-start SFT|rollout \(step \d+\)|eval \(step \d+\)|Tree-GRPO)")


def _phase(workdir: pathlib.Path, log: str) -> str:
    """Where the run was: a checkpoint being written, else the last progress bar in its log."""
    if preemption.uncommitted_steps(workdir):
        return "checkpoint write"
    bars = _BAR.findall(log[-4000:])
    if not bars:
        return "start-up"
    last = bars[-1]
    return last.split(" (")[0] if "(" in last else last


def _eval_running(log_path: pathlib.Path) -> Callable[[pathlib.Path], bool]:
    """True once the log shows an evaluation bar after the cold start (step 0's or a later one)."""

    def seen(_workdir: pathlib.Path) -> bool:
        try:
            text = log_path.read_text(errors="replace")
        except OSError:
            return False
        return "eval (step" in text

    return seen


def _committed(workdir: pathlib.Path) -> int | None:
    """The newest committed checkpoint step now (None before the first)."""
    directory = workdir / "checkpoints"
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory.is_dir() else []
    return max(steps, default=None)


def _newest_readable_step(workdir: pathlib.Path) -> int | None:
    steps = sorted(
        (int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()), reverse=True
    )
    for step in steps:
        try:
            preemption.final_params(workdir, step)
            return step
        except Exception:  # noqa: BLE001 — an unreadable step is what we are looking for
            continue
    return None


def _trial(cmd: TrainCommand, ref: pathlib.Path, workdir: pathlib.Path, kind: str, at) -> dict:
    """One interrupted run and its resume. `at` is seconds after start, or a moment predicate."""
    name = workdir.name
    log_path = workdir.parent / f"{name}-interrupted.log"
    t_start = time.monotonic()
    run = cmd.start(workdir, f"{name}-interrupted")
    if callable(at):
        landed = preemption.wait_for(run, workdir, at, timeout_s=600)
    else:
        while run.poll() is None and time.monotonic() - t_start < at:
            time.sleep(0.01)
        landed = run.poll() is None
    record = {"trial": name, "signal": kind, "at_s": round(time.monotonic() - t_start, 2)}
    if not landed:  # the run ended before the moment: nothing to interrupt
        run.wait()
        record.update(interrupted=False, phase="after exit")
    else:
        log = log_path.read_text(errors="replace") if log_path.is_file() else ""
        record["phase"] = _phase(workdir, log)
        committed = _committed(workdir)
        t_sig = time.monotonic()
        run.send_signal(signal.SIGKILL if kind == "SIGKILL" else signal.SIGTERM)
        try:
            rc = run.wait(timeout=120)
        except Exception:  # noqa: BLE001 — a SIGTERM that does not end the run is a failure
            run.kill()
            rc = run.wait()
        record.update(interrupted=True, exit_s=round(time.monotonic() - t_sig, 2), exit_rc=rc)
        if kind == "SIGTERM":
            saved = _newest_readable_step(workdir) if (workdir / "checkpoints").is_dir() else None
            fast = record["exit_s"] <= TERM_EXIT_LIMIT_S
            if committed is None:
                # Before the first checkpoint there is no step to save: the run exits (0 from the
                # cold start; -SIGTERM before the handler is installed, at import) and the re-run
                # repeats it exactly.
                ok = fast and rc in (0, -signal.SIGTERM)
            else:  # the step in flight is given up; its start (committed, or saved now) reads back
                ok = fast and rc == 0 and saved is not None and saved >= committed
            record.update(committed_before=committed, saved_step=saved, term_ok=ok)
    rc = cmd.run(workdir, f"{name}-resumed")
    a, b = preemption.final_params(ref), (preemption.final_params(workdir) if rc == 0 else {})
    identical = (
        rc == 0
        and preemption.bitwise_equal(a, b)
        and preemption.train_rows(ref) == preemption.train_rows(workdir)
    )
    record.update(resumed_rc=rc, identical=identical, seconds=round(time.monotonic() - t_start, 1))
    return record


def random_kills(tmp: pathlib.Path, *, kills: int, terms: int, seed: int) -> dict:
    cmd = TrainCommand(config=CONFIG, cache_dir=str(tmp / "xla_random"))
    ref, warm = tmp / "random_reference", tmp / "random_warm"
    t0 = time.monotonic()
    if cmd.run(ref, "random_reference") != 0:
        raise RuntimeError(f"the reference run failed:\n{preemption.log_tail(ref, 'random_reference')}")
    cold_s = time.monotonic() - t0
    t0 = time.monotonic()
    if cmd.run(warm, "random_warm") != 0:
        raise RuntimeError(f"the warm run failed:\n{preemption.log_tail(warm, 'random_warm')}")
    warm_s = time.monotonic() - t0
    warm_identical = preemption.bitwise_equal(preemption.final_params(ref), preemption.final_params(warm))
    print(f"  reference {cold_s:.0f} s (compiling), warm run {warm_s:.0f} s, identical={warm_identical}")

    rng = random.Random(seed)
    plan: list[tuple[str, object, str]] = []
    for kind, n in (("SIGKILL", kills), ("SIGTERM", terms)):
        if n == 0:
            continue
        # Two aimed trials each (a checkpoint write, an evaluation); the rest uniform in time.
        plan.append((kind, preemption.checkpoint_being_written(2), "aimed: checkpoint write"))
        plan.append((kind, None, "aimed: evaluation"))
        plan += [(kind, rng.uniform(0.0, warm_s), "uniform") for _ in range(n - 2)]
    details = []
    for i, (kind, at, how) in enumerate(plan):
        workdir = tmp / f"random_{i:02d}_{kind.lower()}"
        if how == "aimed: evaluation":
            at = _eval_running(workdir.parent / f"{workdir.name}-interrupted.log")
        record = _trial(cmd, ref, workdir, kind, at)
        record["how"] = how
        details.append(record)
        print(
            f"  {i + 1:2d}/{len(plan)} {kind} at {record['at_s']:5.1f} s ({record['phase']}, {how}): "
            f"exit {record.get('exit_s', '-')} s, identical={record['identical']}"
            + (f", saved step {record.get('saved_step')}" if kind == "SIGTERM" else ""),
            flush=True,
        )
    sigkill = [d for d in details if d["signal"] == "SIGKILL"]
    sigterm = [d for d in details if d["signal"] == "SIGTERM"]
    return {
        "random_config": CONFIG,  # in-process BM25 (the `kill` part's CONFIG uses the HTTP proxy)
        "random_reference_s": round(cold_s, 1),
        "random_warm_run_s": round(warm_s, 1),
        "random_warm_run_identical": warm_identical,
        "random_seed": seed,
        "random_sigkill_trials": len(sigkill),
        "random_sigkill_interrupted": sum(d["interrupted"] for d in sigkill),
        "random_sigkill_identical": sum(d["identical"] for d in sigkill),
        "random_sigterm_trials": len(sigterm),
        "random_sigterm_interrupted": sum(d["interrupted"] for d in sigterm),
        "random_sigterm_exit_ok": sum(bool(d.get("term_ok")) for d in sigterm),
        "random_sigterm_identical": sum(d["identical"] for d in sigterm),
        "random_sigterm_max_exit_s": max((d.get("exit_s", 0.0) for d in sigterm), default=None),
        "random_phases": sorted({d["phase"] for d in details}),
        "random_details": details,
    }
