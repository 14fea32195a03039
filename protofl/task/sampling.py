"""Seeded client sampling and per-client seeds (no Flower): the same seed, the same clients."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def sample_partitions(
    partition_ids: Sequence[int], fraction: float, min_clients: int, seed: int, server_round: int
) -> list[int]:
    """The partition ids trained this round: depends only on (ids, fraction, seed, round)."""
    ids = sorted(partition_ids)
    count = min(len(ids), max(min_clients, int(fraction * len(ids))))
    rng = np.random.default_rng([seed, server_round])
    return sorted(int(i) for i in rng.choice(ids, size=count, replace=False))


def client_seed(seed: int, server_round: int, partition_id: int) -> int:
    """Seed for one client's local work in one round."""
    return int(np.random.SeedSequence([seed, server_round, partition_id]).generate_state(1)[0])


def server_seed(seed: int, server_round: int) -> int:
    """Seed for the server's own work in one round (server-side training): a stream apart from
    every client's (:func:`client_seed`), by its spawn key."""
    return int(np.random.SeedSequence([seed, server_round], spawn_key=(1,)).generate_state(1)[0])
