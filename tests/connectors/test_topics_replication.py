"""`spanguard topics create` picks the replication for the cluster it finds."""

from __future__ import annotations

import pytest

from spanguard.config.settings import WorkerSettings
from spanguard.connectors.topics import choose_replication
from spanguard.errors import SettingsError


@pytest.mark.parametrize(
    ("brokers", "factor", "min_insync"),
    [(1, 1, 1), (2, 2, 1), (3, 3, 2), (5, 3, 2)],
)
def test_chosen_for_the_cluster(brokers: int, factor: int, min_insync: int) -> None:
    chosen = choose_replication(brokers)
    assert (chosen.factor, chosen.min_insync, chosen.chosen) == (factor, min_insync, True)
    assert f"replication factor {factor}, min.insync.replicas {min_insync}" in chosen.describe()
    assert f"chosen for {brokers} broker" in chosen.describe()


def test_an_operators_factor_is_kept_and_one_that_cannot_fit_refused() -> None:
    assert choose_replication(5, requested=2).factor == 2
    assert not choose_replication(5, requested=2).chosen
    with pytest.raises(ValueError, match="needs 4 brokers, the cluster has 3"):
        choose_replication(3, requested=4)


def test_the_default_is_chosen_and_a_negative_one_refused() -> None:
    assert WorkerSettings().replication_factor == 0
    with pytest.raises(SettingsError, match="replication_factor"):
        WorkerSettings(replication_factor=-1)
