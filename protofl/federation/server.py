"""The legacy Flower front of the server template (:mod:`protofl.federation.server_core`): a
``flwr.server.strategy.Strategy`` whose calls take Flower's ``FitIns``/``FitRes`` and client
proxies, the product brief's shape (prototypes as ``.npy`` bytes in fit-result metrics next to
the parameters). ``flower-api = "legacy"`` runs it; :func:`legacy_strategy` makes a method's
server rule one."""

from __future__ import annotations

import functools
from typing import Any, Mapping

from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetPropertiesIns,
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
from protofl.federation.wire import Blobs, Reply, describe_failure

__all__ = ["ClientUpdate", "PayloadError", "PrototypeStrategy", "ProxyNodes", "RunStopped", "legacy_reply",
           "legacy_strategy", "stacked_statistics"]


def legacy_reply(res: FitRes | EvaluateRes) -> Reply:
    """A legacy fit or evaluate result as the server template reads a reply, once, at this edge:
    its fields, not checked yet. Never raises: what cannot be read is the reply's ``problem``."""
    try:
        tensors = list(res.parameters.tensors) if hasattr(res, "parameters") else []
        return Reply(Blobs(tensors), res.num_examples, dict(res.metrics), getattr(res, "loss", None))
    except Exception as err:  # whatever the result holds, the round goes on without it
        return Reply(problem=f"an unreadable reply ({type(err).__name__}: {err})"[:300])


def read_results(results: list[tuple[ClientProxy, FitRes | EvaluateRes]]) -> list[tuple[ClientProxy, Reply]]:
    return [(proxy, legacy_reply(res)) for proxy, res in results]


class ProxyNodes:
    """Flower's legacy client manager as the server template's
    :class:`~protofl.federation.partitions.Nodes`: a query is a ``get_properties`` call."""

    def __init__(self, client_manager: ClientManager) -> None:
        self.client_manager = client_manager

    def all(self) -> dict[str, ClientProxy]:
        return self.client_manager.all()

    def wait_for(self, num_nodes: int, timeout: int) -> bool:
        return self.client_manager.wait_for(num_nodes, timeout=timeout)

    def properties(self, node: ClientProxy, query: Mapping[str, Any], timeout: float) -> Mapping[str, Any]:
        return node.get_properties(GetPropertiesIns(config=dict(query)), timeout, 0).properties


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
        instructions = self.fit_instructions(server_round, ProxyNodes(client_manager), sent,
                                             sum(len(t) for t in parameters.tensors))
        return [(node, FitIns(parameters, config)) for node, config in instructions]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        new_parameters, metrics = self.fit_results(server_round, read_results(results),
                                                   [describe_failure(f) for f in failures])
        if new_parameters is None:
            return None, metrics  # Flower keeps the parameters
        return ndarrays_to_parameters(new_parameters), metrics

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        return self.global_scores(server_round, parameters_to_ndarrays(parameters) if parameters.tensors else [])

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        return [(node, EvaluateIns(parameters, config))
                for node, config in self.evaluate_instructions(server_round, ProxyNodes(client_manager))]

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        return self.evaluate_results(server_round, read_results(results), [describe_failure(f) for f in failures])


@functools.cache
def legacy_strategy(rule: type[ServerRule]) -> type[PrototypeStrategy]:
    """The Flower ``Strategy`` of a method's server rule (a plain class): the rule's hooks on the
    legacy front, named as the rule is."""
    return rule_on_front(rule, PrototypeStrategy)
