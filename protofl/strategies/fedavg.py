"""FedAvg (McMahan et al., 2017): sample-weighted parameter averaging.

PM is the global model scored on each client's local test split (PFLlib's convention for
global-model methods); GM is the same model on the global test set.
"""

from __future__ import annotations

import numpy as np

from protofl.strategies.base import (
    ClientUpdate,
    PrototypeClient,
    PrototypeStrategy,
    get_weights,
    set_weights,
    weighted_average,
)
from protofl.task.train import train


class FedAvgStrategy(PrototypeStrategy):
    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        weighted = bool(self.config.option("weighted", True))
        weights = [u.num_examples if weighted else 1 for u in updates]
        return weighted_average([u.parameters for u in updates], weights)


class FedAvgClient(PrototypeClient):
    def fit(self, parameters, config):
        set_weights(self.model, parameters)
        loss = train(self.model, self.data.train_x, self.data.train_y, **self.train_kwargs(config))
        return get_weights(self.model), self.data.num_train, self.fit_metrics(loss)

    def evaluate(self, parameters, config):
        set_weights(self.model, parameters)
        return self.evaluate_head()


STRATEGY, CLIENT = FedAvgStrategy, FedAvgClient
