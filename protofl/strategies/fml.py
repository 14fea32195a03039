"""FML (Shen et al., 2020): federated mutual learning. Each client trains its own model (any
architecture, kept on its node) together with a shared "meme" model (one architecture on every
client: the model family's first), each distilling into the other.

Client, each mini-batch (HtFLlib's form): L_own = alpha CE(z, y) + (1 - alpha) KL(p_meme || p_own) and
L_meme = beta CE(z_meme, y) + (1 - beta) KL(p_own || p_meme) (Eq. 1-2), KL averaged over the batch
and the classes (``nn.KLDivLoss()``'s mean); both models step on the gradient of L_own + L_meme (the
two backward passes of HtFLlib's code accumulate so), each model's gradient clipped to norm 10 on its
own (``max-grad-norm = "auto"``). The meme, received each round, goes up; the own model stays.
alpha = beta = 0.5 (FedSA's scripts).

Server: the memes averaged, unweighted (``weighted = false``, HtFLlib's). GM: the meme on the global
test set. PM: the client's own model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from protofl.federation.wire import SHARED_LOSS
from protofl.strategies.families.averaging import AveragingStrategy
from protofl.strategies.families.second_model import SecondModel, SecondModelClient
from protofl.task.losses import mean_kl


@dataclass(frozen=True)
class FMLOptions(SecondModel):
    alpha: float = 0.5
    beta: float = 0.5

    def check(self) -> None:
        for key in ("alpha", "beta"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"fml.{key} must be in [0, 1], got {getattr(self, key)}")


def mutual_loss(logits: torch.Tensor, other_logits: torch.Tensor, labels: torch.Tensor, weight: float) -> torch.Tensor:
    """Eq. 1 (2): weight CE(logits, y) + (1 - weight) KL(p_other || p)."""
    return weight * F.cross_entropy(logits, labels) + (1 - weight) * mean_kl(logits, other_logits)


class FMLStrategy(AveragingStrategy):
    options_class = FMLOptions
    loss_metrics = (SHARED_LOSS,)


class FMLClient(SecondModelClient):
    options_class = FMLOptions

    def local_training(self, this_round):
        o = self.options

        def loss(inputs, features, logits, labels):
            _, shared_logits = self.exchanged(inputs)
            shared_loss = mutual_loss(shared_logits, logits, labels, o.beta)
            self.record_loss(**{SHARED_LOSS: shared_loss})
            return mutual_loss(logits, shared_logits, labels, o.alpha) + shared_loss

        return self.train_together(this_round, loss)


STRATEGY, CLIENT = FMLStrategy, FMLClient
