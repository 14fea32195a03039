"""FedAvg (McMahan et al., 2017): sample-weighted parameter averaging.

GM is the global model on the global test set. PM is, by default, the same global model scored
on each client's local test split (PFLlib's convention for global-model methods);
``personal-model = "local"`` scores instead the client's model right after its local training
(FedNH's convention for FedAvg's PM).
"""

from __future__ import annotations

import numpy as np

from protofl.strategies.base import (
    ClientUpdate,
    PrototypeClient,
    PrototypeStrategy,
    average_parameters,
    get_weights,
    set_weights,
)
from protofl.task.train import train


class FedAvgStrategy(PrototypeStrategy):
    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        return average_parameters(updates, bool(self.config.option("weighted", True)))


PERSONAL_MODELS = ("global", "local")


class FedAvgClient(PrototypeClient):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        personal_model = self.config.option("personal-model", "global")
        if personal_model not in PERSONAL_MODELS:
            raise ValueError(f"fedavg.personal-model must be one of {PERSONAL_MODELS}, got {personal_model!r}")
        self.keep_local_model = personal_model == "local"

    def fit(self, parameters, config):
        set_weights(self.model, parameters)
        loss = train(self.model, self.data.train_x, self.data.train_y, **self.train_kwargs(config))
        if self.keep_local_model:
            self.store_personal_model()
        return get_weights(self.model), self.data.num_train, self.fit_metrics(loss)

    def evaluate(self, parameters, config):
        if not (self.keep_local_model and self.restore_personal_model()):
            set_weights(self.model, parameters)
        return self.evaluate_head()


STRATEGY, CLIENT = FedAvgStrategy, FedAvgClient
