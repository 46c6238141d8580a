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
_count = 0
_installed = False


def _listen(event: str, duration_s: float, **_) -> None:
    global _total_s, _count
    if event == _EVENT:
        with _lock:
            _total_s += duration_s
            _count += 1


def _install() -> None:
    global _installed
    if not _installed:
        monitoring.register_event_duration_secs_listener(_listen)
        _installed = True


def compile_seconds() -> float:
    """Backend compile seconds since the clock was first read (installs the listener once)."""
    with _lock:
        _install()
        return _total_s


def compile_count() -> int:
    """Executables made since the clock was first read: compiled, or loaded from the persistent
    compilation cache (the event wraps both; either way the process now holds one more)."""
    with _lock:
        _install()
        return _count
