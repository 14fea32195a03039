"""FedProto (Tan et al., AAAI 2022): clients share class prototypes instead of models.

Client: loss = CE + lambda * MSE(feature, global prototype of its label) (per-sample form of the
official code and PFLlib); after training, per-class mean features from an eval pass over the
local training split (``prototype-pass = "post-eval"``; ``"during-train"``: of the training-mode
features seen in training, as the official code and HtFLlib), and the class counts, go up as
bytes. The model is personal and kept in ``context.state``.

Server: global prototype of class c = average of the client prototypes of c, weighted by the
clients' counts of c (Eq. 5, ``weighting = "count"``) or unweighted over the clients holding c
(``"uniform"``, as PFLlib). Classes no client of this round holds get no global prototype.
``average-parameters = true`` also averages the models (FedAvg + prototype loss), giving a GM.

Inference: nearest global prototype (``inference = "prototype"``, the reported PM) and the
classifier head; both are logged.
"""

from __future__ import annotations

import numpy as np
import torch

from protofl.strategies.base import (
    PROTOTYPE_PASSES,
    PROTOTYPE_WEIGHTINGS,
    ArraySpec,
    ClientUpdate,
    PrototypeClient,
    PrototypeStrategy,
    aggregate_prototypes,
    average_parameters,
    get_weights,
    prototype_broadcast,
    set_weights,
)
from protofl.task.train import (
    head_prediction,
    nearest_prototype,
    train,
)

INFERENCES = ("prototype", "head")


def prototype_loss(
    features: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """MSE between each feature and its label's global prototype, averaged over batch x d.

    Samples whose class has no global prototype contribute zero (as PFLlib's FedProto).
    """
    has_prototype = mask[labels].unsqueeze(1).to(features.dtype)
    return ((features - prototypes[labels]) ** 2 * has_prototype).sum() / features.numel()


class FedProtoStrategy(PrototypeStrategy):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.weighting = str(self.config.option("weighting", "count"))
        if self.weighting not in PROTOTYPE_WEIGHTINGS:
            raise ValueError(f"fedproto.weighting must be one of {PROTOTYPE_WEIGHTINGS}, got {self.weighting!r}")
        self.global_prototypes: np.ndarray | None = None
        self.prototype_mask: np.ndarray | None = None

    @property
    def has_global_model(self) -> bool:
        return bool(self.config.option("average-parameters", False))

    def upload_spec(self) -> dict[str, ArraySpec]:
        return self.class_statistics_spec("prototypes")

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return prototype_broadcast(self.global_prototypes, self.prototype_mask)

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray] | None:
        self.global_prototypes, self.prototype_mask = aggregate_prototypes(
            np.stack([u.payload["prototypes"] for u in updates]),
            np.stack([u.payload["class-counts"] for u in updates]),
            self.weighting,
        )
        if not self.has_global_model:
            return None
        return average_parameters(updates)


class FedProtoClient(PrototypeClient):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lam = float(self.config.option("lambda", 1.0))
        self.average_parameters = bool(self.config.option("average-parameters", False))
        self.inference = str(self.config.option("inference", "prototype"))
        if self.inference not in INFERENCES:
            raise ValueError(f"fedproto.inference must be one of {INFERENCES}, got {self.inference!r}")
        self.prototype_pass = str(self.config.option("prototype-pass", "post-eval"))
        if self.prototype_pass not in PROTOTYPE_PASSES:
            raise ValueError(f"fedproto.prototype-pass must be one of {PROTOTYPE_PASSES}, got {self.prototype_pass!r}")

    def _load_model(self, parameters) -> None:
        if self.average_parameters:
            set_weights(self.model, parameters)
        else:
            self.restore_personal_model()

    def fit(self, parameters, config):
        self._load_model(parameters)
        received = self.global_prototypes(config)
        use_prototypes = received is not None and self.lam > 0
        seen = self.prototype_collector(self.prototype_pass)

        def extra_loss(features, _logits, labels):
            if seen is not None:
                seen.add(features, labels)
            if not use_prototypes:
                return features.new_zeros(())
            return self.lam * prototype_loss(features, labels, *received)

        loss = train(
            self.model, self.data.train_x, self.data.train_y,
            extra_loss=extra_loss if use_prototypes or seen is not None else None, **self.train_kwargs(config),
        )
        prototypes = self.local_prototypes(seen)
        counts = self.data.class_counts()
        if not self.average_parameters:
            self.store_personal_model()
        parameters_out = get_weights(self.model) if self.average_parameters else []
        return parameters_out, self.data.num_train, self.fit_metrics(
            loss, prototypes=prototypes, **{"class-counts": counts}
        )

    def evaluate(self, parameters, config):
        self._load_model(parameters)
        predictors = {"head": head_prediction}
        received = self.global_prototypes(config)
        if received is not None:
            predictors["prototype"] = lambda f, _logits: nearest_prototype(f, *received)
        return self.evaluate_predictors(predictors, self.inference if self.inference in predictors else "head")


STRATEGY, CLIENT = FedProtoStrategy, FedProtoClient
