"""What the `launch/` scripts share: the `--config` flag, one-line errors for bad keys, and the
config read back from a workdir.

  _CONFIG = cli.define_config_flag()
  app.run(main, flags_parser=cli.parse_flags)
  cfg = cli.train_config(_CONFIG.value, workdir)
"""

from __future__ import annotations

import os
import sys

from absl import flags
from ml_collections import ConfigDict, config_flags

from treegrpo_jax.train.config import TrainConfig, from_config_dict
from treegrpo_jax.train.config_dict import CONFIG_FILE, flat_keys, load_run_config, nearest_keys

_PREFIX = "--config."
_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def define_config_flag() -> flags.FlagHolder:
    """`--config=FILE[:variant,...]` with `--config.<block>.<field>=` overrides of every field."""
    return config_flags.DEFINE_config_file(
        "config",
        None,
        "Config file (e.g. configs/multihop.py:tiny); omit it to use WORKDIR/config.json of a run.",
        lock_config=True,
    )


def _override_keys(argv: list[str]) -> list[str]:
    return [a[len(_PREFIX) :].split("=", 1)[0] for a in argv if a.startswith(_PREFIX)]


def config_from_argv(argv: list[str]) -> ConfigDict | None:
    """The `--config=` file of `argv` with its `--config.KEY=` overrides applied, parsed into a
    private FlagValues exactly as the launch scripts parse it (None without `--config=`)."""
    spec = [a for a in argv if a.startswith("--config=")]
    if not spec:
        return None
    fv = flags.FlagValues()
    mine = [argv[0], spec[-1], *(a for a in argv if a.startswith(_PREFIX))]
    holder = config_flags.DEFINE_config_file(
        "config", None, "", flag_values=fv, lock_config=True, sys_argv=mine
    )  # ml_collections reads the overrides from sys.argv unless told
    fv(mine)
    return holder.value


def unknown_override(argv: list[str]) -> str | None:
    """One line naming the first `--config.KEY=` of `argv` that the config file has no field for,
    and the nearest keys it does have; None if every key exists."""
    config = config_from_argv([a for a in argv if not a.startswith(_PREFIX)])
    if config is None:
        return None
    keys = flat_keys(config.to_dict())
    for key in _override_keys(argv):
        if key in keys or key.startswith("model.dims."):  # dims: free-form ModelConfig fields
            continue
        if any(k.startswith(f"{key}.") for k in keys):
            continue  # a whole block, e.g. --config.model.dims
        near = ", ".join(nearest_keys(key, config))
        return f"--config.{key}: the config has no such key (nearest: {near})"
    return None


def bundled_config(argv: list[str]) -> list[str]:
    """`argv` with `--config=PATH[:variants]` pointed at the packaged config of PATH's file name
    when PATH does not exist here (an installed wheel run outside the repository:
    `--config=multihop.py:tiny` or `--config=configs/multihop.py:tiny`)."""
    out = []
    for a in argv:
        if a.startswith("--config="):
            path, sep, variants = a[len("--config=") :].partition(":")
            name = os.path.basename(path) if path.endswith(".py") else f"{path}.py"
            packaged = os.path.join(_CONFIGS, name)
            if not os.path.exists(path) and os.path.exists(packaged):
                a = f"--config={packaged}{sep}{variants}"
        out.append(a)
    return out


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad `--config.KEY` reported in one line (exit 2), not as
    ml_collections' AttributeError traceback."""
    argv = bundled_config(argv)
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:
        message = unknown_override(argv) or f"bad --config override: {e}"
    except flags.Error as e:
        message = str(e)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def train_config(config: ConfigDict | None, workdir: str) -> TrainConfig:
    """The run's TrainConfig: from `--config` when given, else from WORKDIR/config.json.
    A bad value exits with its one-line message (`config.<key>: ...`)."""
    try:
        if config is None:
            config = load_run_config(workdir)
            if config is None:
                raise ValueError(f"no --config given and no {workdir}/{CONFIG_FILE} to read it from")
        return from_config_dict(config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
