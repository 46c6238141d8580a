"""Seconds spent compiling XLA programs in this process, read from JAX's own compile events.

A step whose batch has a shape not seen before compiles its program again; on a CPU a
30-layer model's train step can take minutes to compile, which is then invisible inside
`time/step_s`. The trainer reads this clock around each step and logs `time/compile_s`.
"""

from __future__ import annotations

import threading

from jax import monitoring

# The event JAX records around every backend compile (jax/_src/dispatch.py BACKEND_COMPILE_EVENT).
_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_total_s = 0.0
_installed = False


def _listen(event: str, duration_s: float, **_) -> None:
    global _total_s
    if event == _EVENT:
        with _lock:
            _total_s += duration_s


def compile_seconds() -> float:
    """Backend compile seconds since the clock was first read (installs the listener once)."""
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_listen)
            _installed = True
        return _total_s
