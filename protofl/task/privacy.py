"""Differentially private prototypes: the client's clip-and-noise step, the accounting of it, and
what a run with ``dp-noise`` still sends in the clear (pure numpy; the accounting is Google's
``dp-accounting`` RDP accountant, never a hand-written bound).

**The mechanism.** A client that trains in a round releases, for each of the k classes it holds,
one vector clipped to L2 norm ``clip``, plus Gaussian noise of standard deviation
``noise * clip`` per coordinate (:func:`privatize_class_means`); rows of classes it does not hold
stay zero. The noise comes from ``np.random.default_rng()`` seeded from the OS's entropy
(:meth:`protofl.federation.wire.ClassStatistics.privatized`), never from the run seed, which the
server knows: runs with ``dp-noise`` are not bit-reproducible, and a resumed run draws fresh
noise for the rounds it replays.

**Neighbouring data sets**: one training sample of the client replaced by another of the same
class. The class counts travel in the clear (below), so the ε says nothing about which classes a
client holds or how many samples of each.

**Sensitivity.** The class vectors come from a model trained on the same local data in the same
round, so one replaced sample can move *every* row the client releases, not only its own class's
(``tests/test_privacy.py`` measures it with the real training). Each row is clipped to norm
``clip``, so each moves by at most ``2 * clip``, and the concatenated k rows by at most
``2 * clip * sqrt(k)``: each release is a Gaussian mechanism with noise multiplier
``noise * clip / (2 * clip * sqrt(k)) = noise / (2 * sqrt(k))`` (:func:`release_noise_multiplier`).
The bound is attained when every row flips to its antipode; nothing in the training rules that
out, so it is the bound the accountant uses.

**Which k.** The server decides k per release from what it can see, and never takes fewer rows
than any of it shows (:func:`release_size`): the classes with a nonzero count in its own copy of the
partition (``verify-partitions``), the classes the client's reply counts and the nonzero rows of
the class vectors it released (a noised row of a held class is nonzero with probability 1);
without any of these (no reply, an unreadable one, no server copy of the data) k is the number of
classes, the most a release can hold. A client that lies about its counts can only lower its own
privacy, and the released rows still bound k from below.

**Composition.** Each partition's releases compose (RDP, ``dp-accounting``), counted per round it
was sent a fit instruction: a round whose reply never arrived counts too. The run's ε is the
worst partition's. **No amplification by sampling is claimed**: with ``fraction-fit < 1`` the
clients of a round are drawn from the run seed, which the server knows (``task/sampling.py``), so
participation is neither secret nor Poisson; a partition simply pays for the rounds it trained in.
Releases are persisted as they go out (:class:`ReleaseLedger`, ``dp-releases.json`` in the run
directory), so the rounds a resumed run replays count twice: both releases went out.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from protofl.task.storage import atomic_write

RELEASES_FILE = "dp-releases.json"  # in the run directory: every release so far, kept across resumes

NEIGHBOURS = "one training sample of a client replaced by another of the same class"
SENSITIVITY = "2 * dp-clip * sqrt(k) for a release of k class vectors, each clipped to dp-clip"
AMPLIFICATION = ("none claimed: the clients of a round are drawn from the run seed (known to the server), "
                 "not by secret Poisson sampling; each client pays for every round it was sent a fit instruction")
NOISE_SOURCE = ("numpy default_rng() seeded from OS entropy (protofl/federation/wire.py, "
                "ClassStatistics.privatized): runs with dp-noise are not bit-reproducible")


def privatize_class_means(
    means: np.ndarray, counts: np.ndarray, clip: float, noise: float, rng: np.random.Generator
) -> np.ndarray:
    """C x d class vectors -> each held class's row clipped to norm <= ``clip`` plus
    N(0, (noise * clip)^2) per coordinate (float32); rows of absent classes stay zero."""
    held = np.asarray(counts) > 0
    rows = means[held].astype(np.float64)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    rows = rows * np.minimum(1.0, clip / np.maximum(norms, 1e-12))
    rows = rows + rng.normal(0.0, noise * clip, size=rows.shape)
    private = np.zeros(means.shape, dtype=np.float32)
    private[held] = rows
    return private


def release_noise_multiplier(noise: float, held_classes: int) -> float:
    """The Gaussian mechanism's noise multiplier (noise std / L2 sensitivity) of one release of
    ``held_classes`` rows: ``noise * clip / (2 * clip * sqrt(k))``."""
    return noise / (2.0 * math.sqrt(held_classes))


def release_size(
    num_classes: int, counts: Iterable[np.ndarray | None] = (), means: Iterable[np.ndarray | None] = ()
) -> int:
    """k of one release: the most that any evidence shows, the classes with a nonzero count in each
    of ``counts`` (the server's copy of the partition, the client's claim) and the nonzero rows of
    each of ``means`` (what it released); ``num_classes`` without evidence."""
    seen = [int(np.count_nonzero(np.asarray(c))) for c in counts if c is not None]
    seen += [int(np.count_nonzero(np.any(np.asarray(m) != 0, axis=1))) for m in means if m is not None]
    return max(seen) if seen else num_classes


def prototype_epsilon(noise: float, releases: Sequence[int], delta: float) -> float:
    """ε at ``delta`` of one client's ``releases`` (the number of class rows of each) of
    :func:`privatize_class_means` with ``noise`` (relative to the clip norm), composed with RDP;
    0 without releases, inf without noise."""
    if len(releases) == 0:
        return 0.0
    if noise <= 0:
        return float("inf")
    import dp_accounting

    accountant = dp_accounting.rdp.RdpAccountant()
    for held, count in sorted(Counter(int(k) for k in releases).items()):
        accountant.compose(dp_accounting.GaussianDpEvent(release_noise_multiplier(noise, held)), count)
    return float(accountant.get_epsilon(delta))


class ReleaseLedger:
    """Every DP release of the run: (round, partition, k) in the order they went out. The run's ε
    is its worst partition's (:meth:`epsilon`). ``path``: the file each change is written to
    (atomically), so that a crash loses none of them."""

    def __init__(self, releases: Iterable[Sequence[int]] = (), path: Path | None = None) -> None:
        self.releases: list[list[int]] = [[int(r), int(p), int(k)] for r, p, k in releases]
        self.path = path
        self._epsilons: dict[tuple[float, float, tuple[int, ...]], float] = {}

    @classmethod
    def from_state(cls, state: Any, num_classes: int, path: Path | None = None) -> "ReleaseLedger":
        """Read back :meth:`state`; a checkpoint written before k was recorded holds release counts by
        partition (``{"3": 2}``), taken as that many releases of ``num_classes`` rows (round 0)."""
        if isinstance(state, Mapping):
            return cls([(0, int(pid), num_classes) for pid, n in state.items() for _ in range(int(n))], path)
        return cls(np.asarray(state, dtype=np.int64).reshape(-1, 3).tolist(), path)

    @classmethod
    def load(cls, path: Path) -> "ReleaseLedger":
        return cls(json.loads(Path(path).read_text())["releases"], path)

    def record(self, server_round: int, sizes: Mapping[int, int]) -> None:
        """One release by each partition in ``sizes`` (partition -> k, as known before its reply)."""
        self.releases += [[server_round, int(p), int(k)] for p, k in sorted(sizes.items())]
        self.save()

    def settle(self, server_round: int, sizes: Mapping[int, int]) -> None:
        """The k of this round's releases as their replies show them (partition -> k)."""
        for entry in reversed(self.releases):
            if entry[0] == server_round and entry[1] in sizes:
                entry[2] = int(sizes[entry[1]])
                sizes = {p: k for p, k in sizes.items() if p != entry[1]}  # the latest release only
        self.save()

    def by_partition(self) -> dict[int, list[int]]:
        """Partition -> the k of each of its releases."""
        releases: dict[int, list[int]] = defaultdict(list)
        for _, partition, held in self.releases:
            releases[partition].append(held)
        return dict(releases)

    def epsilons(self, noise: float, delta: float) -> dict[int, float]:
        """Partition -> its ε at ``delta`` so far."""
        result = {}
        for partition, held in self.by_partition().items():
            key = (noise, delta, tuple(sorted(held)))
            if key not in self._epsilons:
                self._epsilons[key] = prototype_epsilon(noise, key[2], delta)
            result[partition] = self._epsilons[key]
        return result

    def epsilon(self, noise: float, delta: float) -> float | None:
        """The run's ε at ``delta`` so far (its worst partition's); None before any release."""
        epsilons = self.epsilons(noise, delta)
        return max(epsilons.values()) if epsilons else None

    def state(self) -> np.ndarray:
        """The releases as (round, partition, k) rows of int64, as :meth:`from_state` takes them back."""
        return np.array(self.releases, dtype=np.int64).reshape(-1, 3)

    def save(self) -> None:
        if self.path is not None:
            atomic_write(self.path, json.dumps({"releases": self.releases}).encode())


class ClearTraffic:
    """The keys of what clients sent, by message kind (``properties``, ``fit``, ``evaluate``), as the
    server received them: what a run's privacy block lists. A client chooses its keys, so only
    strings of at most ``MAX_KEY`` characters are kept, at most ``MAX_KEYS`` per kind; the others'
    occurrences are counted (``unlisted``)."""

    MAX_KEY, MAX_KEYS = 64, 64

    def __init__(self) -> None:
        self.keys: dict[str, set[str]] = defaultdict(set)
        self.unlisted: dict[str, int] = defaultdict(int)

    def observe(self, kind: str, messages: Iterable[Any]) -> None:
        """The keys of each of ``messages`` (mappings; anything else is skipped)."""
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            for key in message:
                known = self.keys[kind]
                if key in known:
                    continue
                if isinstance(key, str) and len(key) <= self.MAX_KEY and len(known) < self.MAX_KEYS:
                    known.add(key)
                else:
                    self.unlisted[kind] += 1

    def listed(self, kind: str, without: Iterable[str] = ()) -> list[str]:
        return sorted(self.keys.get(kind, set()) - set(without))


def privacy_block(
    ledger: ReleaseLedger, noise: float, clip: float, delta: float, covered: Sequence[str],
    traffic: ClearTraffic, shared_parameters: Sequence[str],
) -> dict[str, Any]:
    """results.json's ``privacy``: what the ε covers, how it was accounted, its value and each
    partition's, and what travelled in the clear (from what the clients of this run sent)."""
    epsilons = ledger.epsilons(noise, delta)
    worst = max(epsilons, key=lambda p: (epsilons[p], -p)) if epsilons else None
    held = {p: sorted(set(ks)) for p, ks in ledger.by_partition().items()}
    return {
        "covers": list(covered),
        "mechanism": (f"Gaussian: each held class's vector clipped to L2 norm {clip:g}, plus noise of std "
                      f"{noise:g} x {clip:g} per coordinate"),
        "neighbouring": NEIGHBOURS,
        "sensitivity": SENSITIVITY,
        "accountant": "RDP (dp-accounting), composed over the rounds each client released; the run's epsilon is "
                      "the worst client's",
        "amplification": AMPLIFICATION,
        "noise_source": NOISE_SOURCE,
        "delta": delta,
        "epsilon": None if worst is None else epsilons[worst],
        "worst_partition": worst,
        "releases": {str(p): len(ks) for p, ks in sorted(ledger.by_partition().items())},
        "held_classes": {str(p): ks[0] if len(ks) == 1 else ks for p, ks in sorted(held.items())},
        "epsilon_by_partition": {str(p): e for p, e in sorted(epsilons.items())},
        "in_the_clear": {
            "properties": traffic.listed("properties"),
            "fit": traffic.listed("fit", without=covered) + ["num_examples"],
            "evaluate": traffic.listed("evaluate") + ["loss", "num_examples"],
            "parameters": list(shared_parameters),
            **({"unlisted_keys": dict(traffic.unlisted)} if traffic.unlisted else {}),
        },
    }
