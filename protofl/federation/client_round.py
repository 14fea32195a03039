"""What one client message asks of a method's client rule, typed: the client template
(:meth:`~protofl.federation.client.PrototypeClient.round_of`) builds it once from the message's
config, and the method's hooks read it, never Flower's dict (no Flower import here)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping


@dataclass(frozen=True)
class ClientRound:
    """One round as a client sees it.

    ``number``: the server round; ``seed``: this client's seed in it (its mini-batch order, its
    augmentation, its method's draws); ``lr``: the round's client learning rate (``lr-decay``
    applied); ``broadcasts``: the server's arrays by name, as they came off the wire (each one checked
    and decoded only when read, by the client's ``received...`` helpers); ``evaluates``: in a fit
    message that also carries the previous round's evaluation, that round (None otherwise)."""

    number: int
    seed: int
    lr: float
    broadcasts: Mapping[str, Any]
    evaluates: int | None = None

    def as_scored(self, seed: int, lr: float) -> ClientRound:
        """This message as the evaluate message of the round it scores would carry it: that round,
        its ``seed`` and ``lr``, the same broadcasts."""
        return replace(self, number=self.evaluates, seed=seed, lr=lr, evaluates=None)
