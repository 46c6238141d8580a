"""Device mesh from config: axes ('data', 'fsdp', 'tensor'), all of AxisType.Auto.

`jax.make_mesh` defaults to Explicit axes in current JAX; we ask for Auto so that
`with_sharding_constraint` and jit in/out shardings drive the partitioner (GSPMD style).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Mesh shape over AXES; one entry may be -1 meaning "all remaining devices"."""

    shape: tuple[int, int, int] = (-1, 1, 1)

    def __post_init__(self):
        shape = tuple(int(s) for s in self.shape)
        if len(shape) != len(AXES):
            raise ValueError(f"mesh.shape must have {len(AXES)} entries {AXES}, got {self.shape}")
        if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
            raise ValueError(f"mesh.shape={self.shape}: entries must be positive, with at most one -1")
        object.__setattr__(self, "shape", shape)

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """The concrete shape for `num_devices`; raises a one-line error if it does not divide."""
        known = math.prod(s for s in self.shape if s != -1)
        if -1 in self.shape:
            if num_devices % known:
                raise ValueError(
                    f"mesh.shape={self.shape}: the fixed axes ({known} devices) do not divide the "
                    f"{num_devices} available devices"
                )
            return tuple(num_devices // known if s == -1 else s for s in self.shape)
        if known != num_devices:
            raise ValueError(
                f"mesh.shape={self.shape} needs {known} devices but {num_devices} are available "
                f"(use -1 on one axis to take the rest)"
            )
        return self.shape


def make_mesh(cfg: MeshConfig | None = None, devices: list | None = None) -> Mesh:
    """Builds the ('data', 'fsdp', 'tensor') mesh over `devices` (default: all devices)."""
    cfg = MeshConfig() if cfg is None else cfg
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.resolve(len(devices))
    if devices == list(jax.devices()):
        return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))
