"""The package installs as a library: every third-party import is declared, the wheel carries the
configs and console scripts, and `treegrpo-train` runs from a fresh venv outside the checkout."""

import ast
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).parents[1]
_PACKAGE = _ROOT / "treegrpo_jax"
# Imported only when asked for (a one-line warning otherwise): not a requirement.
# libtpu: the TPU compiler of `treegrpo-compile`, from the [tpu] extra or beside the venv.
_OPTIONAL = {"wandb", "libtpu"}
# Needed by a default path but never imported by name: transformers' apply_chat_template needs
# Jinja2 (the pretrained path, `treegrpo-generate`).
_INDIRECT = {"jinja2"}


def _third_party_imports() -> set[str]:
    names = set()
    for path in _PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "treegrpo_jax"} - _OPTIONAL


def _requirement_names(extra: str | None = None) -> set[str]:
    out = set()
    for req in importlib.metadata.requires("treegrpo_jax") or []:
        on_extra = re.search(r'extra == "([^"]+)"', req)
        if (on_extra.group(1) if on_extra else None) == extra:
            out.add(re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower().replace("_", "-"))
    return out


def test_every_third_party_import_of_the_package_is_an_install_requirement():
    declared = _requirement_names()
    by_module = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(_third_party_imports() | _INDIRECT):
        dists = {d.lower().replace("_", "-") for d in by_module.get(module, [module])}
        if not dists & declared:
            missing[module] = sorted(dists)
    assert missing == {}, f"imported but not in install_requires: {missing}"
    assert "grain" not in declared, "grain serves no default path: it is a [test] extra"


def test_requirements_are_ranges_and_constraints_pin_them():
    pins = {}
    for line in (_ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    for req in importlib.metadata.requires("treegrpo_jax"):
        spec = req.split(";")[0]
        if "ruff" in spec:
            continue  # the linter's exact version decides the formatting: pinned on purpose
        assert "==" not in spec and "<" in spec and ">=" in spec, f"not a compatible range: {req}"
        name = re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0].lower().replace("_", "-")
        assert name in pins, f"{name} has no exact version in constraints.txt"
        # the venv `make` built holds the pinned version
        assert importlib.metadata.version(name).split("+")[0] == pins[name].split("+")[0], name


def _run(cmd, cwd, timeout=1200):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd[:3]} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.slow
def test_the_wheel_trains_from_a_fresh_venv_outside_the_checkout(tmp_path):
    """~8 min, most of it pip downloading the dependencies into the fresh venv."""
    wheels = tmp_path / "wheels"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(_ROOT),
            "-w",
            str(wheels),
        ],
        tmp_path,
    )
    (wheel,) = wheels.glob("treegrpo_jax-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run([*pip, "-c", str(_ROOT / "constraints.txt"), str(wheel)], tmp_path)
    away = tmp_path / "elsewhere"  # no configs/, no launch/, no checkout on sys.path
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bin_ = venv / "bin"

    r = subprocess.run(
        [str(bin_ / "treegrpo-train"), "--config=multihop.py:tiny", "--workdir=w", "--config.optim.b3=1"],
        cwd=away,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 2 and "nearest: optim.b2" in r.stderr, r.stderr

    r = subprocess.run(
        [str(bin_ / "treegrpo-train"), "--config=multihop.py:tiny,smoke", "--workdir=w"],
        cwd=away,
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (away / "w" / "config.json").exists() and (away / "w" / "index.html").exists()
    assert "eval EM" in r.stdout + r.stderr

    r = subprocess.run(
        [str(bin_ / "treegrpo-eval"), "--workdir=w"],
        cwd=away,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0 and "data source" in r.stdout, r.stderr[-3000:]
    site = subprocess.run(
        [str(bin_ / "python"), "-c", "import treegrpo_jax, jinja2; print(treegrpo_jax.__file__)"],
        cwd=away,
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    assert str(venv) in site.stdout, "the installed copy ran, not the checkout"
