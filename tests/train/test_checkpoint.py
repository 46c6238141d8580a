"""Checkpoints: exact round trips, keep-N, a save killed mid-write, mismatch errors, HF export."""

import functools
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import causal_mask
from treegrpo_jax.model.weights_hf import DictSource, assemble_decoder, expected_tensors, hf_shape
from treegrpo_jax.rl import OptimConfig, TrainState, create_train_state
from treegrpo_jax.train.checkpoint import CheckpointConfig, Checkpointer, CheckpointMismatchError
from treegrpo_jax.train.export import (
    export_hf,
    load_model_config,
    load_tokenizer,
    save_model_config,
)

TINY = ModelConfig(
    vocab_size=64, embed_dim=32, mlp_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    eos_token_ids=(2,),
)  # fmt: skip


def random_model(cfg: ModelConfig, seed: int = 0):
    """Random weights from NumPy (JAX random ops would take seconds to compile per config)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for _, m, names in expected_tensors(cfg):
        for name in names:
            noise = rng.standard_normal(hf_shape(m, cfg)).astype(np.float32)
            tensors[name] = 1 + 0.1 * noise if "norm" in name else 0.1 * noise
    return assemble_decoder(DictSource(tensors), cfg)


def random_train_state(cfg: ModelConfig, seed: int = 0) -> TrainState:
    """A TrainState whose params, Adam moments and counters are all non-trivial."""
    state, _ = create_train_state(random_model(cfg, seed), OptimConfig(total_steps=10))
    rng = np.random.default_rng(seed + 1)

    def noisy(x):
        value = rng.standard_normal(x.shape).astype(x.dtype) if x.dtype.kind == "f" else np.asarray(x) + 3
        return jax.device_put(value, x.sharding)

    return state.replace(
        opt_state=jax.tree.map(noisy, state.opt_state),
        step=jax.device_put(np.int32(7), state.step.sharding),
        skipped=jax.device_put(np.int32(1), state.skipped.sharding),
    )


@pytest.fixture(scope="module")
def tiny_state():
    return random_train_state(TINY)


def _host(state: TrainState):
    return jax.tree.map(np.asarray, (state.params, state.opt_state, state.step, state.skipped))


def _assert_identical(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


EXTRA = {"loader": {"epoch": 1, "index": 96}, "rng": [0, 4294967295], "metrics_step": 5, "note": "é"}


# ----------------------------------------------------------------- round trip
def test_round_trip_is_bit_identical_and_survives_donation(tmp_path, tiny_state):
    expected = _host(tiny_state)
    state = jax.tree.map(jnp.copy, tiny_state)
    with Checkpointer(tmp_path) as ckpt:
        extra = dict(EXTRA)
        assert ckpt.save(5, state, extra)
        extra["metrics_step"] = 99  # edits after `save` returns must not reach the file
        # The next jitted step donates the state: the async save must already hold its own copy.
        for x in jax.tree.leaves(state):
            x.delete()
        ckpt.wait()
        assert ckpt.latest_step() == 5 and ckpt.all_steps() == [5]
        fresh = jax.tree.map(jnp.zeros_like, tiny_state)
        restored, got_extra, reference = ckpt.restore(abstract_state=fresh)
    assert reference is None
    _assert_identical(_host(restored), expected)
    assert got_extra == EXTRA
    assert restored.graphdef == tiny_state.graphdef
    for r, f in zip(jax.tree.leaves(restored), jax.tree.leaves(fresh), strict=True):
        assert r.sharding == f.sharding
    with Checkpointer(tmp_path) as again:  # a new process / restart sees the same
        assert again.restore_extra() == EXTRA
        params = again.restore_params(5, abstract_params=fresh.params)
        pure = again.restore_params(5, abstract_params=nnx.to_pure_dict(fresh.params))
    _assert_identical(jax.tree.map(np.asarray, params), expected[0])
    _assert_identical(pure, nnx.to_pure_dict(jax.tree.map(np.asarray, expected[0])))


def test_keep_n_and_cadence(tmp_path, tiny_state):
    with Checkpointer(tmp_path, CheckpointConfig(keep=2, every_steps=2, async_save=False)) as ckpt:
        assert not ckpt.save(1, tiny_state)  # off cadence
        for step in (2, 4, 6):
            assert not ckpt.save(step + 1, tiny_state)  # Orbax's FixedIntervalPolicy decides
            assert ckpt.all_steps()[-1:] == ([step - 2] if step > 2 else [])
            assert ckpt.save(step, tiny_state, {"at": step})
        assert not ckpt.save(6, tiny_state, force=True)  # already saved (final step == periodic step)
        assert not ckpt.save(4, tiny_state)  # older than the latest
        assert ckpt.all_steps() == [4, 6]
        assert ckpt.save(7, tiny_state, {"at": 7}, force=True)  # e.g. SIGTERM
        assert ckpt.all_steps() == [6, 7]
        assert ckpt.restore_extra(6) == {"at": 6}
        with pytest.raises(FileNotFoundError, match="no checkpoint for step 2"):
            ckpt.restore_extra(2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["6", "7"]


def test_reference_policy_outlives_the_rotation(tmp_path, tiny_state):
    reference = jax.tree.map(lambda x: -x, tiny_state.params)
    with Checkpointer(tmp_path, CheckpointConfig(keep=1, async_save=False)) as ckpt:
        ckpt.save(0, tiny_state, {"at": 0}, reference=reference)
        for step in (1, 2):
            ckpt.save(step, tiny_state, {"at": step})
        assert ckpt.all_steps() == [2]
    with Checkpointer(tmp_path) as ckpt:  # resumed
        state, extra, got = ckpt.restore(abstract_state=tiny_state, with_reference=True)
    assert extra == {"at": 2}
    _assert_identical(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, reference))
    with Checkpointer(tmp_path / "other", CheckpointConfig(async_save=False)) as ckpt:
        ckpt.save(0, tiny_state)
        with pytest.raises(FileNotFoundError, match="no reference policy"):
            ckpt.restore(abstract_state=tiny_state, with_reference=True)


def test_errors_are_clear(tmp_path, tiny_state):
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(FileNotFoundError, match="no checkpoint in"):
            ckpt.restore(abstract_state=tiny_state)
        with pytest.raises(TypeError, match="JSON-serialisable.*ndarray"):
            ckpt.save(0, tiny_state, {"rng": np.zeros(2, np.uint32)})
    for bad in (dict(keep=0), dict(every_steps=0), dict(async_save="yes")):
        with pytest.raises(ValueError, match=f"CheckpointConfig.{next(iter(bad))}"):
            CheckpointConfig(**bad)


def test_shape_mismatch_names_the_parameter(tmp_path, tiny_state):
    with Checkpointer(tmp_path, CheckpointConfig(async_save=False)) as ckpt:
        ckpt.save(3, tiny_state, force=True)
        other = random_train_state(TINY.replace(mlp_dim=48))
        with pytest.raises(CheckpointMismatchError) as info:
            ckpt.restore(abstract_state=other)
    message = str(info.value)
    assert "\n" not in message
    assert "params/w_down has shape (2, 64, 32) but the model expects (2, 48, 32)" in message


# -------------------------------------------------------- killed mid-write
_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    import numpy as np
    import orbax.checkpoint as ocp
    from treegrpo_jax.train.checkpoint import CheckpointConfig, Checkpointer
    from tests.train.test_checkpoint import toy_state

    ckpt = Checkpointer(sys.argv[1], CheckpointConfig(every_steps=1))
    ckpt.save(1, toy_state(1.0), {"step": 1})
    ckpt.wait()

    # Every file of step 2 is written; the commit (rename of the tmp dir) never comes.
    Rename = ocp.path.atomicity.AtomicRenameTemporaryPath
    commit = Rename.finalize
    async def finalize(self):
        if self.get().name.startswith("2."):
            print("WRITTEN-NOT-COMMITTED", flush=True)
            await asyncio.sleep(600)
        await commit(self)
    Rename.finalize = finalize
    ckpt.save(2, toy_state(2.0), {"step": 2})
    ckpt.wait()
    """
)


def toy_state(value: float) -> TrainState:
    """A TrainState-shaped pytree without a model (cheap to build in a child process)."""
    params = nnx.State({"w": jnp.full((4, 8), value), "b": jnp.full((8,), -value)})
    opt = (jnp.int32(3), {"mu": jax.tree.map(jnp.zeros_like, params)})
    step, skipped = jnp.int32(value), jnp.int32(0)
    return TrainState(graphdef=_TOY_GRAPHDEF, params=params, opt_state=opt, step=step, skipped=skipped)


# Static metadata only (checkpoints never merge it with the params): any module's structure.
_TOY_GRAPHDEF = nnx.graphdef(nnx.Linear(1, 1, rngs=nnx.Rngs(0)))


def test_save_killed_before_commit_keeps_the_last_good_step(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    log = tmp_path / "child.log"  # a file, not a pipe: a chatty child can never block on it
    with log.open("wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, stderr=stderr, env=env
        )
    try:
        deadline, line = time.monotonic() + 120, b""
        while b"WRITTEN-NOT-COMMITTED" not in line:
            ready, _, _ = select.select([child.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                pytest.fail(f"child never reached the commit: {log.read_text()[-2000:]}")
            line = child.stdout.readline()
            if not line:
                pytest.fail(f"child exited early: {log.read_text()[-2000:]}")
        os.kill(child.pid, signal.SIGKILL)  # mid-save: every file written, the commit not yet
    finally:
        child.kill()
        child.wait()
    directory = tmp_path / "checkpoints"
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith("2.")]
    assert leftovers and not (directory / "2").exists()  # the kill left an uncommitted step 2

    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1)) as ckpt:
        assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
        state, extra, _ = ckpt.restore(abstract_state=toy_state(0.0))
        assert extra == {"step": 1}
        _assert_identical(_host(state), _host(toy_state(1.0)))
        assert ckpt.save(2, toy_state(2.0), {"step": 2})  # the resumed run saves step 2 again
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
    assert sorted(p.name for p in directory.iterdir() if p.name[0].isdigit()) == ["1", "2"]


def test_leftover_tmp_dir_is_never_the_latest(tmp_path):
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1, async_save=False)) as ckpt:
        ckpt.save(4, toy_state(4.0), {"step": 4})
    junk = tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp-1234"
    (junk / "params").mkdir(parents=True)
    (junk / "params" / "half_written").write_bytes(b"\0" * 10)
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1)) as ckpt:
        assert ckpt.latest_step() == 4
        assert ckpt.restore(abstract_state=toy_state(0.0)).extra == {"step": 4}
        ckpt.save(5, toy_state(5.0))  # the background clean-up is done before the first save
    assert not junk.exists()


# ------------------------------------------------------------------ export
@functools.partial(jax.jit, static_argnames="graphdef")
def _forward(graphdef, params, tokens):
    b, t = tokens.shape
    model = nnx.merge(graphdef, params)
    return model(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), causal_mask(jnp.ones((b, t), bool)))


def test_model_config_round_trip(tmp_path):
    from treegrpo_jax.model.config import RopeScaling

    cfg = TINY.replace(
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0), dtype="bfloat16", eos_token_ids=(2, 5)
    )
    save_model_config(tmp_path, cfg)
    assert load_model_config(tmp_path) == cfg
    (tmp_path / "model_config.json").write_text(json.dumps({"vocab_size": 3, "bogus": 1}))
    with pytest.raises(ValueError, match="model_config.json: not a ModelConfig.*bogus"):
        load_model_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="model_config.json does not exist"):
        load_model_config(tmp_path / "nope")


def test_export_loads_in_transformers_with_identical_logits(tmp_path, tiny_state, torch):
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treegrpo_jax.model.bpe_train import train_bpe_tokenizer

    with Checkpointer(tmp_path, CheckpointConfig(async_save=False)) as ckpt:
        ckpt.save(3, tiny_state, force=True)
        ckpt.save(4, tiny_state.replace(params=jax.tree.map(lambda x: x * 2, tiny_state.params)), force=True)
    # The CLI (model config read from the workdir; the latest step) runs in a child process
    # while this one checks step 3's logits.
    save_model_config(tmp_path, TINY)
    cli = [sys.executable, "launch/export_hf.py", f"--workdir={tmp_path}", f"--out={tmp_path / 'hf_latest'}"]
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    child = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    texts = ["Who founded the city of Brura?", "<search> Brura founder </search>"] * 20
    train_bpe_tokenizer(texts, vocab_size=300, out_dir=tmp_path / "run" / "tokenizer")
    tokenizer = load_tokenizer(tmp_path / "run")
    assert load_tokenizer(tmp_path) is None
    assert export_hf(tmp_path, 3, tmp_path / "hf3", TINY, tokenizer) == 3
    torch_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf3", dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 12))
    with torch.no_grad():
        ref = torch_model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(_forward(tiny_state.graphdef, tiny_state.params, jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf3", local_files_only=True)
    assert exported.encode(texts[1], add_special_tokens=False) == tokenizer.encode(texts[1])

    out, err = child.communicate(timeout=300)
    assert child.returncode == 0 and "exported step 4" in out, err[-2000:]
    step3, step4 = (load_file(tmp_path / d / "model.safetensors") for d in ("hf3", "hf_latest"))
    assert step3.keys() == step4.keys()
    for name in step3:
        np.testing.assert_array_equal(step4[name], 2 * step3[name], err_msg=name)
