"""CPU kernels (C++ through the XLA FFI) and the switch between them and their XLA references.

Legend: see each kernel's source. This package imports nothing of ours: `model/` and
`rollout/` call into it.

Every kernel here has an XLA implementation of the same contract next to its caller; that
one is the reference the kernel is tested against, and the path on GPU / TPU or where no
compiler is present. `Kernels.AUTO` picks the kernel on a CPU backend when it builds, and the
Pallas decode kernels on a GPU (the TPU default stays XLA until its Pallas paths are measured on a
TPU).
"""

from __future__ import annotations

import enum

import jax


class Kernels(enum.StrEnum):
    AUTO = "auto"  # native on CPU when the library builds, pallas on GPU, else xla
    XLA = "xla"  # the XLA references (any backend)
    NATIVE = "native"  # the CPU kernels; an error where they cannot run
    PALLAS = "pallas"  # decode attention with JAX's Pallas kernels: pages on GPU / TPU, slots on GPU
    # (interpreted on CPU, for tests); sampling and the TPU slot cache use the XLA paths


def resolve(kernels: Kernels | str) -> Kernels:
    """`auto` → `native` (CPU, when the kernels build), `pallas` (GPU) or `xla` for this process;
    validates a name given as text.

    Raises:
      ValueError: an unknown name, or `native` where the CPU kernels cannot run.
    """
    from treegrpo_jax.native import build  # here, so `python -m treegrpo_jax.native.build` runs clean

    try:
        kernels = Kernels(kernels)
    except ValueError:
        raise ValueError(f"kernels: unknown {kernels!r}; allowed: {[k.value for k in Kernels]}") from None
    backend = jax.default_backend()
    usable = backend == "cpu" and build.available()
    if kernels is Kernels.AUTO:
        return Kernels.NATIVE if usable else Kernels.PALLAS if backend == "gpu" else Kernels.XLA
    if kernels is Kernels.NATIVE and not usable:
        raise ValueError("kernels='native' needs the CPU backend and a C++ compiler (treegrpo_jax/native)")
    return kernels


__all__ = ["Kernels", "resolve"]
