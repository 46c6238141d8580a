"""The `:tiny` pipeline at toy sizes (seconds per step), shared by the loop and multi-host tests."""

import importlib.util
import pathlib

from treegrpo_jax.train.config import from_config_dict

_SPEC = importlib.util.spec_from_file_location(
    "multihop", pathlib.Path(__file__).parents[2] / "configs/multihop.py"
)
multihop = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(multihop)


def toy_config_dict(steps=3):
    """configs/multihop.py:tiny shrunk: a 2-layer model, a 48-question world, 2 prompts per step."""
    c = multihop.get_config("tiny")
    c.model.dims = dict(embed_dim=32, mlp_dim=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
    c.model.tokenizer_vocab = 384
    c.data.world.update(
        seed=1,
        num_people=24,
        num_cities=8,
        num_countries=3,
        num_organisations=6,
        num_works=10,
        questions_per_hop=(6, 6, 6, 6),
        test_fraction=0.25,
    )
    c.data.eval_prompts = 4
    c.sft.update(steps=2, batch_rows=8, demonstrations=16)
    c.agent.update(max_step_tokens=16)
    c.rl.update(length_buckets=(512, 1024), num_minibatches=1, kl_coef=0.001)  # exercises the saved reference
    c.run.update(steps=steps, prompts_per_step=2, eval_every=3, checkpoint_every=1, render_trees=1)
    return c


def toy_config(steps=3):
    return from_config_dict(toy_config_dict(steps))
