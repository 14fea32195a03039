"""FedAMP (Huang et al., AAAI 2021): attentive message passing between similar clients.

The server keeps every client's latest model w_j (the initial model for a client it has not heard
from) and sends each sampled client i its own cloud model
u_i = xi_ii w_i + sum_(j != i) xi_ij w_j, xi_ij = alpha_k A'(||w_i - w_j||^2) with the attention
function A(x) = 1 - exp(-x / sigma), so A'(x) = exp(-x / sigma) / sigma, and xi_ii = 1 - sum_(j != i)
xi_ij: a client weighs most the models nearest its own. protofl bounds each xi_ij by 1 / n, n the
models in u_i (:func:`attention_weights`; ``peer-weight-bound = false``: the paper's and PFLlib's
weights): the paper's weights sum to at most 1 only for small alpha_k, and a near copy of a
client's model got weight 1 in its cloud model. Before the server has any model, the
client's u_i is its own model.

Client: trains its own model w_i, kept on its node, with CE + (lambda / (2 alpha_k)) ||w_i - u_i||^2
(``proximal = "squared"``, the paper's), and uploads it as the named arrays ``client-model/<i>``
(one per trainable parameter); the model parameters channel carries nothing. ``proximal =
"pfllib"``: PFLlib's d832e76 term, (lambda / (2 alpha_k)) ||w_i - u_i|| computed on the weights'
``.data``: it is added to the loss reported but has no gradient, so the training is plain CE.

Server: PFLlib computes the attention over the previous round's uploads only; protofl over every
client's latest model (the paper's), the same when every client takes part each round (FedCoSR's
setting). PM: the client's own model. No GM. Defaults: PFLlib's (alpha_k 1, lambda 1, sigma 1);
the paper's were not found, and no other implementation's beat Local in FedCoSR's table setting
(docs/results/scale.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, Sequence

import numpy as np
import torch

from protofl.federation.admission import ClientUpdate
from protofl.federation.client import PrototypeClient
from protofl.federation.server_rule import ServerRule
from protofl.federation.wire import PROXIMAL_LOSS, ArraySpec, indexed
from protofl.settings import KeptModel, MethodOptions
from protofl.task.losses import proximal_term
from protofl.task.weights import stacked_columns, weighted_sums

CLIENT_MODEL, CLOUD_MODEL = "client-model", "cloud-model"  # w_i (uploaded), u_i (to client i)


@dataclass(frozen=True)
class FedAMPOptions(MethodOptions):
    alpha_k: float = 1.0
    lambda_: float = 1.0  # key "lambda"
    sigma: float = 1.0
    proximal: Literal["squared", "pfllib"] = "squared"
    peer_weight_bound: bool = True  # each xi_ij <= 1 / n (false: the paper's and PFLlib's weights, unbounded)

    statistics: ClassVar[None] = None
    keeps_model: ClassVar[KeptModel] = "trains"
    capturable: ClassVar[bool] = True  # a sum over the parameters

    def check(self) -> None:
        if not self.alpha_k > 0 or not self.sigma > 0:
            raise ValueError(f"fedamp.alpha-k and fedamp.sigma must be > 0, got {self.alpha_k} and {self.sigma}")
        if self.lambda_ < 0:
            raise ValueError(f"fedamp.lambda must be >= 0, got {self.lambda_}")

    def shares(self, name: str) -> bool:
        return False  # the models go up as named arrays; each client's u_i comes down on its own


def attention_weights(distances: Sequence[float], alpha_k: float, sigma: float,
                      bounded: bool = True) -> tuple[np.ndarray, float]:
    """(xi_ij for each other client j, xi_ii) from the squared distances ||w_i - w_j||^2; ``bounded``:
    each xi_ij at most 1 / n (n the models in the cloud model, its own included), so that no peer
    weighs more than in their plain mean and xi_ii >= 1 / n. Unbounded, a near copy of w_i (or of
    the initial model, which the server holds for a client it has not heard from) gets
    alpha_k / sigma (1 by default), and two copies make xi_ii negative."""
    others = np.array([alpha_k * math.exp(-d / sigma) / sigma for d in distances], np.float64)
    if bounded:
        others = np.minimum(others, 1.0 / (len(distances) + 1))
    return others, 1.0 - float(others.sum())


def read_only(array: np.ndarray) -> np.ndarray:
    """``array``, marked read-only: a held model is replaced, never changed in place, and the
    server's state snapshot shares it rather than copying it each round."""
    array.setflags(write=False)
    return array


def pairwise_squared_distances(models: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
    """||w_a - w_b||^2 for every pair of ``models`` in float64, from their Gram matrix G (one matrix
    product per block of entries, not a difference per pair): d_ab = G_aa + G_bb - 2 G_ab, 0 on the
    diagonal exactly. Its rounding error is at most a few eps (||w_a||^2 + ||w_b||^2), not eps d_ab:
    where d_ab is that small, exp(-d_ab / sigma) is 1 to that error."""
    gram = torch.zeros(len(models), len(models), dtype=torch.float64)
    for _, _, block in stacked_columns(models):
        gram += block @ block.T
    norms = torch.diagonal(gram)
    return torch.clamp(norms[:, None] + norms[None, :] - 2.0 * gram, min=0.0).numpy()


class FedAMPStrategy(ServerRule):
    options_class = FedAMPOptions
    state_fields = ("client_models",)
    broadcast_to_evaluate = False  # PM: the client's own model
    loss_metrics = (PROXIMAL_LOSS,)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.initial_model = [p.detach().cpu().numpy().copy() for p in self.model.parameters() if p.requires_grad]
        self.client_models: dict[int, list[np.ndarray]] = {}  # each client's latest w_j
        self._clouds: tuple[dict, dict[int | None, dict[str, np.ndarray]]] = ({}, {})  # (of these models, u_i)

    def upload_specs(self) -> dict[str, ArraySpec]:
        return {name: ArraySpec.like(a) for name, a in indexed(CLIENT_MODEL, self.initial_model).items()}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> None:
        names = list(indexed(CLIENT_MODEL, self.initial_model))
        self.client_models = self.client_models | {u.partition_id: [read_only(u.uploads[k]) for k in names]
                                                   for u in updates}
        return None

    def broadcast_to(self, server_round: int, partition_id: int) -> dict[str, np.ndarray]:
        if not self.client_models:
            return {}
        models, clouds = self._clouds
        if models is not self.client_models:  # computed once per set of models (the check, then the send)
            self._clouds = models, clouds = self.client_models, self.cloud_models()
        return clouds.get(partition_id, clouds[None])

    def cloud_models(self) -> dict[int | None, dict[str, np.ndarray]]:
        """u_i of each client the server holds a model of, and (key None) of a client it does not,
        whose own model is the initial one: every pair's distance from one Gram matrix, and every
        cloud model from one matrix of weights (row: the cloud, column: the model)."""
        partitions = sorted(self.client_models)
        models = [self.client_models[p] for p in partitions] + [self.initial_model]
        distances = pairwise_squared_distances(models)
        n = len(partitions)
        weights = np.zeros((n + 1, n + 1))
        for row in range(n + 1):  # a held client's peers: the other held models; the initial model's: all
            peers = [j for j in range(n) if j != row]
            weights[row, peers], weights[row, row] = attention_weights(
                distances[row, peers], self.options.alpha_k, self.options.sigma, self.options.peer_weight_bound)
        clouds = weighted_sums(weights, models)
        return {key: indexed(CLOUD_MODEL, cloud) for key, cloud in zip([*partitions, None], clouds)}


class FedAMPClient(PrototypeClient):
    options_class = FedAMPOptions

    def receive(self, parameters, this_round):
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        cloud = self.received_like(this_round, CLOUD_MODEL, self.trained)
        self.cloud = [p.detach().clone() for p in self.trained] if cloud is None else cloud  # u_i

    def batch_loss(self, features, logits, labels, inputs):
        factor = self.options.lambda_ / self.options.alpha_k
        if self.options.proximal == "pfllib":  # a value without a gradient
            distance = torch.sqrt(sum(((p.detach() - u) ** 2).sum() for p, u in zip(self.trained, self.cloud)))
            self.record_loss(**{PROXIMAL_LOSS: distance})
            return factor * distance / 2
        proximal = proximal_term(self.trained, self.cloud)  # ||w_i - u_i||^2 / 2
        self.record_loss(**{PROXIMAL_LOSS: proximal})
        return factor * proximal

    def step_constants(self):
        return ()

    def step_inputs(self):
        return {f"cloud/{i}": u for i, u in enumerate(self.cloud)}

    def uploads(self):
        return indexed(CLIENT_MODEL, [p.detach().cpu().numpy() for p in self.trained])


STRATEGY, CLIENT = FedAMPStrategy, FedAMPClient
