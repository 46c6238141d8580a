"""`run.profile_steps`: a `jax.profiler` trace of chosen RL steps, with named host regions.

`run.profile_steps="3:5"` traces RL steps 3, 4 and 5 (from the start of step 3's rollout to the end
of step 5's update and its checkpoint/evaluation) into `WORKDIR/tb/plugins/profile/<time>/`, where
TensorBoard's profile plugin (`tensorboard --logdir WORKDIR/tb`) and Perfetto (the `.trace.json.gz`
file, at ui.perfetto.dev) open it. The host regions are `rollout`, `batch`, `update` (the jitted step,
whose device ops carry the scopes `advantages`, `log_probs` and `minibatch_update`), `evaluation` and
`checkpoint`; `region(name)` adds one anywhere. The trace stops early with the run (SIGTERM, an error).
"""

from __future__ import annotations

import contextlib
import logging
import os

import jax

__all__ = ["StepProfiler", "parse_profile_steps", "region"]

log = logging.getLogger(__name__)


def parse_profile_steps(spec: str) -> tuple[int, int] | None:
    """ "" → None; "3:5" → (3, 5); "7" → (7, 7). Raises ValueError naming the key otherwise."""
    if not spec:
        return None
    first, sep, last = spec.partition(":")
    try:
        a, b = int(first), int(last) if sep else int(first)
    except ValueError:
        a = b = -1
    if a < 1 or b < a:
        raise ValueError(
            f"config.run.profile_steps={spec!r}: want FIRST:LAST RL steps, 1 ≤ FIRST ≤ LAST (e.g. '3:5'), "
            "or '' for no trace"
        )
    return a, b


def region(name: str):
    """A named host region in the trace (a no-op cost when no trace is running)."""
    return jax.profiler.TraceAnnotation(name)


class StepProfiler:
    """Starts the trace before step `first` and stops it after step `last` (RL steps, 1-based)."""

    def __init__(self, spec: str, workdir: str, *, enabled: bool = True):
        self.steps = parse_profile_steps(spec) if enabled else None
        self.log_dir = os.path.join(workdir, "tb")
        self.active = False

    def before(self, step: int) -> None:
        """Called before RL step `step` starts."""
        if self.steps and not self.active and self.steps[0] <= step <= self.steps[1]:
            options = jax.profiler.ProfileOptions()
            # Python function events would flood the trace (a million for two toy steps, then
            # truncated); host regions and XLA ops are what a step's profile needs.
            options.python_tracer_level = 0
            jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True, profiler_options=options)
            self.active = True
            log.warning("profiler: tracing RL steps %d..%d into %s", step, self.steps[1], self.log_dir)

    def after(self, step: int, *arrays) -> None:
        """Called once RL step `step` is done; `arrays` are waited for before a trace stops."""
        if self.active and step >= self.steps[1]:
            self.stop(*arrays)

    def stop(self, *arrays) -> None:
        if not self.active:
            return
        jax.block_until_ready(arrays)
        self.active = False
        jax.profiler.stop_trace()
        log.warning("profiler: trace written under %s/plugins/profile", self.log_dir)

    @contextlib.contextmanager
    def stopping_on_exit(self):
        try:
            yield self
        finally:
            with contextlib.suppress(Exception):  # never hide the error that ended the run
                self.stop()
