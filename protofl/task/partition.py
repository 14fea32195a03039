"""Label-skew partitions over an index table, and each client's local train/test split.

``iid``, ``dirichlet`` and ``pathological`` are Flower Datasets' partitioners, written here in numpy
(the same indices; no ``datasets`` import).
``dirichlet-niid`` and ``dirichlet-pfllib`` are the capped Dirichlet splits of FedNH's and
PFLlib's code (NIID-Bench's), ``pathological-pfllib`` is PFLlib's deterministic class grouping (FedCoSR's protocol),
``dirichlet-balanced`` the CReFF-style equal-size Dirichlet split of FedSC/FedSKC's code and
``nid2`` FedSC's "5 biased + 1 full" split, here. A long-tail profile (``long-tail`` = rho) thins
the training pool before any of them. Data scarcity (FedCoSR §6.3) cuts clients' shares, per
class, before their train/test split.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

PartitionScheme = Literal[
    "iid", "dirichlet", "dirichlet-niid", "dirichlet-pfllib", "dirichlet-balanced", "nid2", "pathological",
    "pathological-pfllib",
]
PARTITION_SCHEMES = get_args(PartitionScheme)
MIN_PARTITION_SIZE = 4  # a client needs samples for both its local train and test split
PFLLIB_LEAST_SAMPLES = 40  # PFLlib's least_samples: batch 10 / (1 - 0.75 train share)
NIID_MIN_SIZE, NIID_MIN_CLASSES, NIID_ATTEMPTS = 10, 2, 3  # FedNH's partitioner (NIID-Bench's, plus a class floor)
PFLLIB_ATTEMPTS = 1000  # PFLlib redraws without end; past this many draws the floor is out of reach
FLOWER_DIRICHLET_ATTEMPTS = 11  # Flower Datasets' DirichletPartitioner: a first draw and 10 more

@dataclass(frozen=True)
class PartitionSpec:
    """Everything that decides which samples a client gets, and their values (hashable, for caching)."""

    scheme: str
    num_partitions: int
    alpha: float = 0.5
    classes_per_client: int = 2
    test_fraction: float = 0.25
    seed: int = 0
    data_fraction: float = 1.0  # every client keeps this share of its partition
    scarce_clients: int = 0  # ... and the last `scarce_clients` clients only `scarce_fraction` of that
    scarce_fraction: float = 1.0
    long_tail: float = 1.0  # rho = n_max / n_min of the training pool before partitioning (1: as loaded)
    pool: str = "train"  # what is partitioned: "train", or "train+test" merged (PFLlib)
    normalisation: str = "half"  # pixel statistics: 0.5 / 0.5, or the data set's own ("dataset")

    def kept_fraction(self, partition_id: int) -> float:
        """The share of its partition that a client keeps (1.0: all of it)."""
        scarce = partition_id >= self.num_partitions - self.scarce_clients
        return self.data_fraction * (self.scarce_fraction if scarce else 1.0)


def pfllib_pathological(
    labels: np.ndarray, num_partitions: int, classes_per_client: int, seed: int
) -> list[np.ndarray]:
    """PFLlib's pathological split: classes in order, each shared by the first
    ceil(N * s / C) clients that still have a free class slot (N = 20, s = 2, C = 10: clients
    0-3 get classes {0, 1}, 4-7 {2, 3}, ...). Shard sizes are drawn from
    [max(n_c / (10 K), least / C), n_c / K) for K holders; the last holder gets the rest."""
    num_classes = int(labels.max()) + 1
    if not 1 <= classes_per_client <= num_classes:
        raise ValueError(f"classes-per-client must be in [1, {num_classes}], got {classes_per_client}")
    holders_per_class = math.ceil(num_partitions * classes_per_client / num_classes)
    free_slots = np.full(num_partitions, classes_per_client)
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
    for c in range(num_classes):
        indices = np.flatnonzero(labels == c)
        holders = np.flatnonzero(free_slots > 0)[:holders_per_class]
        if len(holders) == 0:
            raise ValueError(
                f"pathological-pfllib: no client has a free class slot for class {c}; "
                f"num-partitions x classes-per-client must reach the {num_classes} classes"
            )
        share = len(indices) / len(holders)
        low = int(max(share / 10, PFLLIB_LEAST_SAMPLES / num_classes))
        sizes = rng.integers(low, max(int(share), low + 1), size=len(holders) - 1).tolist()
        sizes.append(len(indices) - sum(sizes))
        if sizes[-1] < 1:
            raise ValueError(f"pathological-pfllib: class {c} has too few samples ({len(indices)})")
        for holder, shard in zip(holders, np.split(indices, np.cumsum(sizes)[:-1])):
            parts[holder].append(shard)
            free_slots[holder] -= 1
    return [np.concatenate(p) if p else np.empty(0, np.int64) for p in parts]


def deal_class(holdings: list[list[np.ndarray]], sizes: np.ndarray, members: np.ndarray, shares: np.ndarray) -> None:
    """One class of a Dirichlet split: ``members`` cut at the cumulative ``shares`` (summing to 1), the
    i-th piece appended to client i's ``holdings`` and counted in its ``sizes``."""
    cuts = (np.cumsum(shares) * len(members)).astype(int)[:-1]
    for i, piece in enumerate(np.split(members, cuts)):
        holdings[i].append(piece)
        sizes[i] += len(piece)


def capped_dirichlet(
    labels: np.ndarray, num_partitions: int, alpha: float, seed: int,
    min_size: int, min_classes: int = 1, max_attempts: int = PFLLIB_ATTEMPTS, keep_last: bool = False,
) -> list[np.ndarray]:
    """NIID-Bench's Dirichlet split, which FedNH's and PFLlib's code use: class by class, proportions
    p ~ Dir(alpha) over the clients, zeroed for those already holding N / K samples (the cap that
    keeps sizes similar), then the class cut at the cumulative proportions. Redrawn whole while a
    client has fewer than ``min_size`` samples or ``min_classes`` classes, at most ``max_attempts``
    times; then the last draw is kept with a warning (``keep_last``, FedNH's code) or it is an error."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    rng = np.random.RandomState(seed)
    num_classes, cap = int(labels.max()) + 1, len(labels) / num_partitions
    by_class = [np.flatnonzero(labels == c) for c in range(num_classes)]
    attempt = 0
    while True:
        attempt += 1
        holdings: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
        sizes = np.zeros(num_partitions, dtype=np.int64)
        for members in by_class:
            members = rng.permutation(members)
            p = rng.dirichlet(np.full(num_partitions, alpha)) * (sizes < cap)
            deal_class(holdings, sizes, members, p / p.sum())
        classes = [sum(len(part) > 0 for part in h) for h in holdings]
        met = sizes.min() >= min_size and min(classes) >= min_classes
        if met or attempt == max_attempts:
            if not met and not keep_last:
                raise ValueError(
                    f"capped Dirichlet split: no draw in {attempt} gave every client {min_size} samples and "
                    f"{min_classes} classes; use fewer clients or a larger alpha"
                )
            if not met:
                warnings.warn(f"Dirichlet split: after {attempt} draws a client still has fewer than {min_size} "
                              f"samples or {min_classes} classes (smallest {sizes.min()}, fewest classes "
                              f"{min(classes)}); kept the last draw, as FedNH's code does")
            return [np.concatenate(h) for h in holdings]


def long_tail_indices(labels: np.ndarray, rho: float, seed: int) -> np.ndarray:
    """Sorted indices of an exponentially long-tailed subset (LDAM / FedSC's LT profile): class c
    keeps floor(n_max * rho^(-c / (C - 1))) of its samples, drawn at random, n_max = N / C."""
    if rho < 1:
        raise ValueError(f"long-tail (rho) must be >= 1, got {rho}")
    num_classes = int(labels.max()) + 1
    n_max = len(labels) / num_classes
    rng = np.random.RandomState(seed)
    kept = []
    for c in range(num_classes):
        indices = np.flatnonzero(labels == c)
        rng.shuffle(indices)
        kept.append(indices[: int(n_max * rho ** (-c / max(num_classes - 1, 1)))])
    return np.sort(np.concatenate(kept))


def dirichlet_balanced(labels: np.ndarray, num_partitions: int, alpha: float, seed: int) -> list[np.ndarray]:
    """CReFF's Dirichlet split, used by FedSC's and FedSKC's code: clients in groups of 10, each
    group a contiguous chunk of the shuffled samples; within a group, per class, proportions from
    Dir(alpha) over the clients not yet holding their share, redrawn until the smallest client has
    half a share; then every group's clients in order, re-cut into equal contiguous pieces, so all
    clients end up with (almost) the same number of samples. Fewer than 10 clients: one group."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    rng = np.random.RandomState(seed)
    order = rng.permutation(len(labels))
    num_groups = math.ceil(num_partitions / 10)
    chunk_size = len(labels) * 10 // num_partitions if num_groups > 1 else len(labels)
    num_classes = int(labels.max()) + 1
    assigned: list[np.ndarray] = []
    for g in range(num_groups):
        chunk = order[g * chunk_size :] if g == num_groups - 1 else order[g * chunk_size : (g + 1) * chunk_size]
        clients = min(10, num_partitions - 10 * g)
        share = len(chunk) / clients
        members_of = [chunk[labels[chunk] == c] for c in range(num_classes)]
        for _attempt in range(1000):
            holdings: list[list[np.ndarray]] = [[] for _ in range(clients)]
            sizes = np.zeros(clients, dtype=np.int64)
            for members in members_of:
                p = rng.dirichlet(np.full(clients, alpha)) * (sizes < share)
                deal_class(holdings, sizes, members, p / p.sum())
            if sizes.min() >= int(0.5 * share):
                break
        else:
            raise ValueError(f"dirichlet-balanced: no draw gave every client half a share (alpha={alpha})")
        assigned.extend(np.concatenate(h) for h in holdings)
    return np.array_split(np.concatenate(assigned), num_partitions)


def nid2(labels: np.ndarray, num_partitions: int) -> list[np.ndarray]:
    """FedSC's NID2 (FedDisco's NIID-2): K - 1 biased clients, each holding its own block of C / (K - 1)
    classes, and one last client holding every class. With s = N / (C K), a biased client takes the
    first (K - 1) s samples of each of its classes, the last client the next s of every class."""
    num_classes = int(labels.max()) + 1
    biased = num_partitions - 1
    if not 1 <= biased <= num_classes:
        raise ValueError(f"nid2 needs 2 to {num_classes + 1} partitions, got {num_partitions}")
    s = len(labels) // (num_classes * num_partitions)
    by_class = [np.flatnonzero(labels == c) for c in range(num_classes)]
    blocks = np.array_split(np.arange(num_classes), biased)
    parts = [np.concatenate([by_class[c][: biased * s] for c in block]) for block in blocks]
    parts.append(np.concatenate([members[biased * s : (biased + 1) * s] for members in by_class]))
    return parts


def partition_indices(labels: np.ndarray, spec: PartitionSpec) -> list[np.ndarray]:
    """Split ``range(len(labels))`` into ``spec.num_partitions`` index arrays.

    Deterministic for a given spec. Raises ``ValueError`` when a partition comes out
    with fewer than ``MIN_PARTITION_SIZE`` samples.
    """
    labels = np.asarray(labels, dtype=np.int64)
    n = spec.num_partitions
    if n < 1:
        raise ValueError(f"num-partitions must be >= 1, got {n}")
    if n > len(labels):
        raise ValueError(f"cannot split {len(labels)} samples into {n} partitions")
    if spec.long_tail != 1.0:
        pool = long_tail_indices(labels, spec.long_tail, spec.seed)
        parts = partition_indices(labels[pool], dataclasses.replace(spec, long_tail=1.0))
        return [np.sort(pool[part]) for part in parts]
    if spec.scheme == "pathological-pfllib":
        return _checked(pfllib_pathological(labels, n, int(spec.classes_per_client), spec.seed), spec)
    if spec.scheme == "dirichlet-niid":  # FedNH: >= 10 samples and >= 2 classes, 3 draws at most
        parts = capped_dirichlet(labels, n, spec.alpha, spec.seed, NIID_MIN_SIZE, NIID_MIN_CLASSES, NIID_ATTEMPTS, True)
        return _checked(parts, spec)
    if spec.scheme == "dirichlet-pfllib":  # PFLlib: redrawn until every client has min(40, N / 2K) samples
        least = int(min(PFLLIB_LEAST_SAMPLES, len(labels) / n / 2))
        return _checked(capped_dirichlet(labels, n, float(spec.alpha), spec.seed, least), spec)
    if spec.scheme == "dirichlet-balanced":
        return _checked(dirichlet_balanced(labels, n, float(spec.alpha), spec.seed), spec)
    if spec.scheme == "nid2":
        return _checked(nid2(labels, n), spec)
    if spec.scheme == "iid":
        return _checked(np.array_split(np.random.default_rng(spec.seed).permutation(len(labels)), n), spec)
    if spec.scheme == "dirichlet":
        if spec.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {spec.alpha}")
        return _checked(flower_dirichlet(labels, n, float(spec.alpha), spec.seed), spec)
    if spec.scheme == "pathological":
        num_classes = int(labels.max()) + 1
        if not 1 <= spec.classes_per_client <= num_classes:
            raise ValueError(f"classes-per-client must be in [1, {num_classes}], got {spec.classes_per_client}")
        return _checked(flower_pathological(labels, n, int(spec.classes_per_client), spec.seed), spec)
    raise ValueError(f"partition must be one of {PARTITION_SCHEMES}, got {spec.scheme!r}")


# Flower Datasets' partitioners (flwr_datasets 0.6's IidPartitioner on a seeded permutation,
# DirichletPartitioner without self-balancing, PathologicalPartitioner with random class assignment),
# in numpy: the same indices from the same seed (tests/test_partition.py compares them with Flower
# Datasets'), without importing ``datasets`` and Flower Datasets' plotting (3.5 CPU-seconds a process).
# Each partitioner's last shuffle of every client's indices is left out: partitions are sorted.

def flower_dirichlet(labels: np.ndarray, num_partitions: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Each class split by a Dirichlet(alpha) draw of client shares; the whole draw repeated, 11
    times at most, until every client holds MIN_PARTITION_SIZE samples."""
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(labels == k) for k in np.unique(labels)]
    for _ in range(FLOWER_DIRICHLET_ATTEMPTS):
        holdings: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
        sizes = np.zeros(num_partitions, dtype=np.int64)
        for members in by_class:
            deal_class(holdings, sizes, members, rng.dirichlet(np.full(num_partitions, alpha)))
        if sizes.min() >= MIN_PARTITION_SIZE:
            return [np.concatenate(h) for h in holdings]
    raise ValueError(
        f"could not build the 'dirichlet' partition of {len(labels)} samples into {num_partitions} clients "
        f"(no draw in {FLOWER_DIRICHLET_ATTEMPTS} gave every client {MIN_PARTITION_SIZE} samples); "
        "use fewer clients or a larger alpha"
    )


def flower_pathological(labels: np.ndarray, num_partitions: int, classes_per_client: int,
                        seed: int) -> list[np.ndarray]:
    """Each client draws ``classes_per_client`` distinct classes; each class is cut into equal
    consecutive shares, one per client that drew it, in client order."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    if classes_per_client > len(classes):
        raise ValueError(f"classes-per-client {classes_per_client} is more than the {len(classes)} classes present")
    drawn = [rng.choice(classes, size=classes_per_client, replace=False) for _ in range(num_partitions)]
    parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
    for k in classes:
        holders = [i for i, chosen in enumerate(drawn) if k in chosen]
        if not holders:  # a class no client drew is left out
            continue
        members = np.flatnonzero(labels == k)
        if len(holders) > len(members):
            raise ValueError(f"class {k} was drawn by {len(holders)} clients but has {len(members)} samples; "
                             "use fewer clients or fewer classes per client")
        for i, piece in zip(holders, np.array_split(members, len(holders))):
            parts[i].append(piece)
    return [np.concatenate(part) if part else np.zeros(0, np.int64) for part in parts]


def _checked(parts: list[np.ndarray], spec: PartitionSpec) -> list[np.ndarray]:
    small = [i for i, part in enumerate(parts) if len(part) < MIN_PARTITION_SIZE]
    if small:
        sizes = ", ".join(f"{i}: {len(parts[i])}" for i in small)
        raise ValueError(
            f"{spec.scheme!r} partition left clients with fewer than {MIN_PARTITION_SIZE} samples "
            f"({sizes}); use fewer clients, a larger alpha or more classes per client"
        )
    return [np.sort(part) for part in parts]


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int | tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Positions of a per-class split: about ``test_fraction`` of every class goes to test.

    A class keeps at least one training sample. Returns sorted (train, test) positions.
    """
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    test = []
    for c in np.unique(labels):
        positions = np.flatnonzero(labels == c)
        rng.shuffle(positions)
        n_test = min(int(round(len(positions) * test_fraction)), len(positions) - 1)
        test.append(positions[:n_test])
    test_positions = np.sort(np.concatenate(test)) if test else np.empty(0, np.int64)
    mask = np.ones(len(labels), dtype=bool)
    mask[test_positions] = False
    return np.flatnonzero(mask), test_positions


def stratified_subsample(labels: np.ndarray, fraction: float, seed: tuple[int, ...]) -> np.ndarray:
    """Sorted positions keeping ``fraction`` of every class (at least one sample of each)."""
    rng = np.random.default_rng(seed)
    kept = [
        rng.permutation(positions)[: max(1, int(round(len(positions) * fraction)))]
        for positions in (np.flatnonzero(labels == c) for c in np.unique(labels))
    ]
    return np.sort(np.concatenate(kept))


def client_split(
    labels: np.ndarray, partition: np.ndarray, spec: PartitionSpec, partition_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """A client's (train, test) sample indices: its partition, cut to its kept fraction with the
    label distribution unchanged, then split per class."""
    fraction = spec.kept_fraction(partition_id)
    if fraction < 1.0:
        partition = partition[stratified_subsample(labels[partition], fraction, (spec.seed, partition_id, 1))]
    train_pos, test_pos = stratified_split(
        labels[partition], spec.test_fraction, seed=(spec.seed, partition_id)
    )
    if len(test_pos) == 0 and spec.test_fraction > 0:
        raise ValueError(
            f"partition {partition_id} ({len(partition)} samples) is too small for a local "
            f"test split at test-fraction={spec.test_fraction}"
        )
    return partition[train_pos], partition[test_pos]
