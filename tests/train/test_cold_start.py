"""Cold-start batching: length-grouped batches cover the demonstrations once per epoch."""

import numpy as np

from treegrpo_jax.train.cold_start import _length_grouped_batches


def test_length_grouped_batches_are_an_epoch_with_less_padding():
    rng = np.random.default_rng(0)
    lengths = rng.integers(60, 400, size=1000)
    batches = _length_grouped_batches(lengths, 8, np.random.default_rng(1))
    flat = np.concatenate(batches)
    assert all(len(b) == 8 for b in batches)
    assert len(np.unique(flat)) == len(flat) == 1000  # 1000 = whole pools of 128 + a 104-row pool
    grouped_pad = np.mean([lengths[b].max() for b in batches])
    random_pad = np.mean([lengths[b].max() for b in np.split(rng.permutation(1000), 125)])
    assert grouped_pad < 0.8 * random_pad
    again = _length_grouped_batches(lengths, 8, np.random.default_rng(1))
    assert all((a == b).all() for a, b in zip(batches, again, strict=True))  # seeded
