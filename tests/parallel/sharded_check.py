"""Run in its own process with 8 fake CPU devices (see test_sharding.py).

Prints one JSON line: per mesh shape, the max |Δ| between sharded and single-device
logits for the full forward and the cached append, and whether params were sharded.
"""

import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from treegrpo_jax.model.build import init_model  # noqa: E402
from treegrpo_jax.model.cache import init_cache  # noqa: E402
from treegrpo_jax.model.config import ModelConfig  # noqa: E402
from treegrpo_jax.model.decoder import causal_mask  # noqa: E402
from treegrpo_jax.parallel import MeshConfig, make_mesh, named_sharding  # noqa: E402

CFG = ModelConfig(
    vocab_size=128,
    embed_dim=64,
    mlp_dim=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    qkv_bias=True,
)


def forward(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    logits = model(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), causal_mask(jnp.ones((b, t), bool)))
    cache = init_cache(CFG, b, 32)
    cached, _ = model.append(tokens, jnp.full((b,), t, jnp.int32), cache, all_logits=True)
    return logits, cached


def main():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (8, 16)))
    graphdef, state = nnx.split(init_model(CFG, seed=0))
    ref_full, ref_cached = jax.jit(forward, static_argnums=0)(graphdef, state, tokens)
    results = {"num_devices": jax.device_count()}
    for shape in [(8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8), (2, 4, 1)]:
        mesh = make_mesh(MeshConfig(shape=shape))
        model = init_model(CFG, seed=0, mesh=mesh)
        g, s = nnx.split(model)
        wq = model.wq[...]
        batch = named_sharding(("batch", "length"), tokens.shape, mesh)
        full, cached = jax.jit(forward, static_argnums=0)(g, s, jax.device_put(tokens, batch))
        results[str(shape)] = {
            "full": float(np.abs(np.asarray(full) - np.asarray(ref_full)).max()),
            "cached": float(np.abs(np.asarray(cached) - np.asarray(ref_cached)).max()),
            "wq_shard_shape": list(wq.sharding.shard_shape(wq.shape)),
            "wq_devices": len(wq.sharding.device_set),
        }
    try:
        make_mesh(MeshConfig(shape=(3, 1, 1)))
        results["bad_mesh_error"] = None
    except ValueError as e:
        results["bad_mesh_error"] = str(e)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
