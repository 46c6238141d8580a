"""The CPU kernel library: built by the system compiler, keyed by what its code depends on,
and an explicit fallback to the XLA paths where it cannot be built."""

import pathlib
import shutil

import pytest

from treegrpo_jax import native
from treegrpo_jax.native import Kernels, build


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")
def test_kernels_are_built_and_auto_picks_them_on_cpu():
    assert build.available()
    assert native.resolve("auto") is Kernels.NATIVE
    assert native.resolve(Kernels.XLA) is Kernels.XLA


def test_a_fresh_build_lands_atomically_in_its_folder(tmp_path, monkeypatch):
    if build._compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(build, "_cache_dirs", lambda: [tmp_path])
    stale = tmp_path / "libtreegrpo_native_0000000000000000.so"
    stale.write_bytes(b"an older build")
    path = build.build()
    assert path is not None and path.parent == tmp_path and path.stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file, stale one gone
    assert build.build() == path  # up to date: not rebuilt


def test_the_key_follows_the_sources(tmp_path, monkeypatch):
    key = build._key("g++")
    copy = tmp_path / "native"
    shutil.copytree(pathlib.Path(build.__file__).parent, copy, ignore=shutil.ignore_patterns("_build"))
    (copy / "common.h").write_text((copy / "common.h").read_text() + "\n// changed\n")
    monkeypatch.setattr(build, "_HERE", copy)
    assert build._key("g++") != key


def test_without_a_compiler_every_caller_takes_the_xla_path(monkeypatch, caplog):
    monkeypatch.setattr(build, "_compiler", lambda: None)
    assert build.build() is None
    assert "no C++ compiler" in caplog.text
    monkeypatch.setattr(build, "available", lambda: False)
    assert native.resolve("auto") is Kernels.XLA
    with pytest.raises(ValueError, match="needs the CPU backend and a C\\+\\+ compiler"):
        native.resolve("native")


def test_an_unknown_name_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown 'fast'; allowed: \['auto', 'xla', 'native', 'pallas'\]"):
        native.resolve("fast")
