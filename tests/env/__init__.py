"""Tests for treegrpo_jax.env."""
