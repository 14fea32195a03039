"""The server's side of DP prototypes (``dp-noise``): every release recorded before it goes out and
its size settled from the reply, the run's ε, what travelled in the clear, and results.json's
``privacy`` block. The mechanism, its sensitivity and what is (not) claimed: :mod:`protofl.task.privacy`.
"""

from __future__ import annotations

from logging import WARNING
from typing import Any, Iterable, Sequence

import numpy as np
from flwr.common.logger import log

from protofl.federation.admission import ClientUpdate
from protofl.federation.partitions import PartitionDiscovery
from protofl.federation.wire import CLASS_MEANS
from protofl.report import RunRecorder
from protofl.settings import ExperimentSettings, MethodOptions
from protofl.task.privacy import RELEASES_FILE, ClearTraffic, ReleaseLedger, privacy_block, release_size


class PrivacyAccounting:
    """A run's DP releases (:class:`ReleaseLedger`, in ``<run directory>/dp-releases.json``: a resumed
    run continues it, so the releases after the checkpoint, which went out, count as well as their
    replay) and the keys of what clients sent (:class:`ClearTraffic`, always observed). Without
    ``dp-noise`` it records no release and writes no block."""

    def __init__(self, settings: ExperimentSettings, options: MethodOptions, model_entries: Sequence[str],
                 num_classes: int, recorder: RunRecorder, discovery: PartitionDiscovery) -> None:
        """``model_entries``: the model's state_dict names, of which the method's ``options`` share some
        (they travel without noise); ``discovery``: what the server knows each partition holds."""
        self.settings, self.num_classes, self.recorder = settings, num_classes, recorder
        self.known_sizes = discovery.known_sizes
        self.shared_names = [name for name in model_entries if options.shares(name)]
        self.enabled = settings.dp_noise > 0
        self.traffic = ClearTraffic()
        path = recorder.directory / RELEASES_FILE
        resumed = self.enabled and settings.resume and path.is_file()
        self.ledger = ReleaseLedger.load(path) if resumed else ReleaseLedger(path=path if self.enabled else None)

    def observe(self, kind: str, replies: Iterable[Any]) -> None:
        """The keys of ``replies`` (Flower replies: their ``properties`` or ``metrics``), received as
        ``kind``; refreshes the privacy block."""
        self.traffic.observe(kind, [getattr(r, "properties", None) or getattr(r, "metrics", None) for r in replies])
        if self.enabled:
            self.recorder.extra["privacy"] = self.block()

    def seen(self, properties: Any) -> None:
        """A node's properties reply (discovery)."""
        self.traffic.observe("properties", [properties])

    def release_size(self, partition_id: int, update: ClientUpdate | None = None) -> int:
        """k of a partition's release (:func:`~protofl.task.privacy.release_size`): the most of what the
        server's copy of the partition, the reply's counts and its released rows show; the number of
        classes without any of them."""
        known = self.known_sizes(partition_id)
        counts, means = [known[2] if known else None], []
        if update is not None and update.statistics is not None:
            counts.append(update.statistics.counts)
            means.append(update.statistics.means)
        return release_size(self.num_classes, counts, means)

    def released(self, server_round: int, partitions: Sequence[int]) -> None:
        """Before the round's instructions go out: one release by each of ``partitions`` (a reply that
        never arrives still counts)."""
        if self.enabled:
            self.ledger.record(server_round, {p: self.release_size(p) for p in partitions})

    def replied(self, server_round: int, replies: Sequence[Any], updates: Sequence[ClientUpdate]) -> None:
        """The round's fit ``replies`` (their keys) and those decoded (``updates``: the k of the releases
        they show)."""
        self.observe("fit", replies)
        if self.enabled:
            self.ledger.settle(server_round, {u.partition_id: self.release_size(u.partition_id, u) for u in updates})
            self.recorder.extra["privacy"] = self.block()

    def epsilon_field(self) -> dict[str, float]:
        """The round record's ``dp_epsilon`` (the run's ε so far), when there is one."""
        epsilon = self.ledger.epsilon(self.settings.dp_noise, self.settings.dp_delta) if self.enabled else None
        return {} if epsilon is None else {"dp_epsilon": epsilon}

    def block(self) -> dict[str, Any]:
        """results.json's ``privacy`` (:func:`~protofl.task.privacy.privacy_block`)."""
        s = self.settings
        return privacy_block(self.ledger, s.dp_noise, s.dp_clip, s.dp_delta, [CLASS_MEANS], self.traffic,
                             self.shared_names)

    def state(self) -> np.ndarray:
        """The releases as of a checkpoint (a resume reads the ledger's file, which has the later ones too)."""
        return self.ledger.state()

    def restore(self, state: Any, checkpointed_round: int) -> None:
        """After a resume from a checkpoint of a run without the ledger's file (an older protofl): its
        releases, and a warning that those after it are unknown."""
        if self.enabled and not self.ledger.path.is_file():
            log(WARNING, "protofl: no %s in %s: the DP releases are the checkpoint's; those after round %d "
                "(before the crash) are not counted", RELEASES_FILE, self.recorder.directory, checkpointed_round)
            self.ledger = ReleaseLedger.from_state(state, self.num_classes, self.ledger.path)

