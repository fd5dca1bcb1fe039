"""Validation mode (`eval.validation`, raysim/data/validation.py): a tuning run is judged on
samples held out of its training clients' data, never on the global test set or the clients'
own test splits."""
import numpy as np
import pytest

from raysim.config import load_config
from raysim.errors import ConfigError
from raysim.experiment import prepare


def test_validation_samples_come_from_the_training_clients_and_replace_both_test_sets():
    base = ["dataset=digits", "num_clients=10", "partition.test_fraction=0.2"]
    _, part0, _ = prepare(load_config(overrides=base))
    data, part, _ = prepare(load_config(overrides=[*base, "eval.validation=0.25"]))
    assert part.test is not None
    for cid in range(10):
        before, train, val = set(part0.train[cid]), set(part.train[cid]), set(part.test[cid])
        assert train | val == before and not train & val  # carved from the client's own training samples
        assert len(val) == int(len(before) * 0.25)
        assert not val & set(part0.test[cid])  # never its test split
    pooled = np.concatenate(part.test)
    assert np.array_equal(data.y_test, data.y_train[pooled])  # the global "test" set: the pooled validation samples
    assert np.array_equal(data.x_test, data.x_train[pooled])


def test_natural_users_own_test_samples_are_replaced_by_their_validation_samples():
    overrides = ["dataset=synthetic", "model=mclr", "partition=natural", "num_clients=10", "eval.validation=0.2"]
    data, part, _ = prepare(load_config(overrides=overrides))
    assert data.users_test is None and part.test is not None  # runtime/local_eval.py then reads part.test
    assert all(set(t).isdisjoint(v) for t, v in zip(part.train, part.test))


def test_a_share_that_leaves_a_client_no_validation_sample_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="eval.validation=0.01: client .* no validation sample"):
        prepare(load_config(overrides=["dataset=digits", "num_clients=20", "eval.validation=0.01"]))
    with pytest.raises(ConfigError, match=r"eval.validation must be in \[0, 1\)"):
        load_config(overrides=["eval.validation=1"])
