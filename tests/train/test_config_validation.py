"""Every config field, one bad value each: a one-line error naming the key and what is allowed.

The table lives in `treegrpo_jax.testing.bad_inputs` (the resilience benchmark counts it too).
"""

import pytest

from treegrpo_jax.testing.bad_inputs import BAD_CONFIGS, config_error, is_clear


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=lambda c: c.name)
def test_bad_config_is_rejected_with_a_clear_message(case):
    message = config_error(case)
    assert message is not None, f"{case.name} was accepted"
    assert is_clear(case, message), message


def test_the_table_covers_every_block():
    blocks = {c.key.split(".")[0] for c in BAD_CONFIGS}
    assert blocks >= {"model", "data", "retriever", "agent", "observation", "tree", "rl", "optim", "sft"}
    assert blocks >= {"run", "mesh", "template", "rollout", "kv_cache"}
