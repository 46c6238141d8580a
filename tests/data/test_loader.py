"""Tests for RowLoader: determinism, per-epoch reshuffle, resume, per-host sharding."""

import itertools
import json

import numpy as np
import pytest

from treegrpo_jax.data import LoaderConfig, RowLoader

ROWS = tuple(f"row{i}" for i in range(23))


def _take(loader, n):
    return list(itertools.islice(loader, n))


def test_same_seed_same_batches_other_seed_other_batches():
    cfg = LoaderConfig(batch_size=4, seed=3)
    a = _take(RowLoader(ROWS, cfg, process_index=0, process_count=1), 12)
    b = _take(RowLoader(ROWS, cfg, process_index=0, process_count=1), 12)
    c = _take(RowLoader(ROWS, LoaderConfig(batch_size=4, seed=4), process_index=0, process_count=1), 12)
    assert a == b
    assert a != c
    assert all(len(batch) == 4 for batch in a)


def test_each_epoch_is_a_fresh_shuffle_without_repeats():
    loader = RowLoader(ROWS, LoaderConfig(batch_size=5, seed=0), process_index=0, process_count=1)
    assert loader.steps_per_epoch == 4  # 23 rows, 20 used, 3 dropped
    epochs = [sum(_take(loader, 4), ()) for _ in range(3)]
    for epoch in epochs:
        assert len(epoch) == 20 and len(set(epoch)) == 20
    assert epochs[0] != epochs[1] != epochs[2]
    assert loader.get_state() == {"epoch": 3, "index": 0}
    # Dropped rows differ between epochs because the order changes.
    assert set(ROWS) - set(epochs[0]) != set(ROWS) - set(epochs[1])


def test_no_shuffle_keeps_file_order():
    loader = RowLoader(ROWS, LoaderConfig(batch_size=5, shuffle=False), process_index=0, process_count=1)
    assert sum(_take(loader, 4), ()) == ROWS[:20]


def test_drop_remainder_false_yields_short_last_batch():
    cfg = LoaderConfig(batch_size=5, seed=1, drop_remainder=False, num_epochs=2)
    loader = RowLoader(ROWS, cfg, process_index=0, process_count=1)
    assert loader.steps_per_epoch == 5
    batches = list(loader)
    assert [len(b) for b in batches] == [5, 5, 5, 5, 3] * 2
    assert sorted(sum(batches[:5], ())) == sorted(ROWS)


@pytest.mark.parametrize("drop_remainder", [True, False])
@pytest.mark.parametrize("steps_before", [0, 1, 3, 4, 5, 9])
def test_resume_from_saved_state_gives_exactly_the_rest(drop_remainder, steps_before):
    cfg = LoaderConfig(batch_size=5, seed=7, drop_remainder=drop_remainder)
    reference = _take(RowLoader(ROWS, cfg, process_index=0, process_count=1), 15)
    first = RowLoader(ROWS, cfg, process_index=0, process_count=1)
    _take(first, steps_before)
    saved = json.dumps(first.get_state())  # what a checkpoint would store
    resumed = RowLoader(ROWS, cfg, process_index=0, process_count=1)
    resumed.set_state(json.loads(saved))
    assert _take(resumed, 15 - steps_before) == reference[steps_before:]


def test_num_epochs_stops_and_state_survives_restore():
    cfg = LoaderConfig(batch_size=4, seed=0, num_epochs=2)
    loader = RowLoader(ROWS, cfg, process_index=0, process_count=1)
    assert len(list(loader)) == 2 * 5
    assert loader.get_state() == {"epoch": 2, "index": 0}
    again = RowLoader(ROWS, cfg, process_index=0, process_count=1)
    again.set_state({"epoch": 1, "index": 8})
    assert len(list(again)) == 3


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_hosts_get_disjoint_slices_that_make_up_the_global_batch(drop_remainder):
    hosts, per_host, steps = 3, 2, 9
    global_cfg = LoaderConfig(batch_size=hosts * per_host, seed=11, drop_remainder=drop_remainder)
    host_cfg = LoaderConfig(batch_size=per_host, seed=11, drop_remainder=drop_remainder)
    single = _take(RowLoader(ROWS, global_cfg, process_index=0, process_count=1), steps)
    per_host_batches = [
        _take(RowLoader(ROWS, host_cfg, process_index=p, process_count=hosts), steps) for p in range(hosts)
    ]
    for step in range(steps):
        parts = [per_host_batches[p][step] for p in range(hosts)]
        together = [row for part in parts for row in part]
        assert len(together) == len(set(together))  # disjoint
        assert sorted(together) == sorted(single[step])  # and covering the global batch
        if len(single[step]) == hosts * per_host:
            assert tuple(together) == single[step]  # host p holds the p-th slice
    # Every host yields the same number of batches per epoch, so collectives line up.
    steps_per_epoch = {
        RowLoader(ROWS, host_cfg, process_index=p, process_count=hosts).steps_per_epoch for p in range(hosts)
    }
    assert steps_per_epoch == {3 if drop_remainder else 4}
    (steps_per_epoch,) = steps_per_epoch
    # Over one epoch the hosts together see each usable row once: 18 = 3 x 6 (dropping 5), or all 23.
    expected = 18 if drop_remainder else 23
    epoch_rows = [
        row for p in range(hosts) for batch in per_host_batches[p][:steps_per_epoch] for row in batch
    ]
    assert len(epoch_rows) == len(set(epoch_rows)) == expected


def test_epoch_order_is_a_permutation_folded_from_seed_and_epoch():
    loader = RowLoader(ROWS, LoaderConfig(batch_size=2, seed=5), process_index=0, process_count=1)
    orders = [loader.epoch_order(e) for e in range(3)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(len(ROWS)))
    assert not np.array_equal(orders[0], orders[1])
    np.testing.assert_array_equal(orders[2], loader.epoch_order(2))


def test_bad_configs_and_states_are_rejected():
    with pytest.raises(ValueError, match="batch_size"):
        LoaderConfig(batch_size=0)
    with pytest.raises(ValueError, match="num_epochs"):
        LoaderConfig(batch_size=1, num_epochs=0)
    with pytest.raises(ValueError, match="seed"):
        LoaderConfig(batch_size=1, seed=-1)
    cfg = LoaderConfig(batch_size=4)
    with pytest.raises(ValueError, match="process_index"):
        RowLoader(ROWS, cfg, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        RowLoader(ROWS[:3], cfg, process_index=0, process_count=1)
    with pytest.raises(ValueError, match="no rows"):
        RowLoader((), LoaderConfig(batch_size=1, drop_remainder=False), process_index=0, process_count=1)
    loader = RowLoader(ROWS, cfg, process_index=0, process_count=1)
    with pytest.raises(ValueError, match="batch boundary"):
        loader.set_state({"epoch": 0, "index": 3})
    with pytest.raises(ValueError, match="loader state"):
        loader.set_state({"epoch": "0", "index": 0})
