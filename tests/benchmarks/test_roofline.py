"""The roofline benchmark's arithmetic and its timed case, on a tiny model (a smoke test: no timing
is asserted, only that the bytes and fractions are what the docstring says they are)."""

import pathlib
import sys

import pytest

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import _roofline  # noqa: E402

CFG = ModelConfig(
    vocab_size=97, embed_dim=32, mlp_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)


def test_step_bytes_count_weights_once_and_live_kv_per_row():
    b = _roofline.step_bytes(CFG, batch=3, live=10, kv_itemsize=2)
    assert b["weight_bytes"] == CFG.num_params * 4
    assert (
        b["live_kv_bytes"] == 2 * 2 * 3 * 2 * 8 * 2 * 10
    )  # layers x (K, V) x rows x heads x dim x bytes x keys


@pytest.mark.parametrize("impl", ["xla", "native"])
def test_a_case_decodes_every_step_and_its_row_is_consistent(impl):
    from treegrpo_jax.native import build

    if impl == "native" and not build.available():
        pytest.skip("CPU kernels not built")
    model = init_model(CFG, seed=0)
    case = _roofline.Case(batch=4, live=20, sampled=True, impl=impl, kv="float32")
    timed = _roofline._time_cases(model, [case], steps=4, pool_len=64, repeats=1)
    ceilings = {"best_gbps": 10.0, "matmul_gflops": 100.0}
    row = _roofline._row(CFG, case, timed[case], ceilings, steps=4)
    bytes_ = row["weight_bytes"] + row["live_kv_bytes"]
    assert row["roofline_ms"] == pytest.approx(1e3 * bytes_ / 10e9)
    assert row["fraction_of_roofline"] == pytest.approx(row["roofline_ms"] / row["ms_per_step"])
    assert row["flop_ms"] == pytest.approx(1e3 * 2 * CFG.num_params * 4 / 100e9)
    assert row["tokens_per_s"] == pytest.approx(4 / (row["ms_per_step"] / 1e3))


def test_step_matmuls_are_the_models_weight_matmuls():
    tied = CFG.replace(tie_embeddings=True)
    ms, flops = _roofline.step_matmul_ms(tied, batch=3, steps=2, repeats=1)
    norms = tied.num_layers * 2 * tied.embed_dim + tied.embed_dim  # RMSNorm scales: no matmul
    assert flops == 2 * 3 * (tied.num_params - norms)  # every weight once per row (head = embedding)
    assert ms > 0
