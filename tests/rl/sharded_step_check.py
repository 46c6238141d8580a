"""Run in its own process with 8 fake CPU devices (see test_sharded_step.py).

One RL step (2 mini-batches × 2 micro-batches, KL on) on one device, then on several
meshes with params, optimizer state and rows sharded; prints one JSON line with, per
mesh, the max |Δ| of params and of metrics against the single-device step, and the
shard shapes the step's outputs really have. The packed layout of the same trees runs
on one mesh too (key "packed (2, 2, 2)"), against the same single-device paths step.
"""

import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tests.rl.tiny import TINY, compile_fast  # noqa: E402
from treegrpo_jax.model.build import init_model, param_shardings  # noqa: E402
from treegrpo_jax.parallel import MeshConfig, make_mesh  # noqa: E402
from treegrpo_jax.rl import (  # noqa: E402
    BatchLayout,
    LossConfig,
    OptimConfig,
    build_batch,
    build_packed_batch,
    create_train_state,
    jit_train_step,
    rows_from_trees,
    shard_batch,
)
from treegrpo_jax.testing.forest import random_forest  # noqa: E402

MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2)]
# eps=1e-3: Adam's first update g/(|g|+eps) stays smooth in g (see test_train_step.py).
OPTIM = OptimConfig(learning_rate=1e-3, warmup_ratio=0.0, total_steps=10, eps=1e-3)
LOSS = LossConfig(kl_coef=0.05, entropy_coef=0.01)


def run(mesh, graphdef, host_params, batch_host, layout_kind="paths"):
    # Params placed straight into their shardings (sharded init itself is tested in tests/parallel).
    shardings = param_shardings(host_params, mesh)
    params = jax.device_put(jax.tree.map(np.copy, host_params), shardings)
    # The reference: the same weights scaled, placed like the policy.
    ref = jax.device_put(jax.tree.map(lambda x: x * 1.2, host_params), shardings)
    state, shardings = create_train_state(nnx.merge(graphdef, params), OPTIM, mesh=mesh)
    step = jit_train_step(
        shardings, loss_cfg=LOSS, optim_cfg=OPTIM, mesh=mesh, logprob_chunk=8, layout_kind=layout_kind
    )
    batch = shard_batch(batch_host, mesh)
    state, metrics = compile_fast(step, state, batch, ref)(state, batch, ref)
    return state, {k: float(v) for k, v in metrics.items()}


def main():
    trees = random_forest(np.random.default_rng(7), num_prompts=4, trees=2, branches=2, rounds=1)
    rows = rows_from_trees(trees)
    layout = BatchLayout(num_minibatches=2, num_microbatches=2, length_buckets=(32,), row_multiple=8)
    batch = build_batch(rows, layout)
    graphdef, params = nnx.split(init_model(TINY, seed=0))
    host_params = jax.tree.map(np.asarray, params)
    ref_state, ref_metrics = run(None, graphdef, host_params, batch)
    want = [np.asarray(x) for x in jax.tree.leaves(ref_state.params)]
    results = {"num_devices": jax.device_count(), "batch_shape": list(batch.tokens.shape)}
    for shape in MESHES:
        mesh = make_mesh(MeshConfig(shape=shape))
        state, metrics = run(mesh, graphdef, host_params, batch)
        params = jax.tree.leaves(state.params)
        wq = state.params["wq"].get_value()
        mu = state.opt_state[1].mu["wq"].get_value()  # (clip, adam, decay): Adam's first moment
        results[str(shape)] = {
            "params": max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(params, want, strict=True)),
            "metrics": max(abs(metrics[k] - ref_metrics[k]) for k in ref_metrics),
            "loss": metrics["loss"],
            "wq_shard_shape": list(wq.sharding.shard_shape(wq.shape)),
            "mu_shard_shape": list(mu.sharding.shard_shape(mu.shape)),
            "skipped": int(jnp.asarray(state.skipped)),
        }
    packed = build_packed_batch(trees, layout)
    state, metrics = run(make_mesh(MeshConfig(shape=(2, 2, 2))), graphdef, host_params, packed, "packed")
    params = jax.tree.leaves(state.params)
    results["packed (2, 2, 2)"] = {
        "params": max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(params, want, strict=True)),
        "metrics": max(abs(metrics[k] - ref_metrics[k]) for k in ref_metrics),
        "skipped": int(jnp.asarray(state.skipped)),
        "batch_shape": list(packed.tokens.shape),
    }
    results["single_loss"] = ref_metrics["loss"]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
