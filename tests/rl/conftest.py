"""Shared fixtures of the RL tests."""

import pytest

from tests.rl.tiny import TINY
from treegrpo_jax.model.build import init_model


@pytest.fixture(scope="session")
def tiny_model():
    return init_model(TINY, seed=0)
