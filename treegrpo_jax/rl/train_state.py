"""The train state: policy params, optimizer state, RL step, skipped-update count.

A registered pytree (donated to the jitted step). The model's `GraphDef` rides along as
static metadata so a step needs nothing but the state, the batch and the reference params.
`create_train_state` initialises the optimizer state straight into the parameters'
shardings (Adam moments shard like their parameter; scalars are replicated) and returns
those shardings for the step's explicit in/out shardings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from treegrpo_jax._pytree import pytree_dataclass
from treegrpo_jax.model.build import param_shardings
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.parallel.rules import DEFAULT_RULES, Rules
from treegrpo_jax.rl.optim import OptimConfig, make_optimizer


@pytree_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainState:
    """Everything a train step updates.

    Attributes:
      graphdef: the decoder's structure (static pytree metadata).
      params: the policy's parameters.
      opt_state: optax state of `make_optimizer`.
      step: RL steps done (int32 scalar; drives the learning-rate schedule).
      skipped: optimizer updates skipped because the loss or a gradient was not finite.
    """

    graphdef: nnx.GraphDef = dataclasses.field(metadata=dict(static=True))
    params: nnx.State
    opt_state: Any
    # The shardings tree of `create_train_state` is a TrainState too, with a sharding per leaf.
    step: jax.Array | jax.sharding.Sharding
    skipped: jax.Array | jax.sharding.Sharding

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)

    @property
    def model(self) -> Decoder:
        """The policy as a Decoder (for sampling / evaluation)."""
        return nnx.merge(self.graphdef, self.params)


def create_train_state(
    model: Decoder, cfg: OptimConfig, *, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES
) -> tuple[TrainState, TrainState]:
    """A fresh train state around `model`'s parameters, and its shardings.

    The state holds `model`'s own arrays (no copy), and the jitted step donates them: after
    the first step use `state.model` (or `state.params`), not `model`. Copy the params first
    (`jax.tree.map(jnp.copy, ...)`) for a frozen reference policy.

    Args:
      model: the policy (already in its shardings: see `model.build.init_model`).
      cfg: optimizer configuration.
      mesh: the device mesh (None: one device).
      rules: logical-axis rules of the parameters.

    Returns:
      (state, shardings): `shardings` is a TrainState-shaped tree of shardings to pass as the
      step's in/out shardings.
    """
    graphdef, params = nnx.split(model)
    shardings = train_state_shardings(graphdef, params, cfg, mesh=mesh, rules=rules)
    params = jax.device_put(params, shardings.params)  # a no-op when the model was built in its shardings
    tx = make_optimizer(cfg, params)
    o_shard, scalar = shardings.opt_state, shardings.step
    opt_state = jax.jit(tx.init, out_shardings=o_shard)(params)
    # Two buffers (step and skipped are donated separately), made in place by jit: a
    # device_put of a local array onto a mesh spanning several processes is not allowed.
    zeros = jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=scalar)
    step, skipped = zeros(), zeros()
    state = TrainState(graphdef=graphdef, params=params, opt_state=opt_state, step=step, skipped=skipped)
    return state, shardings


def train_state_shardings(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cfg: OptimConfig,
    *,
    mesh: Mesh | None,
    rules: Rules = DEFAULT_RULES,
) -> TrainState:
    """The shardings of a train state around `params` (real or abstract): parameters by their
    logical axes, Adam moments like their parameter, counts and scalars replicated."""
    p_shard = param_shardings(params, mesh, rules)
    if mesh is None:
        scalar = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
        scalar = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(make_optimizer(cfg, params).init, params)
    # Adam moments have the params' structure and shard like them; counts are replicated.
    params_def = jax.tree.structure(params)

    def opt_shardings(node):
        if jax.tree.structure(node) == params_def:
            return p_shard
        return jax.tree.map(lambda _: scalar, node)

    o_shard = jax.tree.map(opt_shardings, abstract_opt, is_leaf=lambda n: jax.tree.structure(n) == params_def)
    return TrainState(graphdef=graphdef, params=p_shard, opt_state=o_shard, step=scalar, skipped=scalar)


def abstract_train_state(
    graphdef: nnx.GraphDef, params: nnx.State, cfg: OptimConfig, *, mesh: Mesh, rules: Rules = DEFAULT_RULES
) -> tuple[TrainState, TrainState]:
    """(state, shardings) with every leaf a `jax.ShapeDtypeStruct` carrying its sharding: what a
    compile for a target needs, with nothing allocated (`params` from `model.build.abstract_model`)."""
    shardings = train_state_shardings(graphdef, params, cfg, mesh=mesh, rules=rules)
    opt = jax.eval_shape(make_optimizer(cfg, params).init, params)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.step)
    state = TrainState(
        graphdef=graphdef,
        params=with_shardings(params, shardings.params),
        opt_state=with_shardings(opt, shardings.opt_state),
        step=scalar,
        skipped=scalar,
    )
    return state, shardings


def with_shardings(tree, shardings):
    """`tree` (an nnx.State or any pytree) with each array leaf a `ShapeDtypeStruct` carrying the
    matching sharding of `shardings` (one per leaf, in order; Variables stay Variables)."""
    leaves, treedef = jax.tree.flatten(tree)
    shards = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(leaves) != len(shards):
        raise ValueError(f"with_shardings: {len(leaves)} arrays but {len(shards)} shardings")
    return treedef.unflatten(
        [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, shards, strict=True)]
    )
