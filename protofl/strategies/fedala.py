"""FedALA (Zhang et al., AAAI 2023): adaptive local aggregation of the global model into each client's.

Client, before each local training (Section 4, Eq. 4-6; the authors' ``ALA.py``, PFLlib's): from
the global model theta received and its own model theta_i (kept on its node; the initial model
before its first round), the client starts from theta_hat = theta_i + (theta - theta_i) . W_i on the
last ``blended-tensors`` parameter tensors (the head's weight and bias by default) and theta on all
the others (a BatchNorm's statistics stay the client's). W_i, element-wise and kept on the node
(all ones at first), is learned on the local loss: on each mini-batch (the run's batch size) of a
contiguous ``sample-percent`` % slice of the training split (its start drawn from the round's seed),
W_i <- clip(W_i - eta (d loss / d theta_hat) . (theta - theta_i), 0, 1), theta_hat recomputed. The
first time (the start phase) W_i trains epoch after epoch until the standard deviation of the
last ``window`` epochs' losses (each epoch's last mini-batch) falls below ``threshold`` (or
``max-start-epochs`` pass); afterwards one epoch per round. A client whose model equals the global
model (its first round) skips the aggregation. It then trains theta_hat with CE and uploads it.
W_i learns with the model in eval mode (PFLlib's copy is in training mode: the same without
BatchNorm or dropout, and here a BatchNorm's statistics are not moved by it).

Server: FedAvg (``weighted``: by training size). GM: the global model. PM: theta_hat, the model the
client's next training starts from (PFLlib scores its clients after the aggregation), with the
slice drawn from the next round's seed; the W_i it learns there are not kept.
Defaults: the paper's and PFLlib's (eta 1, 80 %, 2 tensors, threshold 0.1, window 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from protofl.federation.client import PrototypeClient
from protofl.settings import KeptModel
from protofl.strategies.families.averaging import AveragingStrategy, ParameterAveraging
from protofl.task.precision import to_channels_last
from protofl.task.sampling import client_seed

BLEND_WEIGHTS, STARTED = "ala-weights/", "ala-started"  # local_state: W_i per blended tensor; the start phase done


@dataclass(frozen=True)
class FedALAOptions(ParameterAveraging):
    eta: float = 1.0
    sample_percent: float = 80.0
    blended_tensors: int = 2
    threshold: float = 0.1
    window: int = 10
    max_start_epochs: int = 1000

    keeps_model: ClassVar[KeptModel] = "trains"
    capturable: ClassVar[bool] = True  # training is plain CE

    def check(self) -> None:
        if not self.eta > 0 or not 0 < self.sample_percent <= 100:
            raise ValueError(f"fedala.eta must be > 0 and fedala.sample-percent in (0, 100], "
                             f"got {self.eta} and {self.sample_percent}")
        if self.blended_tensors < 1 or self.window < 1 or self.max_start_epochs < 1 or self.threshold < 0:
            raise ValueError("fedala.blended-tensors, fedala.window and fedala.max-start-epochs must be >= 1 "
                             "and fedala.threshold >= 0")


def slice_start(n: int, size: int, seed: int) -> int:
    """The first index of the contiguous slice of ``size`` of ``n`` samples, drawn from ``seed``."""
    return int(torch.randint(0, n - size + 1, (1,), generator=torch.Generator().manual_seed(seed)).item())


class FedALAStrategy(AveragingStrategy):
    options_class = FedALAOptions


class FedALAClient(PrototypeClient):
    options_class = FedALAOptions

    def receive(self, parameters, this_round):
        self.adaptive_local_aggregation(parameters, this_round.seed, keep=True)

    def prepare_evaluation(self, parameters, this_round):
        scored = self.scored_round(this_round).number  # as the next round's fit would start
        self.adaptive_local_aggregation(parameters, client_seed(self.settings.seed, scored + 1,
                                                                self.data.partition_id), keep=False)

    def adaptive_local_aggregation(self, parameters, seed: int, keep: bool) -> None:
        """theta_hat from the global model ``parameters`` and the client's own (Eq. 4-6), W_i learned
        (``keep``: and kept on the node)."""
        local = [p.detach().clone() for p in self.model.parameters()]
        own_buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        self.load_shared(parameters)
        received = [p.detach().clone() for p in self.model.parameters()]
        if all(torch.equal(a, b) for a, b in zip(local, received)):
            return  # the client's first round: nothing to blend
        blended = len(received) - self.options.blended_tensors
        with torch.no_grad():  # a BatchNorm's statistics stay the client's
            for name, buffer in self.model.named_buffers():
                buffer.copy_(own_buffers[name])
        weights = [torch.from_numpy(self.local_state[f"{BLEND_WEIGHTS}{i}"].copy()).to(self.device)
                   if f"{BLEND_WEIGHTS}{i}" in self.local_state else torch.ones_like(p)
                   for i, p in enumerate(local[blended:])]
        top = list(self.model.parameters())[blended:]
        own, difference = local[blended:], [g - t for g, t in zip(received[blended:], local[blended:])]

        def blend() -> None:  # Eq. 4
            with torch.no_grad():
                for p, t, d, w in zip(top, own, difference, weights):
                    p.copy_(t + d * w)

        blend()
        started = STARTED in self.local_state
        n = self.data.num_train
        size = max(1, int(self.options.sample_percent / 100 * n))  # (PFLlib's int(), at least one sample)
        start = slice_start(n, size, seed)
        x, y = self.data.train_x[start:start + size], self.data.train_y[start:start + size]
        if to_channels_last(self.model, x, self.precision["channels_last"], self.precision["cuda_graphs"]):
            x = x.contiguous(memory_format=torch.channels_last)  # the training step's format
        self.model.eval()  # deterministic, and a BatchNorm's statistics untouched
        with torch.enable_grad():
            losses = []
            while True:
                for first in range(0, size, self.settings.batch_size):
                    loss = F.cross_entropy(self.model(x[first:first + self.settings.batch_size])[1],
                                           y[first:first + self.settings.batch_size])
                    gradients = torch.autograd.grad(loss, top)
                    with torch.no_grad():  # Eq. 6
                        for w, g, d in zip(weights, gradients, difference):
                            w.copy_(torch.clamp(w - self.options.eta * g * d, 0, 1))
                    blend()
                losses.append(loss.item())
                window = losses[-self.options.window:]
                if started or len(losses) > self.options.window and np.std(window) < self.options.threshold:
                    break
                if len(losses) >= self.options.max_start_epochs:
                    break
        if keep:
            self.local_state.update({f"{BLEND_WEIGHTS}{i}": w.cpu().numpy() for i, w in enumerate(weights)})
            self.local_state[STARTED] = np.ones(1, np.int8)


STRATEGY, CLIENT = FedALAStrategy, FedALAClient
