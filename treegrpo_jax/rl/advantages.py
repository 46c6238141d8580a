"""Tree-relative advantages (docs/DESIGN.md §1), vectorised with segment reductions.

Legend: B rows (one per root-to-leaf path = one per leaf), P prompts, M trees per prompt,
G leaves per prompt.

Per group g the z-score is `A = (r − mean_g) / (std_g + 1e-6)` with the unbiased std.
Edge cases follow the reference implementation (verl's GRPO outcome advantage, used by
AMAP-ML/Tree-GRPO): a group of one uses mean 0 and std 1 (A = r / (1 + 1e-6)); a group
whose rewards are all equal gives exactly 0; padding rows (mask False) give 0 and do not
enter any group statistic.

Estimators (a registry of group kinds summed, not string switches):
  * tree  = intra + inter (plain sum, no renormalisation; the paper's Tree-GRPO);
  * intra = group: rows with the same (prompt_id, tree_id) — tree ids may restart per prompt;
  * inter = group: rows with the same prompt_id;
  * grpo  = chain GRPO: the same formula as inter (group = prompt), named for ablations.

Groups get dense ids in [0, B) from one lexicographic sort by (prompt, tree) (no bound on
the id values, no Python loop over leaves), then sorted `jax.ops.segment_sum` /
`segment_max` with B segments.
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from treegrpo_jax.rl.batch import PathBatch
from treegrpo_jax.validation import as_enum

EPS = 1e-6  # added to the std, as in the reference implementation


class Estimator(enum.StrEnum):
    TREE = "tree"
    INTRA = "intra"
    INTER = "inter"
    GRPO = "grpo"


class _Group(enum.Enum):
    TREE = "tree"  # key (prompt_id, tree_id)
    PROMPT = "prompt"  # key prompt_id


# Each estimator is the plain sum of the z-scores over these groupings.
_ESTIMATOR_GROUPS: dict[Estimator, tuple[_Group, ...]] = {
    Estimator.TREE: (_Group.TREE, _Group.PROMPT),
    Estimator.INTRA: (_Group.TREE,),
    Estimator.INTER: (_Group.PROMPT,),
    Estimator.GRPO: (_Group.PROMPT,),
}


def parse_estimator(value: str | Estimator) -> Estimator:
    """`Estimator(value)` with an error that lists the allowed names."""
    return as_enum(Estimator, value, "advantage estimator")


def _zscore(
    r: Float[ArrayLike, " B"], ids: Int[ArrayLike, " B"], mask: Bool[ArrayLike, " B"]
) -> Float[Array, " B"]:
    """Group z-score of every row (rows sorted by group id); padding rows 0; singletons r/(1+eps)."""
    b = r.shape[0]
    seg = functools.partial(jax.ops.segment_sum, segment_ids=ids, num_segments=b, indices_are_sorted=True)
    w = mask.astype(r.dtype)
    n = seg(w)[ids]
    # Centre on the group's max before summing: all-equal groups then give exactly 0 in f32
    # (a plain f32 mean of equal values can be off by one ulp, which /1e-6 would amplify).
    shift = jax.ops.segment_max(jnp.where(mask, r, -jnp.inf), ids, num_segments=b, indices_are_sorted=True)[
        ids
    ]
    d = jnp.where(mask, r - jnp.where(n > 0, shift, 0.0), 0.0)
    mean = seg(d)[ids] / jnp.maximum(n, 1.0)
    dev = jnp.where(mask, d - mean, 0.0)
    std = jnp.sqrt(seg(dev * dev)[ids] / jnp.maximum(n - 1.0, 1.0))  # unbiased (n − 1)
    z = jnp.where(n > 1, dev / (std + EPS), r / (1.0 + EPS))  # group of one: mean 0, std 1
    return jnp.where(mask, z, 0.0)


@functools.partial(jax.jit, static_argnames="estimator")
def _compute(rewards, tree_ids, prompt_ids, mask, estimator: Estimator):
    mask = mask.astype(bool)
    r = jnp.where(mask, rewards.astype(jnp.float32), 0.0)  # NaN/garbage on padding rows never leaks
    # One lexicographic sort by (prompt, tree) serves both groupings: a prompt's rows are one
    # contiguous run and its trees are runs inside it. Dense ids = running count of key changes.
    order = jnp.lexsort((tree_ids, prompt_ids))  # lexsort's primary key is the last one
    p, t = prompt_ids[order], tree_ids[order]
    first = jnp.ones((1,), bool)
    new_prompt = jnp.concatenate([first, p[1:] != p[:-1]])
    new_tree = new_prompt | jnp.concatenate([first, t[1:] != t[:-1]])
    ids = {
        _Group.PROMPT: jnp.cumsum(new_prompt, dtype=jnp.int32) - 1,
        _Group.TREE: jnp.cumsum(new_tree, dtype=jnp.int32) - 1,
    }
    r_sorted, mask_sorted = r[order], mask[order]
    total = jnp.zeros_like(r)
    for group in _ESTIMATOR_GROUPS[estimator]:
        total = total + _zscore(r_sorted, ids[group], mask_sorted)
    return jnp.zeros_like(r).at[order].set(total)  # back to the caller's row order


def compute(
    rewards: Float[ArrayLike, " B"],
    tree_ids: Int[ArrayLike, " B"],
    prompt_ids: Int[ArrayLike, " B"],
    mask: Bool[ArrayLike, " B"],
    estimator: str | Estimator = Estimator.TREE,
) -> Float[ArrayLike, " B"]:
    """One advantage per row (= per leaf), computed over all the rows given.

    Jit-compiled (once per B and estimator); callable inside jit. Given NumPy arrays it
    returns a NumPy array (for analysis), otherwise a jax Array. Values are float32.

    Args:
      rewards: leaf rewards.
      tree_ids: tree of each row, unique within its prompt (may restart at 0 per prompt).
      prompt_ids: prompt of each row (any ints).
      mask: False on padding rows.
      estimator: "tree" | "intra" | "inter" | "grpo".

    Returns:
      Advantages, 0 on padding rows.
    """
    est = parse_estimator(estimator)
    args = (rewards, tree_ids, prompt_ids, mask)
    out = _compute(*(jnp.asarray(a) for a in args), estimator=est)
    if all(isinstance(a, np.ndarray) for a in args):
        return np.asarray(out)
    return out


def with_advantages(batch: PathBatch, estimator: str | Estimator) -> PathBatch:
    """The batch with `advantage` filled, computed over ALL its rows (whatever its row dims).

    Call this on the whole step's rows, before they are consumed mini-batch by mini-batch:
    groups span mini-batches only if `split_groups` put them there.
    """
    flat = batch.reshape_rows(-1)
    adv = compute(flat.reward, flat.tree_id, flat.prompt_id, flat.row_valid, estimator)
    return batch.replace(advantage=jnp.reshape(adv, batch.row_shape))
