"""FedRep (Collins et al., ICML 2021): a shared representation, a head kept by each client.

Client, each round (Algorithm 1 of the paper): with the body received frozen, its own head (kept on
its node) trains ``head-epochs`` epochs (10, the paper's and FedNH's code); then, the head frozen,
the body trains ``local-epochs`` epochs. Both from the round's seed (the same batch order, as FedNH's
code). Its head never leaves the node.

Server: FedAvg over the body's entries (``weighted = false``: unweighted, FedNH's code). PM: the
client's own head on the global body it receives (PFLlib's; FedNH's code scores the body the client
trained); GM: the aggregated body with the initial head (FedNH's code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protofl.federation.client import PrototypeClient
from protofl.strategies.families.model_parts import HEAD, BodyAveraging, BodySharing
from protofl.task.models import trainable_only


@dataclass(frozen=True)
class FedRepOptions(BodySharing):
    head_epochs: int = 10

    capturable: ClassVar[bool] = True  # no batch loss

    def check(self) -> None:
        if self.head_epochs < 0:
            raise ValueError(f"fedrep.head-epochs must be >= 0, got {self.head_epochs}")


class FedRepStrategy(BodyAveraging):
    options_class = FedRepOptions


class FedRepClient(PrototypeClient):
    options_class = FedRepOptions

    def local_training(self, this_round):
        head = [p for name, p in self.model.named_parameters() if name.startswith(HEAD)]
        body = [p for name, p in self.model.named_parameters() if not name.startswith(HEAD)]
        if self.options.head_epochs > 0:
            with trainable_only(self.model, head):  # the head, the body received frozen
                self.train_model(this_round, epochs=self.options.head_epochs, phase="head")
        with trainable_only(self.model, body):  # then the body, the head frozen
            return self.train_model(this_round, phase="body")


STRATEGY, CLIENT = FedRepStrategy, FedRepClient
