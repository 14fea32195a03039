"""The legacy Flower front of the server template (:mod:`protofl.federation.server_core`): a
``flwr.server.strategy.Strategy`` whose calls take Flower's ``FitIns``/``FitRes`` and client
proxies, the product brief's shape (prototypes as ``.npy`` bytes in fit-result metrics next to
the parameters). ``flower-api = "legacy"`` runs it; :func:`legacy_strategy` makes a method's
server rule one."""

from __future__ import annotations

import functools

from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from protofl.federation.server_core import (
    ClientUpdate,
    PayloadError,
    RunStopped,
    ServerCore,
    rule_on_front,
    stacked_statistics,
)
from protofl.federation.server_rule import ServerRule
from protofl.federation.wire import describe_failure, parameters_bytes

__all__ = ["ClientUpdate", "PayloadError", "PrototypeStrategy", "RunStopped", "legacy_strategy", "stacked_statistics"]


class PrototypeStrategy(ServerCore, Strategy):
    """The legacy Flower front of a server rule: the server template behind Flower's legacy
    ``Strategy`` calls, whose rule hooks a method's :class:`ServerRule` fills in
    (:func:`legacy_strategy`)."""

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters:
        return ndarrays_to_parameters(self.initial_parameters())

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        sent = parameters_to_ndarrays(parameters) if parameters.tensors else []
        instructions = self.fit_instructions(server_round, client_manager, sent, parameters_bytes(parameters))
        return [(node, FitIns(parameters, config)) for node, config in instructions]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        new_parameters, metrics = self.fit_results(server_round, results, [describe_failure(f) for f in failures])
        if new_parameters is None:
            return None, metrics  # Flower keeps the parameters
        return ndarrays_to_parameters(new_parameters), metrics

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        return self.global_scores(server_round, parameters_to_ndarrays(parameters) if parameters.tensors else [])

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        return [(node, EvaluateIns(parameters, config))
                for node, config in self.evaluate_instructions(server_round, client_manager)]

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        return self.evaluate_results(server_round, results, [describe_failure(f) for f in failures])


@functools.cache
def legacy_strategy(rule: type[ServerRule]) -> type[PrototypeStrategy]:
    """The Flower ``Strategy`` of a method's server rule (a plain class): the rule's hooks on the
    legacy front, named as the rule is."""
    return rule_on_front(rule, PrototypeStrategy)
