"""Building a Decoder straight into its shardings.

`abstract_model` gives the graph and shapes without allocating (nnx.eval_shape);
`param_shardings` maps every parameter's logical `axes` through the rules to a
NamedSharding; `init_model` runs the initialiser under jit with those out-shardings,
so each device only ever materialises its own shard (no full copy per device).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.parallel.rules import DEFAULT_RULES, Rules, named_sharding


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) of a Decoder, without allocating parameters."""
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(abstract_state: nnx.State, mesh: Mesh | None, rules: Rules = DEFAULT_RULES):
    """A tree like `abstract_state` of shardings (leaves = array shardings, not Variables)."""
    if mesh is None:
        device = SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda v: device, abstract_state, is_leaf=_is_var)

    def one(var) -> NamedSharding:
        axes = var.get_metadata().get("axes")
        return named_sharding(axes, var.get_value().shape, mesh, rules)

    return jax.tree.map(one, abstract_state, is_leaf=_is_var)


def init_model(
    cfg: ModelConfig, *, seed: int = 0, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES
) -> Decoder:
    """A randomly initialised Decoder whose parameters live in their target shardings."""
    graphdef, abstract = abstract_model(cfg)
    shardings = param_shardings(abstract, mesh, rules)

    @jax.jit
    def make():
        return nnx.state(Decoder(cfg, rngs=nnx.Rngs(seed)))

    state = jax.jit(make, out_shardings=shardings)()
    return nnx.merge(graphdef, state)
