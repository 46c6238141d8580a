"""The checks every config dataclass makes, written once: one wording for every bad value.

Errors name the field as the caller passes it (`"SchedulerConfig.driver"`, `"config.tree.num_trees"`)
and say what is allowed, so a message is enough to fix the input. This module imports nothing of ours.
"""

from __future__ import annotations

import enum
from typing import TypeVar

E = TypeVar("E", bound=enum.Enum)


def checks_itself(cls: type) -> type:
    """Marks a config dataclass whose `__post_init__` checks every field's type and range with
    a message naming the key: the tests' run-time type checker (jaxtyping + beartype, see
    tests/conftest.py) leaves its constructor alone instead of pre-empting those messages with
    its own (`__no_type_check__`, PEP 484; the class's methods are still checked)."""
    cls.__no_type_check__ = True
    return cls


def as_enum(cls: type[E], value, name: str) -> E:
    """`cls(value)`, or `ValueError("<name>=<value>; allowed: [...]")`."""
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}; allowed: {[v.value for v in cls]}") from None


def check_int(name: str, value, minimum: int, note: str = "") -> int:
    """`value` as a count ≥ `minimum` (a bool is never a count, though Python makes it an int)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int ≥ {minimum}{' ' + note if note else ''}, got {value!r}")
    return value


def check_number(name: str, value, allowed: str, ok) -> float:
    """`value` as a real number with `ok(value)`; `allowed` says what `ok` accepts ("in (0, 1]")."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


__all__ = ["as_enum", "check_bool", "check_int", "check_number"]
