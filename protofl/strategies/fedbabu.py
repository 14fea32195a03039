"""FedBABU (Oh, Kim and Yun, ICLR 2022): only the body is trained and federated; the head stays
at its random initial values, the same on every client; each client fine-tunes before it is scored.

Client: trains the body received with cross-entropy through the frozen initial head (Algorithm 1
of the paper). Before scoring, it fine-tunes the whole model (head included) from the global body
for ``finetune-epochs`` epochs (5, the paper's and FedNH's code; 0: no fine-tuning) on its
training split, with the scored round's learning rate and seed (in an evaluate message or in the
next fit message alike), and scores that model (PM); the fine-tuned model is not kept.

Server: FedAvg over the body's entries (``weighted = false``: unweighted, FedNH's code). GM: the
aggregated body with the initial head, not fine-tuned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protofl.federation.client import PrototypeClient
from protofl.settings import ExperimentSettings, KeptModel
from protofl.strategies.families.model_parts import BodyAveraging, BodySharing
from protofl.task.models import SplitModel, trainable_only


@dataclass(frozen=True)
class FedBABUOptions(BodySharing):
    keeps_model: ClassVar[KeptModel] = None  # the head never changes: nothing of a client's to keep
    finetune_epochs: int = 5

    capturable: ClassVar[bool] = True  # no batch loss

    def check(self) -> None:
        if self.finetune_epochs < 0:
            raise ValueError(f"fedbabu.finetune-epochs must be >= 0, got {self.finetune_epochs}")


def prepare_model(model: SplitModel, settings: ExperimentSettings) -> SplitModel:
    """The head frozen at its initial values (the same seed gives every client the same)."""
    model.head.requires_grad_(False)
    return model


class FedBABUStrategy(BodyAveraging):
    options_class = FedBABUOptions


class FedBABUClient(PrototypeClient):
    options_class = FedBABUOptions

    def prepare_evaluation(self, parameters, this_round):
        self.load_shared(parameters)
        if self.options.finetune_epochs > 0:  # the whole model, head included
            with trainable_only(self.model, self.model.parameters()):
                self.train_model(self.scored_round(this_round), epochs=self.options.finetune_epochs,
                                 phase="finetune")


STRATEGY, CLIENT = FedBABUStrategy, FedBABUClient
