"""The client's Flower front of the legacy API: a ``NumPyClient`` that forwards each of Flower's calls
(``get_properties``, ``get_parameters``, ``fit``, ``evaluate``) to ``submit(method, *args)``. The
method's client (:class:`~protofl.federation.client.PrototypeClient`) derives from no Flower class:
the ClientApp hands Flower this front over it, or over its GPU's training worker
(:mod:`protofl.federation.training_worker`), which builds and runs the same client."""

from __future__ import annotations

from typing import Any, Callable

from flwr.client import NumPyClient

Submit = Callable[..., Any]  # submit(method, *args): the reply of the client that runs the call


class NumPyFront(NumPyClient):
    """A ClientApp's ``NumPyClient`` whose calls ``submit`` answers; ``client``: the client in this
    process that does, when it is one (None: a training worker's)."""

    def __init__(self, submit: Submit, client: Any = None) -> None:
        self.submit, self.client = submit, client

    @classmethod
    def over(cls, client: Any) -> NumPyFront:
        """The front of a client in this process."""
        return cls(lambda method, *args: getattr(client, method)(*args), client)

    def get_properties(self, config):
        return self.submit("get_properties", config)

    def get_parameters(self, config):
        return self.submit("get_parameters", config)

    def fit(self, parameters, config):
        return self.submit("fit", parameters, config)

    def evaluate(self, parameters, config):
        return self.submit("evaluate", parameters, config)
