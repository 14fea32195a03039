"""The half of the server template that a method's server rule is written against: its hooks
(what it checks, broadcasts, expects uploaded and computes from the accepted updates), the helpers
that apply the run's robust rules and seeds to it, and the run of the rule each round, whose output
is checked before anything goes out (:class:`ServerRule`, a base of the server template,
:class:`~protofl.federation.server_core.ServerCore`)."""

from __future__ import annotations

import functools
from logging import WARNING
from typing import Any, Callable, Sequence

import numpy as np
import torch
from flwr.common.logger import log

from protofl.federation.admission import Admission, ClientUpdate, output_problem
from protofl.federation.partitions import PartitionDiscovery
from protofl.federation.server_state import MethodState
from protofl.federation.wire import ArraySpec
from protofl.report import RunRecorder
from protofl.settings import ExperimentSettings, MethodOptions
from protofl.task.models import SeededDraws
from protofl.task.robust import robust_average_layers
from protofl.task.sampling import server_seed


class ServerRule:
    """A method's server rule and what it may use, a plain class: the server template derives from
    it and sets these (:class:`~protofl.federation.server_core.ServerCore`, behind either Flower
    front: :func:`~protofl.federation.message_front.message_strategy`,
    :func:`~protofl.federation.server.legacy_strategy`): ``settings``, ``options``, ``model``,
    ``num_classes``, ``feature_dim``, ``initial_weights``, ``shared_indices``, ``has_global_model``,
    ``admission``, ``discovery``, ``method_state``, ``recorder`` (a round's own fields:
    ``recorder.update(server_round, name=value)``), ``device``."""

    options_class: type[MethodOptions] = MethodOptions
    state_fields: tuple[str, ...] = ()
    loss_metrics: tuple[str, ...] = ()
    broadcast_to_evaluate = True
    predictor_names: tuple[str, ...] = ("head",)
    settings: ExperimentSettings
    options: MethodOptions
    model: torch.nn.Module
    num_classes: int
    feature_dim: int
    initial_weights: list[np.ndarray]
    shared_indices: list[int]
    has_global_model: bool
    admission: Admission
    discovery: PartitionDiscovery
    method_state: MethodState
    recorder: RunRecorder
    device: torch.device

    # --- hooks for methods --------------------------------------------------------------

    def check_update(self, update: ClientUpdate) -> None:
        """Method-specific checks of a decoded update; raise :class:`PayloadError` to drop it."""

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        """Arrays sent to every client in the fit and evaluate config."""
        return {}

    def broadcast_to(self, server_round: int, partition_id: int) -> dict[str, np.ndarray]:
        """Arrays sent to the client of ``partition_id`` only, beside :meth:`broadcast`'s."""
        return {}

    def upload_specs(self) -> dict[str, ArraySpec]:
        """The named arrays each client uploads besides its parameters and class statistics, and
        what each must be (shape, dtype): a reply without one of them, or with one that is not so
        or not finite, is dropped."""
        return {}

    def parameter_spec(self, index: int, reference: np.ndarray) -> ArraySpec | tuple[ArraySpec, ...]:
        """What shared entry ``index`` may look like on the wire (``reference``: its initial value),
        as clients upload it and the rule returns it. Default: the entry's shape and dtype; a method
        whose entries travel compressed (FedKD's factors) adds their forms, which
        :meth:`parameter_from_wire` turns into the entry."""
        return ArraySpec.like(reference)

    def parameter_from_wire(self, index: int, array: np.ndarray, reference: np.ndarray) -> np.ndarray:
        """Shared entry ``index`` from its form on the wire, which :meth:`parameter_spec` checked;
        raise :class:`PayloadError` when it cannot be one. Default: the array as it is."""
        return array

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray] | None:
        """Server rule: new global parameters (the shared entries, each in a form
        :meth:`parameter_from_wire` reads: what goes out), or None when none are shared."""
        raise NotImplementedError

    def global_model_weights(self, shared: list[np.ndarray]) -> list[np.ndarray] | None:
        """The whole model (every ``state_dict`` entry, in order) that GM scores, from the shared
        entries a round ended with; None: the method has no GM. Default: the shared entries, when
        they are the whole model (a method that keeps its head on the clients may return
        :meth:`with_initial_entries`)."""
        return list(shared) if len(self.shared_indices) == len(self.initial_weights) else None

    # --- helpers for server rules -------------------------------------------------------

    def average_parameters(
        self, updates: Sequence[ClientUpdate], weights: Sequence[float] | None = None
    ) -> list[np.ndarray]:
        """The clients' parameters under the run's ``aggregation`` rule: with ``method``, their
        layer-wise mean weighted by ``weights`` (default: the training sizes)."""
        weights = [u.num_examples for u in updates] if weights is None else weights
        return self.average_arrays([u.parameters for u in updates], weights, self.admission.sent_parameters)

    def average_arrays(self, arrays: Sequence[Sequence[np.ndarray]], weights: Sequence[float],
                       reference: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Each client's list of arrays (a named upload) averaged under the run's ``aggregation``
        rule, as :meth:`average_parameters` (``norm-clip``: each client's deviation from
        ``reference``, default zero)."""
        s = self.settings
        reference = [np.zeros_like(a) for a in arrays[0]] if reference is None else reference
        return robust_average_layers(arrays, weights, s.aggregation, s.trim_fraction, reference)

    def stepped_entries(self, start: Sequence[np.ndarray], mean: Sequence[np.ndarray],
                        step: Callable[[int, np.ndarray, np.ndarray], np.ndarray]) -> list[np.ndarray]:
        """A server optimiser's new shared entries: ``step(i, x, mean)`` (in float64) for each
        trainable parameter, from its value ``x`` sent this round and the clients' ``mean``; the
        clients' mean for every other entry (a BatchNorm's running statistics, whose variance a step
        could drive below zero, and its batch count). Each in its entry's dtype."""
        return [step(i, x.astype(np.float64), m.astype(np.float64)).astype(x.dtype) if trained else m
                for i, (x, m, trained) in enumerate(zip(start, mean, self.trained_entries))]

    @functools.cached_property
    def trained_entries(self) -> list[bool]:
        """For each shared entry, whether it is a trainable parameter (not a buffer)."""
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        names = list(self.model.state_dict())
        return [names[i] in trainable for i in self.shared_indices]

    @property
    def prototype_rule(self) -> dict[str, Any]:
        """Keyword arguments that apply the run's ``prototype-aggregation`` rule to class vectors."""
        return {"rule": self.settings.prototype_aggregation, "trim_fraction": self.settings.trim_fraction}

    def server_generator(self, server_round: int) -> torch.Generator:
        """The server's own random draws in ``server_round`` (server-side training on :attr:`device`),
        from the run seed: a resumed run draws what the uninterrupted one drew."""
        return torch.Generator().manual_seed(server_seed(self.settings.seed, server_round))

    def seeded(self, server_round: int = 0) -> SeededDraws:
        """Within, torch's draws that take no generator come from the server's stream of
        ``server_round`` (round 0: a server-side module's initial values), on any thread."""
        return SeededDraws(server_seed(self.settings.seed, server_round))

    @property
    def num_clients(self) -> int:
        """The federation's number of clients (partitions), as discovery knows it."""
        return self.discovery.registry.num_partitions or len(self.discovery.nodes)

    def with_initial_entries(self, shared: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The initial model with its shared entries replaced by ``shared``: the GM of a method whose
        head stays on its clients (the aggregated body and the initial head, as FedNH's code scores
        FedPer, FedRep and FedBABU)."""
        weights = list(self.initial_weights)
        for index, array in zip(self.shared_indices, shared):
            weights[index] = array
        return weights

    def parameters_from_wire(self, parameters: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The shared entries from their forms on the wire (:meth:`parameter_from_wire`): what the
        rule returned, what a round sent or a checkpoint holds. A list of another length as it is."""
        references = self.shared_weights()
        if len(parameters) != len(references):
            return list(parameters)
        return [self.parameter_from_wire(i, a, r) for i, (a, r) in enumerate(zip(parameters, references))]

    def shared_weights(self) -> list[np.ndarray]:
        """Initial values of the model entries exchanged with clients, in order: sent in round 1,
        and the shapes and dtypes every client's parameters must have."""
        return [self.initial_weights[i] for i in self.shared_indices]

    # --- the rule's run ---------------------------------------------------------------------

    def apply_rule(self, server_round: int, updates: list[ClientUpdate]) -> tuple[list[np.ndarray] | None, str | None]:
        """The server rule on the accepted updates, its output checked: (new parameters, None), or
        (None, why) with the method's state as before the round."""
        saved = self.method_state.snapshot()
        try:
            new_parameters = self.aggregate_updates(server_round, updates)
            entries = None if new_parameters is None else self.parameters_from_wire(new_parameters)
            problem = output_problem(entries, self.shared_weights(), self.next_broadcasts(server_round + 1))
        except Exception as err:  # the rule must not end the run on what clients sent
            new_parameters, problem = None, f"the server rule failed: {type(err).__name__}: {err}"
        if problem is None:
            return new_parameters, None
        self.method_state.restore(saved)
        log(WARNING, "round %d: %s; the previous global state is kept", server_round, problem)
        return None, problem

    def next_broadcasts(self, server_round: int) -> dict[str, np.ndarray]:
        """What ``server_round`` would send: :meth:`broadcast`'s arrays, and each known partition's own
        (``<partition>:<name>``), for the check that nothing non-finite goes out."""
        own = {f"{p}:{k}": v for p in sorted(self.discovery.nodes)
               for k, v in self.broadcast_to(server_round, p).items()}
        return self.broadcast(server_round) | own
