"""Builds and loads the CPU kernels in this folder (`*.cc`, XLA FFI) with the system compiler.

Run at install time (`make install` calls `python -m treegrpo_jax.native.build`); a process
that finds no up-to-date library builds it on first use (a few seconds) and caches it. The
library is keyed by everything its machine code depends on — the sources, the flags, the
jaxlib headers and this CPU's instruction-set flags (`-march=native`) — so a checkout moved
to another machine rebuilds instead of crashing. Without a compiler the kernels are simply
unavailable and every caller takes its XLA path (the reference the kernels are tested against).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax

log = logging.getLogger(__name__)

_HERE = pathlib.Path(__file__).resolve().parent
SOURCES = ("decode_attention.cc", "prefill_attention.cc", "sampling.cc")
HEADERS = ("common.h",)
TARGETS = {  # FFI target name -> exported handler symbol
    "treegrpo_decode_attention": "TreegrpoDecodeAttention",
    "treegrpo_prefill_attention": "TreegrpoPrefillAttention",
    "treegrpo_sample": "TreegrpoSample",
}
# -fopenmp-simd honours `#pragma omp simd` (vectorised reductions) without OpenMP threads:
# the kernels use XLA's own intra-op thread pool.
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp-simd",
    # Reassociation lets reductions (dot products, sums) run as vector trees; no -ffinite-math-only.
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-std=c++17",
    "-shared",
    "-fPIC",
)


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _key(compiler: str) -> str:
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update((_HERE / src).read_bytes())
    h.update(" ".join((compiler, *FLAGS, jax.ffi.include_dir(), jax.__version__, _cpu_flags())).encode())
    return h.hexdigest()[:16]


def _cache_dirs() -> list[pathlib.Path]:
    return [_HERE / "_build", pathlib.Path.home() / ".cache" / "treegrpo_jax" / "native"]


def _compile(compiler: str, out_dir: pathlib.Path, name: str, verbose: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename: a killed build never leaves a library that a
    # later process would load half-written.
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", *(str(_HERE / s) for s in SOURCES), "-o", tmp]
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(tmp, out_dir / name)
    finally:
        pathlib.Path(tmp).unlink(missing_ok=True)
    for old in out_dir.glob("libtreegrpo_native_*.so"):  # builds of other sources or machines
        if old.name != name:
            old.unlink(missing_ok=True)


def build(verbose: bool = False) -> pathlib.Path | None:
    """Compiles the kernels if no up-to-date library exists; returns its path (None: no compiler)."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C++ compiler found: CPU kernels unavailable, using the XLA paths")
        return None
    name = f"libtreegrpo_native_{_key(compiler)}.so"
    for d in _cache_dirs():
        if (d / name).exists():
            return d / name
    errors = []
    for d in _cache_dirs():
        try:
            _compile(compiler, d, name, verbose)
            return d / name
        except (OSError, subprocess.CalledProcessError) as e:
            errors.append(f"{d}: {getattr(e, 'stderr', '') or e}")
    log.warning("building the CPU kernels failed, using the XLA paths:\n%s", "\n".join(errors))
    return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library with its FFI targets registered for CPU (None: unavailable)."""
    path = build()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:  # e.g. a library copied from another machine's build folder
        log.warning("loading the CPU kernels (%s) failed, using the XLA paths: %s", path, e)
        return None
    for name, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


def available() -> bool:
    return library() is not None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    path = build(verbose=True)
    print(f"CPU kernels: {path}" if path else "CPU kernels: unavailable (the XLA paths will be used)")
    sys.exit(0)
