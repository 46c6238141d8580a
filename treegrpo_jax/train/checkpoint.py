"""Orbax checkpoints of the train state plus JSON host state; atomic, async, keep-N.

Layout: `WORKDIR/checkpoints/<step>/` with three Orbax items:

* `params`: the policy parameters (`TrainState.params`), on their own so that an export
  (`export.export_hf`) restores them without knowing the optimizer's structure;
* `opt`: `{"opt_state", "step", "skipped"}`, the rest of `TrainState`'s arrays (the
  `graphdef` is static structure, rebuilt from the model config, never saved);
* `extra`: a JSON object of host state: data-loader position, PRNG key data as ints,
  anything the trainer needs to continue exactly where it stopped.

The frozen reference policy of the KL term is constant for a run, so it is written once
(when `save` is given `reference=`) to `WORKDIR/reference/<step>/`, outside the rotation of
`keep`: resuming at any later step still finds it. It is written synchronously, before the
step it came with, so a committed step never lacks the reference it needs.

Atomicity: Orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it to
`<step>` only once every item is complete (on object stores that lack atomic renames it
writes a commit marker instead). A save that a SIGKILL or preemption interrupts therefore
leaves at most a tmp directory: `latest_step()` never lists it, so a restart resumes from
the last good step; the stale directory is removed in the background once the directory is
opened again (and before that run's first save). Old steps beyond `keep` are deleted only
after a newer step has committed.

Async: `save` returns once the arrays have been copied off the accelerator; the files are
written by a background thread, so the next (donating) train step may start at once.
Call `wait()` before reading the files, and `close()` (or use the context manager) at exit.

Multi-host: every process calls `save` / `restore` with the same arguments (they contain
collectives). Each process writes the shards of the arrays it holds; the primary process
(process 0) writes the metadata, the JSON item and performs the commit rename. `restore`
reads each array straight into the shardings of `abstract_state`, so no process ever holds
a full copy of a sharded parameter.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from treegrpo_jax.rl.train_state import TrainState

__all__ = [
    "CheckpointConfig",
    "CheckpointMismatchError",
    "Checkpointer",
    "CheckpointWriteError",
    "DamagedCheckpointError",
    "Restored",
]

# Where `restore_latest_good` moves a damaged step (beside `checkpoints/`, never deleted).
DAMAGED_DIR = "checkpoints_damaged"


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model / optimizer it is restored into."""


class CheckpointWriteError(OSError):
    """A save could not be written (disk full, directory not writable): the earlier steps are intact."""


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


class DamagedCheckpointError(RuntimeError):
    """No committed checkpoint of a workdir can be read (each step's damage is in the message)."""


class Restored(NamedTuple):
    """What `Checkpointer.restore` returns (unpacks as `state, extra, reference`)."""

    state: TrainState
    extra: dict[str, Any]
    reference: nnx.State | None  # the frozen reference policy; None unless asked for


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When and how checkpoints are written.

    Attributes:
      keep: most recent checkpoints kept on disk (older ones are deleted after a newer
        one commits); None keeps all.
      every_steps: `save` writes at steps that are multiples of this (Orbax's
        `FixedIntervalPolicy`), and when forced;
        the default 1 writes whenever asked, for trainers that decide the cadence themselves.
      async_save: write files in a background thread (`wait()` blocks until done).
    """

    keep: int | None = 3
    every_steps: int = 1
    async_save: bool = True

    def __post_init__(self):
        if self.keep is not None and (not isinstance(self.keep, int) or self.keep < 1):
            raise ValueError(f"CheckpointConfig.keep must be a positive int or None, got {self.keep!r}")
        if not isinstance(self.every_steps, int) or self.every_steps < 1:
            raise ValueError(f"CheckpointConfig.every_steps must be a positive int, got {self.every_steps!r}")
        if not isinstance(self.async_save, bool):
            raise ValueError(f"CheckpointConfig.async_save must be a bool, got {self.async_save!r}")


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _flat(tree, is_leaf=None) -> dict[str, Any]:
    """{"opt_state/1/mu/wq": leaf}: one naming for live pytrees and Orbax metadata trees alike."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {"/".join(_key_name(k) for k in path): leaf for path, leaf in leaves}


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _plain(tree):
    """`tree` with every nnx Variable replaced by its array.

    The files then hold plain nested containers (`params/wq`, not `params/wq/value`): they do
    not depend on how a Flax version flattens its Variables, and parameters restore into an
    `nnx.State` or into its pure-dict form (`nnx.to_pure_dict`) alike.
    """
    return jax.tree.map(lambda v: v.get_value() if _is_variable(v) else v, tree, is_leaf=_is_variable)


def _abstract(tree, item: str):
    """ShapeDtypeStructs carrying the shardings to restore into (arrays or abstract leaves)."""

    def one(path, x):
        out = ocp.utils.to_shape_dtype_struct(x)
        if getattr(out, "sharding", None) is None:
            name = "/".join(_key_name(k) for k in path)
            raise ValueError(
                f"abstract_state {item}/{name} has no sharding: pass the state built by "
                "create_train_state (or ShapeDtypeStructs with shardings)"
            )
        return out

    return jax.tree_util.tree_map_with_path(one, tree)


def _check_fits(item: str, metadata, abstract, path: pathlib.Path) -> None:
    """Raises a one-line CheckpointMismatchError naming the first leaf that does not fit."""
    where = f"checkpoint {path}"
    stored = _flat(metadata, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    wanted = _flat(abstract)
    for name, want in wanted.items():
        got = stored.get(name)
        if got is None:
            raise CheckpointMismatchError(f"{where}: {item}/{name} is missing (model or optimizer changed?)")
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointMismatchError(
                f"{where}: {item}/{name} has shape {tuple(got.shape)} but the model expects "
                f"{tuple(want.shape)} (model config changed?)"
            )
        if got.dtype != want.dtype:
            raise CheckpointMismatchError(
                f"{where}: {item}/{name} has dtype {got.dtype} but the model expects {want.dtype}"
            )
    unexpected = sorted(set(stored) - set(wanted))
    if unexpected:
        raise CheckpointMismatchError(
            f"{where}: {item}/{unexpected[0]} is not in the model or optimizer "
            f"({len(unexpected)} unexpected entries; model or optimizer changed?)"
        )


def _json_copy(extra: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy through JSON: validates now, and later edits by the caller cannot leak in."""
    try:
        return json.loads(json.dumps(dict(extra), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"checkpoint extra must be JSON-serialisable (ints, floats, strings, lists, dicts; "
            f"convert arrays with .tolist()): {e}"
        ) from None


def _is_closed_loop_noise(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def _quiet_closed_loop_noise() -> None:
    """After a failed read, tensorstore's callbacks still post to the event loop Orbax has closed;
    Python prints each `RuntimeError: Event loop is closed` as a traceback (dozens per damaged
    step), through `sys.unraisablehook` or, from a native thread, `sys.excepthook`. Those, and only
    those, are dropped from then on. Installed *before* the first read: the callbacks can fire
    before the failed read's exception reaches our handler (seen in CI, not on every run)."""
    previous_unraisable, previous_except = sys.unraisablehook, sys.excepthook
    if getattr(previous_unraisable, "_treegrpo_quiet", False):
        return

    def unraisable_hook(unraisable):
        if not _is_closed_loop_noise(unraisable.exc_value):
            previous_unraisable(unraisable)

    def except_hook(kind, value, traceback):
        if not _is_closed_loop_noise(value):
            previous_except(kind, value, traceback)

    unraisable_hook._treegrpo_quiet = True
    sys.unraisablehook, sys.excepthook = unraisable_hook, except_hook


class Checkpointer:
    """Saves and restores `TrainState` + JSON host state under `WORKDIR/checkpoints`.

    Args:
      workdir: the run's directory (created if needed).
      cfg: cadence, retention and async behaviour (default: `CheckpointConfig()`).
    """

    def __init__(self, workdir: str | pathlib.Path, cfg: CheckpointConfig | None = None):
        self.cfg = cfg = cfg or CheckpointConfig()
        workdir = pathlib.Path(workdir).absolute()
        self.directory = workdir / "checkpoints"
        self.reference_directory = workdir / "reference"
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=cfg.keep,
                # Removes what a killed save left behind (`<step>.orbax-checkpoint-tmp*`).
                cleanup_tmp_directories=True,
                enable_async_checkpointing=cfg.async_save,
                # The cadence is Orbax's, this policy alone (not its default set, which also
                # saves the first step asked and follows JAX's preemption notice: the trainer
                # forces those saves itself).
                save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(cfg.every_steps),
            ),
            item_handlers={
                "params": ocp.StandardCheckpointHandler(),
                "opt": ocp.StandardCheckpointHandler(),
                "extra": ocp.JsonCheckpointHandler(),
            },
        )
        self._reference_manager: ocp.CheckpointManager | None = None  # opened on first use
        self._closed = False

    # ------------------------------------------------------------------ queries
    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every committed step on disk, ascending."""
        return sorted(self._manager.all_steps())

    # --------------------------------------------------------------------- save
    def save(
        self,
        step: int,
        state: TrainState,
        extra: Mapping[str, Any] | None = None,
        *,
        reference: nnx.State | None = None,
        force: bool = False,
    ) -> bool:
        """Starts writing `state` and `extra` as checkpoint `step` (see the module docstring).

        Args:
          step: the checkpoint's step (the trainer's RL step count).
          state: the train state; its arrays are copied off the device before returning,
            so the caller may donate them right after.
          extra: JSON-serialisable host state (loader position, RNG key data, ...).
          reference: the frozen reference policy's params; written once, synchronously,
            replacing any earlier reference (pass it with the first checkpoint only).
          force: write even off the `every_steps` cadence (final step, SIGTERM).

        Returns:
          True if a save was started; False when skipped (off cadence, or `step` is not
          newer than the latest saved step — e.g. the final step was also a periodic one).
        """
        extra = _json_copy(extra or {})
        if reference is not None:
            self._save_reference(step, reference)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            return False  # also when forced (Orbax would raise): the final step was a periodic one
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(_plain(state.params)),
            opt=ocp.args.StandardSave(
                _plain({"opt_state": state.opt_state, "step": state.step, "skipped": state.skipped})
            ),
            extra=ocp.args.JsonSave(extra),
        )
        try:
            saved = self._manager.save(step, args=args, force=force)  # off cadence: False, unless forced
        except Exception as e:  # also an earlier async save's failure, raised here by Orbax
            raise self._write_error(e, f"saving step {step}") from e
        if saved:
            logging.info("checkpoint: started saving step %d to %s", step, self.directory)
        return saved

    @property
    def _reference(self) -> ocp.CheckpointManager:
        # Lazily: a run without a reference policy (or a read-only export) leaves no directory.
        if self._reference_manager is None:
            self._reference_manager = ocp.CheckpointManager(
                self.reference_directory,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=1, cleanup_tmp_directories=True, enable_async_checkpointing=False
                ),
                item_handlers={"params": ocp.StandardCheckpointHandler()},
            )
        return self._reference_manager

    def _save_reference(self, step: int, reference: nnx.State) -> None:
        if step in self._reference.all_steps():  # a restarted run re-creating its reference
            self._reference.delete(step)
        args = ocp.args.Composite(params=ocp.args.StandardSave(_plain(reference)))
        self._reference.save(step, args=args, force=True)
        self._reference.wait_until_finished()  # committed before any step that relies on it

    def wait(self) -> None:
        """Blocks until every started save has committed.

        Raises:
          CheckpointWriteError: a background save failed (the steps committed before it are intact).
        """
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._write_error(e, "a background save") from e

    def _write_error(self, e: Exception, what: str) -> CheckpointWriteError:
        try:
            self._manager.reload()
            latest = self._manager.latest_step()
        except Exception:  # a closed manager: the message still says what failed
            latest = None
        kept = "no step committed yet"
        if latest is not None:
            kept = f"step {latest} is the newest intact checkpoint"
        return CheckpointWriteError(
            f"{what} to {self.directory} failed ({_first_line(e)}); {kept} "
            "(is the disk full or the directory read-only?)"
        )

    # ------------------------------------------------------------------ restore
    def _step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; steps: {steps}")
        return step

    def _restore_item(self, manager, step: int, item: str, abstract):
        target = _plain(abstract)
        metadata = manager.item_metadata(step)[item]
        _check_fits(item, metadata, target, pathlib.Path(manager.directory) / str(step))
        args = ocp.args.Composite(**{item: ocp.args.StandardRestore(target)})
        restored = manager.restore(step, args=args)[item]
        # Back into the caller's containers (Variables and their metadata): same leaf order.
        return jax.tree.unflatten(jax.tree.structure(abstract), jax.tree.leaves(restored))

    def _restore_json(self, step: int) -> dict:
        args = ocp.args.Composite(extra=ocp.args.JsonRestore())
        return dict(self._manager.restore(step, args=args)["extra"] or {})

    def restore(
        self, step: int | None = None, *, abstract_state: TrainState, with_reference: bool = False
    ) -> Restored:
        """Reads checkpoint `step` (default: the latest) into `abstract_state`'s shardings.

        Args:
          step: which step; None for the latest.
          abstract_state: a TrainState whose leaves are arrays (e.g. the fresh state from
            `create_train_state`) or ShapeDtypeStructs with shardings; its `graphdef` is
            kept, its values are not read.
          with_reference: also read the reference policy (into the params' shardings).

        Returns:
          `Restored(state, extra, reference)`; `reference` is None unless `with_reference`.

        Raises:
          FileNotFoundError: no such checkpoint (or no reference policy when asked for).
          CheckpointMismatchError: a saved array's path, shape or dtype does not match the
            model / optimizer (one line naming the first mismatched entry).
        """
        self.wait()  # a save still in flight must not be read half-written
        step = self._step(step)
        s = abstract_state
        params_abstract = _abstract(s.params, "params")
        params = self._restore_item(self._manager, step, "params", params_abstract)
        opt_abstract = _abstract({"opt_state": s.opt_state, "step": s.step, "skipped": s.skipped}, "opt")
        opt = self._restore_item(self._manager, step, "opt", opt_abstract)
        state = s.replace(params=params, opt_state=opt["opt_state"], step=opt["step"], skipped=opt["skipped"])
        reference = self.restore_reference(abstract_params=params_abstract) if with_reference else None
        return Restored(state, self._restore_json(step), reference)

    def restore_latest_good(
        self, *, abstract_state: TrainState, with_reference: bool = False
    ) -> tuple[int, Restored]:
        """Restores the newest step that reads back whole, moving damaged newer steps aside.

        A committed step can still be damaged after the fact (a file truncated by a full disk or
        a bad copy, a file deleted by hand): Orbax then fails deep in tensorstore or JSON. Each
        step that fails to restore is logged with what was wrong and, once an older step restores,
        moved to `WORKDIR/checkpoints_damaged/<step>` (kept for inspection, and out of the way of
        the re-run that saves that step again). A `CheckpointMismatchError` is not damage (the
        model or optimizer changed) and is raised at once.

        Returns:
          (step, Restored) of the newest readable step.

        Raises:
          FileNotFoundError: no committed step at all.
          DamagedCheckpointError: every step is damaged (nothing is moved: the run must not
            quietly cold-start over them).
        """
        self.wait()
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        damaged: list[tuple[int, str]] = []
        _quiet_closed_loop_noise()
        for step in reversed(steps):
            try:
                restored = self.restore(step, abstract_state=abstract_state, with_reference=with_reference)
            except CheckpointMismatchError:
                raise
            except Exception as e:  # tensorstore, JSON and Orbax each raise their own types
                reason = _first_line(e)
                logging.warning("checkpoint step %d in %s cannot be read (%s)", step, self.directory, reason)
                damaged.append((step, reason))
                continue
            for bad, reason in damaged:
                self._move_aside(bad, reason)
            if damaged:
                if jax.process_count() > 1:  # every process lists the steps only after the move
                    multihost_utils.sync_global_devices("checkpoint_damaged_moved")
                self._manager.reload()
                logging.warning(
                    "resuming from step %d, the newest readable checkpoint; damaged steps %s moved to %s",
                    step,
                    [bad for bad, _ in damaged],
                    self.directory.parent / DAMAGED_DIR,
                )
            return step, restored
        raise DamagedCheckpointError(
            f"no checkpoint in {self.directory} can be read: "
            + "; ".join(f"step {bad}: {reason}" for bad, reason in damaged)
            + " (move the directory away to start the run afresh)"
        )

    def _move_aside(self, step: int, reason: str) -> None:
        if jax.process_index() != 0:  # one process moves the shared directory
            return
        target_root = self.directory.parent / DAMAGED_DIR
        target_root.mkdir(exist_ok=True)
        target = target_root / str(step)
        n = 1
        while target.exists():  # the same step damaged twice: keep both
            target, n = target_root / f"{step}.{n}", n + 1
        (self.directory / str(step)).rename(target)
        (target / "DAMAGE.txt").write_text(reason + "\n")

    def restore_params(self, step: int | None = None, *, abstract_params: nnx.State) -> nnx.State:
        """Reads only the policy parameters of checkpoint `step` (default: the latest).

        Args:
          step: which step; None for the latest.
          abstract_params: parameters (arrays or ShapeDtypeStructs with shardings), as an
            `nnx.State` (e.g. `abstract_model(cfg)[1]` with shardings on its leaves) or in
            pure-dict form (`nnx.to_pure_dict`).

        Returns:
          The parameters in `abstract_params`' containers and shardings.
        """
        self.wait()
        step = self._step(step)
        return self._restore_item(self._manager, step, "params", _abstract(abstract_params, "params"))

    def restore_reference(self, *, abstract_params: nnx.State) -> nnx.State:
        """Reads the reference policy saved with `save(..., reference=...)`.

        Raises:
          FileNotFoundError: no reference policy was saved in this workdir.
        """
        step = self._reference.latest_step() if self.reference_directory.is_dir() else None
        if step is None:
            raise FileNotFoundError(
                f"no reference policy in {self.reference_directory}: the run's first checkpoint "
                "was saved without `reference=`"
            )
        return self._restore_item(self._reference, step, "params", _abstract(abstract_params, "params"))

    def restore_extra(self, step: int | None = None) -> dict:
        """Reads only the JSON host state of checkpoint `step` (default: the latest)."""
        self.wait()
        return self._restore_json(self._step(step))

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Waits for pending saves and releases Orbax's threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        error: CheckpointWriteError | None = None
        try:
            self.wait()
        except CheckpointWriteError as e:
            error = e
        # Orbax's threads go even when the last save failed (its close re-raises that failure).
        for manager in (self._manager, self._reference_manager):
            try:
                if manager is not None:
                    manager.close()
            except Exception as e:
                error = error or self._write_error(e, "closing")
        if error is not None:
            raise error

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
