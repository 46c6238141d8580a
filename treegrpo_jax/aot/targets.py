"""TPU targets a CPU host can compile for: the TPU compiler (libtpu), topologies, chip figures.

JAX compiles for a TPU *topology description* without owning the TPU: libtpu's compiler runs on
the host, and the compiled program's memory and cost analyses are the TPU compiler's own. This
module finds libtpu, sets up the one process that loads it, and describes each device kind:

  * libtpu is looked for in `$TPU_LIBRARY_PATH`, the `libtpu` package (`pip install
    "treegrpo_jax[tpu]"`), and `<venv>/libtpu/` (where `make install` puts it *beside* the
    environment, so that no other JAX process of the project loads it);
  * the process that compiles says it is a compile-only TPU host: CPU backend by default
    (`JAX_PLATFORMS=cpu`), no metadata-server probe, and libtpu's multi-process lock file off
    (`ALLOW_MULTIPLE_LIBTPU_LOAD`), so two compiles (or a compile beside a training run) never
    lock each other out.

Per-device figures: a *device* is what the topology lists (a v4 topology lists each
TensorCore; a v5p one lists each chip, two cores together). HBM is the compiler's own limit
for one device (it says so in its RESOURCE_EXHAUSTED message); peak bf16 FLOP/s and HBM
bandwidth are the published per-chip figures, per device.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One device of a TPU generation, as a topology lists it."""

    generation: str  # the topology-name prefix: v4, v5e, v5p, v6e
    device_kind: str  # `device.device_kind`
    hbm_bytes: int  # what the compiler allows one device's program (its RESOURCE_EXHAUSTED limit)
    peak_flops: float  # bf16 FLOP/s of one device
    hbm_bandwidth: float  # bytes/s of one device

    def describe(self) -> str:
        return (
            f"{self.device_kind}: {self.hbm_bytes / GiB:.2f} GiB HBM, "
            f"{self.peak_flops / 1e12:.0f} TFLOP/s bf16, {self.hbm_bandwidth / 1e9:.0f} GB/s per device"
        )


# Published per-chip figures (Cloud TPU system architecture pages): v4 275 TFLOP/s, 1,200 GB/s
# per chip of 2 TensorCores (a v4 topology lists each core: half of each); v5e 197 TFLOP/s,
# 819 GB/s; v5p 459 TFLOP/s, 2,765 GB/s; v6e 918 TFLOP/s, 1,640 GB/s. HBM: the compiler's limits.
CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", "TPU v4", int(15.25 * GiB), 137.5e12, 600e9),
    "v5e": Chip("v5e", "TPU v5 lite", int(15.75 * GiB), 197e12, 819e9),
    "v5p": Chip("v5p", "TPU v5", int(95.74 * GiB), 459e12, 2765e9),
    "v6e": Chip("v6e", "TPU v6 lite", int(31.25 * GiB), 918e12, 1640e9),
}
# Single-slice examples (chips per axis); any AxB or AxBxC the generation supports also works.
TOPOLOGY_EXAMPLES = ("v5e:2x2", "v5e:2x4", "v5e:4x4", "v6e:2x4", "v6e:4x4", "v5p:2x2x1", "v4:2x2x1")

_NAME = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})$")


class TargetError(ValueError):
    """A topology name or a TPU compiler that is not there: one line, what to do instead."""


def parse_topology(name: str) -> Chip:
    """The chip of a topology name such as `v5e:2x4`; a `TargetError` lists the known forms."""
    m = _NAME.match(name or "")
    if not m:
        raise TargetError(
            f"--topology={name!r}: not a TPU topology; known chips {', '.join(CHIPS)} as GEN:AxB[xC], "
            f"e.g. {', '.join(TOPOLOGY_EXAMPLES)}"
        )
    return CHIPS[m.group(1)]


def find_libtpu() -> str | None:
    """The path of libtpu.so: `$TPU_LIBRARY_PATH`, the `libtpu` package, or `<venv>/libtpu/`."""
    env = os.environ.get("TPU_LIBRARY_PATH")
    if env and os.path.isfile(env):
        return env
    try:
        import libtpu  # noqa: PLC0415  (the [tpu] extra; absent on most CPU hosts)

        return libtpu.get_library_path()
    except ImportError:
        pass
    beside = os.path.join(sys.prefix, "libtpu", "libtpu", "libtpu.so")
    return beside if os.path.isfile(beside) else None


_COMPILE_ONLY_ENV = {
    "JAX_PLATFORMS": "cpu",  # run nothing on a TPU: only compile for one
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # no multi-process lock file: compiles run side by side
    "TPU_SKIP_MDS_QUERY": "1",  # no metadata server to ask on a non-TPU host
    "TPU_ACCELERATOR_TYPE": "v5litepod-4",  # the host's own type (unused: the topology is named)
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_WORKER_ID": "0",
    "TPU_STDERR_LOG_LEVEL": "3",
    "TPU_MIN_LOG_LEVEL": "3",
}


def compile_only_env() -> dict[str, str]:
    """The environment of a compile-only process (values already set in the caller's win)."""
    path = find_libtpu()
    if path is None:
        raise TargetError(
            "no TPU compiler (libtpu) found: `make install` puts one beside the venv, or "
            '`pip install "treegrpo_jax[tpu]"`, or set TPU_LIBRARY_PATH=/path/to/libtpu.so'
        )
    return _COMPILE_ONLY_ENV | {"TPU_LIBRARY_PATH": path}


def prepare_process() -> None:
    """Sets this process up to compile for TPUs; call before JAX initialises a backend."""
    for key, value in compile_only_env().items():
        os.environ.setdefault(key, value)


def topology_devices(name: str, num_slices: int = 1) -> list:
    """The compile-only devices of a topology (all slices), for a `Mesh`."""
    parse_topology(name)
    from jax.experimental import topologies  # noqa: PLC0415  (after prepare_process)

    kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
    return list(topologies.get_topology_desc(platform="tpu", topology_name=name, **kwargs).devices)


def hosts(devices: list) -> int:
    """How many hosts (JAX processes) the topology spreads its devices over."""
    return len({d.process_index for d in devices})
