"""The server template, on typed inputs: what a round does on the server, whichever front
(:mod:`protofl.federation.server`, Flower's legacy ``Strategy``; :mod:`protofl.federation.message_front`,
its Message API) carries the messages. A method fills it in with hooks (its :class:`ServerRule`).

Per round: discover which node holds which partition (:mod:`protofl.federation.partitions`),
sample partitions with the run seed, send each the parameters the method shares, its seed and the
method's broadcast arrays; admit the fit results (:mod:`protofl.federation.admission`: each checked
against what the server knows, then screened against the round's cohort) and hand the accepted
updates, sorted by partition, to the method's server rule; check the rule's output before anything
goes out; score the global model (GM) and record the clients' evaluations (PM,
:mod:`protofl.federation.evaluation`); checkpoint (:mod:`protofl.federation.checkpoint`).

Every client message is hostile until checked: nothing a client sends raises out of the strategy.
A bad update or evaluation is dropped with a logged reason, recorded in the round's ``dropped``
list of results.json; an aggregate that is not finite (or a server rule that fails) keeps the
previous global state, recorded as ``kept_previous``.

Hooks (see docs/adding-a-method.md):

- ``options_class``: the method's :class:`~protofl.settings.MethodOptions` (what it uploads and
  which model entries it shares are declared there);
- ``loss_metrics``: scalar losses its clients report, checked and averaged into the results;
- ``check_update(update)``: method-specific checks; raise :class:`PayloadError` to drop an update;
- ``broadcast(server_round)``: arrays sent to clients in the fit (and evaluate) config;
- ``aggregate_updates(server_round, updates)``: the server rule; returns the new global parameters
  (the shared entries, in order) or None; it averages parameters with :meth:`average_parameters`
  and passes :attr:`prototype_rule` to the class-vector math, so the run's robust rules apply;
- ``global_model_weights(shared)``: the whole model GM scores (default: the shared entries when
  they are the whole model; :meth:`with_initial_entries` for a head kept on the clients);
- ``broadcast_to(server_round, partition_id)``: arrays sent to one client only (FedAMP's own model);
- ``upload_specs()``: the named arrays each client uploads besides its parameters and class
  statistics (SCAFFOLD's control-variate deltas), checked by admission like every other field;
- ``state_fields``: the attributes that hold the method's server state, which may hold torch
  modules and optimizers (:mod:`protofl.federation.server_state`): checkpointed, restored on
  resume and when a round's output is rejected;
- ``broadcast_to_evaluate``: False keeps the broadcasts out of the evaluate config;
- ``predictor_names``: the predictors its clients score (``PrototypeClient.predictors``); an
  evaluation that reports another is dropped.
"""

from __future__ import annotations

import time
from logging import ERROR, INFO, WARNING
from typing import Any, Callable, Sequence

import numpy as np
import torch
from flwr.common.logger import log

from protofl.federation.admission import (
    Admission,
    ClientUpdate,
    client_compute,
    output_problem,
    stacked_statistics,
    too_few_updates,
)
from protofl.federation.checkpoint import Checkpoint, RunCheckpoints
from protofl.federation.evaluation import PersonalizedEvaluation, global_model_scores
from protofl.federation.partitions import DISCOVERY_TIMEOUT, ExpectedSizes, Nodes, PartitionDiscovery
from protofl.federation.privacy_accounting import PrivacyAccounting
from protofl.federation.server_rule import ServerRule
from protofl.federation.server_state import MethodState
from protofl.federation.wire import EVALUATE_ROUND, TRAIN_LOSS, PayloadError, encode_array, payload_bytes
from protofl.report import RunRecorder, progress_line, summary_text
from protofl.settings import ExperimentSettings
from protofl.task.models import MODEL_FAMILIES, SplitModel
from protofl.task.precision import get_device
from protofl.task.sampling import client_seed, sample_partitions
from protofl.typed_fields import Scalar

__all__ = ["ClientUpdate", "Nodes", "PayloadError", "RunStopped", "ServerCore", "rule_on_front", "stacked_statistics"]


Instruction = tuple[Any, dict[str, Any]]  # (a node, its message's config: scalars, and arrays as .npy bytes)


def mean_client_metrics(updates: Sequence[ClientUpdate], keys: Sequence[str]) -> dict[str, float]:
    """Training-size-weighted mean of each metric over the clients that report it, keyed with "_"."""
    fields = {}
    for key in keys:
        reported = [(u.metrics[key], u.num_examples) for u in updates if key in u.metrics]
        if reported:
            values, weights = zip(*reported)
            fields[key.replace("-", "_")] = float(np.average(values, weights=weights))
    return fields


def fit_fields(
    updates: Sequence[ClientUpdate], loss_metrics: Sequence[str], results: Sequence[tuple[Any, Any]],
    failures: Sequence[str], dropped: list[dict[str, Any]],
) -> dict[str, Any]:
    """A round's record of its fit replies: the accepted updates' mean losses, the traffic up, what
    was rejected and why."""
    weights = [u.num_examples for u in updates]
    return {
        **mean_client_metrics(updates, loss_metrics),
        "train_loss": float(np.average([u.metrics[TRAIN_LOSS] for u in updates], weights=weights)),
        "bytes_up": sum(_bytes_up(res) for _, res in results),
        "rejected": len(results) - len(updates) + len(failures),
        "dropped": dropped,
    }


def logged_failures(server_round: int, stage: str, failed: Sequence[str], checkpoints: RunCheckpoints) -> list[str]:
    """A round's failed messages (each described in one line), logged; a simulated client whose
    state dir is not the server's stops the run (:meth:`RunCheckpoints.unshared_state`)."""
    for reason in failed:
        log(WARNING, "round %d: a client failed to %s: %s", server_round, stage, reason)
    if unshared := checkpoints.unshared_state(failed):
        raise RunStopped(f"round {server_round}: {unshared}")
    return failed


class RunStopped(Exception):
    """A round cannot go on: the run ends with this one-line reason, its results so far saved."""


def rule_on_front(rule: type[ServerRule], front: type) -> type:
    """A method's server rule on a Flower front (a subclass of :class:`ServerCore`), named as the
    rule is."""
    return type(rule.__name__, (rule, front), {"__module__": rule.__module__, "__doc__": rule.__doc__,
                                               "__qualname__": rule.__qualname__})


class ServerCore(ServerRule):
    """The server template: seeded sampling, payload checks, the method's rule, GM/PM evaluation,
    results and checkpoints, on typed inputs. A front turns Flower's messages into them and back:
    the instructions (a node and its config) go out, the replies come back as ``(node, reply)``
    pairs, where a reply has a fit or evaluate result's fields (``parameters.tensors``,
    ``num_examples``, ``metrics``; ``loss``), and a failed message as one line."""

    def __init__(
        self,
        settings: ExperimentSettings,
        model: SplitModel,
        num_classes: int,
        global_test: tuple[torch.Tensor, torch.Tensor] | None = None,
        recorder: RunRecorder | None = None,
        partition_sizes: ExpectedSizes | None = None,
        client_state_dir: str = "",
        state_bytes: Callable[[int], int] | None = None,
    ) -> None:
        """``partition_sizes``: each partition's sizes from the server's own copy of the data set, which
        the nodes' claims must match (``verify-partitions``); the others: :class:`RunCheckpoints`'."""
        super().__init__()
        self.settings = settings
        self.options = self.options_class.from_settings(settings)
        self.model, self.num_classes, self.feature_dim = model, num_classes, model.feature_dim
        self.global_test = global_test
        self.recorder = recorder or RunRecorder(settings.run_directory(),
                                                settings.as_dict(self.options_class.run_config_defaults()))
        names = list(model.state_dict())
        self.initial_weights = [v.detach().cpu().numpy() for v in model.state_dict().values()]
        self.shared_indices = [i for i, name in enumerate(names) if self.options.shares(name)]
        self.shared_names = [names[i] for i in self.shared_indices]
        self.has_global_model = len(self.shared_indices) == len(names)
        self.discovery = PartitionDiscovery(settings.num_partitions, partition_sizes,
                                            settings.round_timeout or DISCOVERY_TIMEOUT, lambda p: self.privacy.seen(p))
        self.privacy = PrivacyAccounting(settings, self.options, names, num_classes, self.recorder, self.discovery)
        self.admission = Admission(settings, self.options, self.shared_weights(), num_classes, self.feature_dim,
                                   self.loss_metrics, self.discovery.known_sizes, self.check_update,
                                   self.upload_specs, self.parameter_spec, self.parameter_from_wire)
        self.evaluation = PersonalizedEvaluation(self.recorder, self.admission, self.predictor_names)
        self.checkpoints = RunCheckpoints(settings, self.recorder, client_state_dir,
                                          state_bytes if self.options.keeps_client_state else None)
        self.sampled: list[int] = []
        self.round_started = 0.0
        self.method_state = MethodState(self, self.state_fields)
        self.device = get_device()  # where server-side training runs (ServerRule.server_generator)

    stopped: str | None = None  # why the run stopped (RunStopped), once it has

    def run_rounds(self, rounds: Callable[[], None]) -> str:
        """The run: ``rounds()`` (a front's loop), then the results, the trackers and the summary,
        which it returns, also once a round stops the run (:class:`RunStopped`: one error line,
        no traceback, the reason in :attr:`stopped`)."""
        started = time.perf_counter()
        try:
            rounds()
        except RunStopped as stop:
            log(ERROR, "protofl: the run stopped. %s", stop)
            self.recorder.extra["stopped"] = self.stopped = str(stop)
        except BaseException:
            self.recorder.finish_tracking(crashed=True)
            raise
        self.recorder.extra["total_seconds"] = time.perf_counter() - started
        summary = summary_text(self.recorder.write(plot=True), self.recorder.directory)
        self.recorder.finish_tracking(failed="stopped" in self.recorder.extra)
        return summary

    # --- fit --------------------------------------------------------------------------------

    def initial_parameters(self) -> list[np.ndarray]:
        """The shared entries the first round sends (a model family whose architectures differ
        cannot share parameters: ``ValueError``)."""
        if (self.settings.model in MODEL_FAMILIES and self.shared_weights()
                and not self.options.shares_across_architectures):
            raise ValueError(f"model={self.settings.model!r} gives clients different architectures, but "
                             f"{self.settings.method} exchanges model parameters; use a single architecture, or a "
                             "method that shares none or only what every architecture has (fedsa, fedproto "
                             "without average-parameters, lgfedavg, fml, ...)")
        return self.shared_weights()

    def round_configs(
        self, server_round: int, partition_ids: Sequence[int], with_broadcast: bool = True
    ) -> list[dict[str, Scalar]]:
        """Per-client config: round, the client's seed, the broadcast arrays (encoded once) and its own.
        A non-finite array never goes out: the rule's output is checked after each round
        (:meth:`apply_rule`), and what is sent again here; should one still be, the run stops."""
        arrays = self.broadcast(server_round) if with_broadcast else {}
        shared = {k: encode_array(v) for k, v in arrays.items()}
        own = {p: self.broadcast_to(server_round, p) if with_broadcast else {} for p in partition_ids}
        sent = arrays | {f"{p}:{k}": v for p, entries in own.items() for k, v in entries.items()}
        if problem := output_problem(None, [], sent):
            raise RunStopped(f"round {server_round}: {problem}, so it is not sent")
        return [self.checkpoints.round_config(server_round, client_seed(self.settings.seed, server_round, p)) | shared
                | {k: encode_array(v) for k, v in own[p].items()} for p in partition_ids]

    def fit_instructions(
        self, server_round: int, nodes: Nodes, parameters: list[np.ndarray], parameters_bytes: int
    ) -> list[Instruction]:
        """The round's sample and each sampled node's config (``parameters``: what they train
        from, ``parameters_bytes`` of it on the wire)."""
        self.discovery.discover(nodes, self.checkpoints.round_config(server_round, 0))
        self.round_started = time.perf_counter()  # after discovery, which also starts the clients
        if lost_state := self.checkpoints.check_client_state(self.discovery.state_rounds()):
            raise RunStopped(lost_state)
        available = self.discovery.available(nodes)
        if not available:
            raise RunStopped(f"round {server_round}: no client reported a partition id; cannot sample clients. "
                             f"{self.discovery.unavailable_reason(nodes)}")
        s, holders = self.settings, self.discovery.nodes
        self.sampled = sample_partitions(available, s.fraction_fit, s.min_fit_clients, s.seed, server_round)
        self.admission.asked = {holders[p].cid: p for p in self.sampled}
        if parameters:
            self.admission.sent_parameters = self.parameters_from_wire(parameters)
        self.privacy.released(server_round, self.sampled)  # before anything goes out
        configs = self.round_configs(server_round, self.sampled)
        pending = self.evaluation.pending
        if pending is not None:  # score the previous round's model before training
            configs = [c | {EVALUATE_ROUND: pending} for c in configs]
        down = sum(parameters_bytes + payload_bytes(c) for c in configs)
        self.recorder.update(server_round, bytes_down=down, clients=self.sampled)
        log(INFO, "round %d: training partitions %s", server_round, self.sampled)
        return [(holders[p], c) for p, c in zip(self.sampled, configs)]

    def fit_results(
        self, server_round: int, results: list[tuple[Any, Any]], failures: list[str]
    ) -> tuple[list[np.ndarray] | None, dict[str, Scalar]]:
        """The round's fit replies admitted, screened and aggregated by the method's rule: (the new
        shared entries, or None to keep the previous ones; the round's metrics)."""
        failed = logged_failures(server_round, "train", failures, self.checkpoints)
        if self.evaluation.pending is not None:
            self.evaluation.record(self.evaluation.pending, results, in_fit=True)
            self.evaluation.pending = None
        self.checkpoints.trained(server_round, self.admission.partitions(results))
        updates, dropped = self.admission.replies(server_round, "fit", results, self.admission.fit_update)
        self.recorder.extra.setdefault("client_compute", {}).update(client_compute(updates, self.admission.asked))
        self.privacy.replied(server_round, [res for _, res in results], updates)  # DP releases, what went in clear
        updates, screened, ratios = self.admission.screen(server_round, updates)
        dropped += screened
        required = min(self.settings.min_fit_clients, len(self.sampled))
        if len(updates) < required:
            reasons = [d["reason"] for d in dropped]
            raise RunStopped(too_few_updates(server_round, len(updates), required, reasons, failed))
        updates.sort(key=lambda u: u.partition_id)  # arrival order must not change the float sums
        rule_started = time.perf_counter()
        new_parameters, kept_previous = self.apply_rule(server_round, updates)
        server_seconds = time.perf_counter() - rule_started  # the server rule's own training included
        elapsed = time.perf_counter() - self.round_started
        fields = fit_fields(updates, self.loss_metrics, results, failed, dropped)
        record = self.recorder.update(
            server_round, **fields,
            **({"kept_previous": kept_previous} if kept_previous else {}), fit_seconds=elapsed, seconds=elapsed,
            server_seconds=server_seconds,
            **ratios, **self.privacy.epsilon_field(),
        )
        self.recorder.write()
        if not self.settings.is_eval_round(server_round):
            log(INFO, "round %d: %s", server_round, progress_line(record))
        metrics = {TRAIN_LOSS: fields["train_loss"], "accepted": len(updates)}
        if kept_previous and self.shared_indices:
            return None, metrics
        return (new_parameters if new_parameters is not None else []), metrics

    # --- checkpoints ------------------------------------------------------------------------

    def server_state(self) -> dict[str, Any]:
        """What a resumed run needs besides the parameters and the results: the method's
        ``state_fields``, the fixed number of partitions, the DP releases, the round whose
        scores the next fit message asks for, the last round each partition trained."""
        return {
            "fields": self.method_state.checkpointed(),
            "num_partitions": self.discovery.registry.num_partitions or 0,
            "releases": self.privacy.state(),
            "pending_evaluation": self.evaluation.pending,
            "last_trained": self.checkpoints.state(),
        }

    def resume_from(self, checkpoint: Checkpoint) -> None:
        """Continue after ``checkpoint``'s round: its method state, partitions, results and run token."""
        state = checkpoint.strategy_state
        self.method_state.restore(state["fields"])
        self.discovery.registry.fixed = int(state["num_partitions"]) or None
        self.privacy.restore(state["releases"], checkpoint.server_round)  # (a run directory without dp-releases.json)
        self.evaluation.pending = state.get("pending_evaluation")
        self.admission.sent_parameters = self.parameters_from_wire(checkpoint.parameters)
        self.checkpoints.restore(checkpoint, state.get("last_trained"), self.options.keeps_client_state)
        log(INFO, "protofl: resuming %s after round %d", self.recorder.directory, checkpoint.server_round)

    # --- evaluation -------------------------------------------------------------------------

    def global_scores(self, server_round: int, parameters: list[np.ndarray]) -> tuple[float, dict[str, Scalar]] | None:
        """GM: the global model on the global test set (methods with a global model)."""
        if self.global_test is None or not parameters:
            return None
        if server_round > 0 and not self.settings.is_eval_round(server_round):
            return None
        weights = self.global_model_weights(self.parameters_from_wire(parameters))
        if weights is None:
            return None
        loss, accuracy = global_model_scores(self.model, weights, self.global_test,
                                             **self.settings.method_precision(self.options))
        if server_round > 0:
            self.recorder.update(
                server_round, global_accuracy=accuracy, global_loss=loss,
                seconds=time.perf_counter() - self.round_started,
            )
        return loss, {"global-accuracy": accuracy}

    def evaluate_instructions(self, server_round: int, nodes: Nodes) -> list[Instruction]:
        """The nodes that score the round's model and their configs (none when the next fit
        message carries the scores, or the round is not scored)."""
        if not self.settings.is_eval_round(server_round):
            return []
        if self.settings.evaluates_in_next_fit(server_round):
            self.evaluation.pending = server_round
            return []
        if self.settings.evaluate_clients == "all":
            chosen = self.discovery.available(nodes)
        else:
            chosen = self.sampled
        holders = self.discovery.nodes
        self.admission.asked = {holders[p].cid: p for p in chosen}
        configs = self.round_configs(server_round, chosen, self.broadcast_to_evaluate)
        return [(holders[p], c) for p, c in zip(chosen, configs)]

    def evaluate_results(
        self, server_round: int, results: list[tuple[Any, Any]], failures: list[str]
    ) -> tuple[float | None, dict[str, Scalar]]:
        """PM: each client's own model on its local test split, aggregated across clients."""
        self.privacy.observe("evaluate", [res for _, res in results])
        logged_failures(server_round, "evaluate", failures, self.checkpoints)
        return self.evaluation.record(server_round, results, started=self.round_started)


def _bytes_up(res: Any) -> int:
    try:
        return sum(len(t) for t in res.parameters.tensors) + payload_bytes(res.metrics)
    except Exception:  # a reply too malformed to measure counts nothing
        return 0
