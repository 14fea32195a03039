"""Local: each client trains alone, nothing is exchanged (the floor of a personalised-FL table).

Client: trains its own model, kept on its node across rounds, with cross-entropy. The server
samples clients as for any method, so each trains as often as it would be sampled in a federated
run (FedNH's Local: int(R gamma) rounds of local epochs); it aggregates nothing and has no GM.
PM: the client's model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protofl.federation.admission import ClientUpdate
from protofl.federation.client import PrototypeClient
from protofl.federation.server_rule import ServerRule
from protofl.settings import KeptModel, MethodOptions


@dataclass(frozen=True)
class LocalOptions(MethodOptions):
    statistics: ClassVar[None] = None
    keeps_model: ClassVar[KeptModel] = "trains"
    capturable: ClassVar[bool] = True  # no batch loss

    def shares(self, name: str) -> bool:
        return False


class LocalStrategy(ServerRule):
    options_class = LocalOptions

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> None:
        return None


class LocalClient(PrototypeClient):
    options_class = LocalOptions


STRATEGY, CLIENT = LocalStrategy, LocalClient
