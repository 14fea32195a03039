"""The client template: a Flower ``NumPyClient`` that a method fills in with hooks.

``fit``: (when the config names an ``evaluate-round``: the previous round's evaluation first, as
``evaluate`` would have done it) -> ``receive`` (the model to train from, what the server sent) -> the one call to
:func:`protofl.task.train.train`, with ``batch_loss`` added to the cross-entropy of every
mini-batch -> BatchNorm statistics recomputed on the training split (``batchnorm-stats``) ->
``local_statistics`` (per-class means of ``prototype_vectors`` and the class counts,
when the method uploads them) -> ``after_fit`` (what to keep, extra metrics) -> the shared model
entries, the training size and the metrics go up.

``evaluate``: ``prepare_evaluation`` (default: ``receive``) -> each of ``predictors()`` scored on
the local test split (and, with ``global-test-pm``, on the global test set).

Hooks (see docs/adding-a-method.md): ``options_class``, ``receive``, ``batch_loss``,
``step_constants`` and ``step_inputs`` (what ``batch_loss`` computes from, for a captured step
that serves several clients), ``prototype_vectors``, ``local_statistics``, ``after_fit``, ``prepare_evaluation``,
``predictors``; the method's options ``prototype_pass`` and ``inference``, when it has them, choose
where class statistics come from and which predictor is reported. Helpers: ``load_shared``, ``restore_personal_model`` /
``store_personal_model`` (a model kept on the node across rounds), ``received`` /
``global_prototypes`` (decode what the server sent), ``record_loss`` (a loss part averaged into
the fit metrics).
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common import Scalar

from protofl.federation.client_state import MEMORY, ClientStateStore, LocalState
from protofl.federation.scoring import Predictor, local_scores
from protofl.federation.wire import (
    COMPUTE,
    EVALUATE_ROUND,
    GLOBAL_PROTOTYPES,
    NUM_PARTITIONS,
    NUM_TEST,
    NUM_TRAIN,
    PARTITION_ID,
    TRAIN_LOSS,
    ArraySpec,
    ClassStatistics,
    ClassVectors,
    decode_array,
    decode_class_vectors,
    encode_compute,
    evaluation_as_fit_metrics,
    round_seed,
    server_round,
)
from protofl.settings import ExperimentSettings, MethodOptions
from protofl.task.augment import make_augment
from protofl.task.capture import DeviceMeans, StepState
from protofl.task.data import ClientData, black_level
from protofl.task.models import SplitModel
from protofl.task.train import (
    FeatureSums,
    class_means,
    compute_description,
    features_and_logits,
    head_prediction,
    recompute_batchnorm_stats,
    stale_batchnorm,
    steps_per_epoch,
    train,
)
from protofl.task.weights import all_tensors, copy_tensors, load_all_tensors, tensor_copies

MODEL_PREFIX = "model/"  # local_state names of the personal model's entries


class PrototypeClient(NumPyClient):
    """NumPyClient holding one partition's data; a method overrides the hooks it needs."""

    options_class: type[MethodOptions] = MethodOptions

    def __init__(self, settings: ExperimentSettings, data: ClientData, model: SplitModel, num_partitions: int,
                 store: ClientStateStore | Any) -> None:
        """``store``: what this node keeps for its partition across rounds (a Flower
        ``context.state`` is kept in memory)."""
        self.settings = settings
        self.options = self.options_class.from_settings(settings)
        self.data = data
        self.device = data.train_x.device
        fill = torch.from_numpy(black_level(settings.dataset, settings.normalisation))
        self.augment = make_augment(settings.augment, fill.expand(data.in_channels))
        self.model = model.to(self.device)
        self.num_partitions = num_partitions
        store = store if isinstance(store, ClientStateStore) else ClientStateStore(store, data.partition_id, MEMORY)
        self.state = LocalState(store)
        self.max_payload_bytes = int(settings.max_payload_mb * 2**20)
        self.shared_names = [name for name in self.model.state_dict() if self.options.shares(name)]
        self.loss_parts = DeviceMeans()
        self.precision = settings.method_precision(self.options)  # of the training and eval passes

    # --- hooks for methods --------------------------------------------------------------

    def receive(self, parameters: list[np.ndarray], config: Mapping[str, Scalar]) -> None:
        """Before training: set up the model to train from and read what the server sent
        (keep decoded arrays on ``self`` for ``batch_loss``). Default: load the shared entries."""
        self.load_shared(parameters)

    def batch_loss(self, features: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """The method's loss added to the cross-entropy of one training mini-batch; None: nothing."""
        return None

    def step_constants(self) -> Hashable | None:
        """Values batch_loss uses beyond the options (a margin): a kept captured step serves equal ones (None: no)."""
        return () if type(self).batch_loss is PrototypeClient.batch_loss else None

    def step_inputs(self) -> dict[str, torch.Tensor]:  # tensors batch_loss reads besides the model's
        return {}

    def prototype_vectors(self, features: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The vectors whose per-class means are the class statistics (default: the features, or the
        logits with ``statistics = "logit"``)."""
        return logits if self.options.statistics == "logit" else features

    def local_statistics(self, seen: FeatureSums | None) -> ClassStatistics:
        """The class statistics uploaded after training."""
        return ClassStatistics(self.local_prototypes(seen), self.data.class_counts())

    def after_fit(self, statistics: ClassStatistics | None) -> dict[str, Scalar]:
        """After training (``statistics``: what goes up): keep what the node keeps; returns extra
        scalar metrics to upload."""
        return {}

    def prepare_evaluation(self, parameters: list[np.ndarray], config: Mapping[str, Scalar]) -> None:
        """Before scoring: set up the model to score (default: as for training)."""
        self.receive(parameters, config)

    def predictors(self) -> dict[str, Predictor]:
        """The rules that classify a test sample, by name: each is logged; the one the method's
        ``inference`` option names is reported (without that option, or when it is not among
        them, the first)."""
        return {"head": head_prediction}

    # --- Flower's NumPyClient API -------------------------------------------------------

    def get_properties(self, config: dict[str, Scalar]) -> dict[str, Scalar]:
        """This node's partition and sizes (and, asked with a run's identity, the state it holds)."""
        return {
            PARTITION_ID: self.data.partition_id,
            NUM_PARTITIONS: self.num_partitions,
            NUM_TRAIN: self.data.num_train,
            NUM_TEST: self.data.num_test,
        } | self.state.held(config)

    def get_parameters(self, config: dict[str, Scalar]) -> list[np.ndarray]:
        return self.shared_arrays()

    def fit(self, parameters: list[np.ndarray], config: dict[str, Scalar]):
        evaluated = self.evaluate_before_training(parameters, config) if EVALUATE_ROUND in config else {}
        self.loss_parts = DeviceMeans()
        self.state.use(config, server_round(config))  # as it was before this round
        self.receive(parameters, config)
        seen = self.prototype_collector()
        loss = train(self.model, self.data.train_x, self.data.train_y, extra_loss=self._extra_loss(seen),
                     step_state=step_state(self, seen), **self.train_kwargs(config))
        if self.recompute_batchnorm():  # in the eval pass's precision and memory format
            recompute_batchnorm_stats(self.model, self.data.train_x, round_seed(config, self.settings.seed),
                                      **self.precision)
        compute = {COMPUTE: encode_compute(compute_description(device=self.device, model=self.model, **self.precision))}
        metrics: dict[str, Scalar] = {PARTITION_ID: self.data.partition_id, TRAIN_LOSS: loss} | compute | evaluated
        statistics = self.local_statistics(seen) if self.options.statistics is not None else None
        if statistics is not None and self.settings.dp_noise > 0:
            statistics = statistics.privatized(self.settings.dp_clip, self.settings.dp_noise)
        if statistics is not None:
            metrics |= statistics.to_metrics()
        metrics |= self.after_fit(statistics)
        metrics |= self.loss_parts.means()
        self.state.save(config)
        return self.shared_arrays(), self.data.num_train, metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Scalar]):
        return self._scored(parameters, config, server_round(config) + 1)  # as this round's fit left it

    def _scored(
        self, parameters: list[np.ndarray], config: Mapping[str, Scalar], before: int
    ) -> tuple[float, int, dict[str, Scalar]]:
        """The model to score set up from the state saved before round ``before``, then scored."""
        self.state.use(config, before)
        self.prepare_evaluation(parameters, config)
        return self.score(self.predictors())

    def evaluate_before_training(self, parameters: list[np.ndarray], config: Mapping[str, Scalar]) -> dict[str, Scalar]:
        """What :meth:`evaluate` would have replied for the previous round, as ``EVALUATED`` fit
        metrics: the same state and model (the state before this round is the one the previous
        round's fit left), scored before training; the model is then put back as it was."""
        untouched = tensor_copies(self.model)
        loss, num_examples, metrics = self._scored(parameters, config, server_round(config))
        copy_tensors(all_tensors(self.model), untouched)
        return evaluation_as_fit_metrics(loss, num_examples, metrics)

    # --- helpers ------------------------------------------------------------------------

    @property
    def local_state(self) -> dict[str, np.ndarray]:
        """Named arrays kept for this partition across rounds (a personal model, FedSA's margin): as
        its last fit before this round saved them; saved again after this fit. Never sent."""
        return self.state.arrays

    def shared_arrays(self) -> list[np.ndarray]:
        """The model entries this method exchanges, in ``state_dict`` order: all the server may see."""
        state = self.model.state_dict()
        return [state[name].detach().cpu().numpy() for name in self.shared_names]

    def load_shared(self, arrays: list[np.ndarray]) -> None:
        """Load the shared entries (the others keep their values)."""
        if len(arrays) != len(self.shared_names):
            raise ValueError(f"got {len(arrays)} arrays, this method shares {len(self.shared_names)} model entries")
        state = self.model.state_dict()
        loaded = {name: torch.as_tensor(np.asarray(a), dtype=state[name].dtype)
                  for name, a in zip(self.shared_names, arrays)}
        self.model.load_state_dict(loaded, strict=False)

    def received(self, config: Mapping[str, Scalar], key: str, spec: ArraySpec) -> np.ndarray | None:
        """A broadcast array from the server config, validated; None when not sent."""
        if key not in config:
            return None
        return decode_array(config[key], spec, self.max_payload_bytes)

    def received_class_vectors(self, config: Mapping[str, Scalar], name: str) -> np.ndarray | None:
        """A C x d array of the server's config (anchors, prototypes); None when not sent."""
        return decode_class_vectors(config, name, self.data.num_classes, self.model.feature_dim, self.max_payload_bytes)

    def received_masked_vectors(
        self, config: Mapping[str, Scalar], name: str, dim: int | None = None
    ) -> ClassVectors | None:
        """Class vectors (``dim``: the feature size unless given) and their mask; None when not sent."""
        dim = dim or self.model.feature_dim
        return ClassVectors.from_config(config, name, self.data.num_classes, dim, self.max_payload_bytes)

    def global_prototypes(self, config: Mapping[str, Scalar]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The server's (C x d prototypes, C mask of classes that have one) on this client's
        device; None before the server has any."""
        received = self.received_masked_vectors(config, GLOBAL_PROTOTYPES)
        if received is None:
            return None
        return torch.from_numpy(received.vectors).to(self.device), torch.from_numpy(received.mask).to(self.device)

    def record_loss(self, **parts: torch.Tensor) -> None:
        """Loss parts of one mini-batch; each one's mean over the batches is uploaded as a metric."""
        self.loss_parts.add(**parts)

    def train_kwargs(self, config: Mapping[str, Scalar]) -> dict[str, Any]:
        """The training loop's arguments in ``config``'s round."""
        seed = round_seed(config, self.settings.seed)
        arguments = self.settings.train_arguments(server_round(config), seed, self.options)
        return arguments | self.precision | {"augment": self.augment}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, logits) of ``x`` in eval mode, with the run's ``amp`` and ``channels-last``."""
        return features_and_logits(self.model, x, **self.precision)

    def recompute_batchnorm(self) -> bool:
        """Whether the BatchNorm statistics are recomputed after local training (``batchnorm-stats``)."""
        mode = self.settings.batchnorm_stats
        steps = self.settings.local_epochs * self.steps_per_epoch()
        return mode == "recompute" or (mode == "auto" and stale_batchnorm(self.model, steps))

    def steps_per_epoch(self) -> int:
        """Optimiser steps of one local epoch."""
        return steps_per_epoch(self.data.num_train, self.settings.batch_size, self.settings.partial_batch)

    def _extra_loss(self, seen: FeatureSums | None):
        has_loss = type(self).batch_loss is not PrototypeClient.batch_loss
        if seen is None and not has_loss:
            return None

        def extra_loss(features, logits, labels):
            if seen is not None:
                seen.add(self.prototype_vectors(features.detach(), logits.detach()), labels)
            return self.batch_loss(features, logits, labels) if has_loss else None

        return extra_loss

    def prototype_collector(self) -> FeatureSums | None:
        """What collects the training-mode prototype vectors when the method's ``prototype-pass``
        option is ``during-train`` (every epoch) or ``last-epoch``; None for ``post-eval`` (an eval
        pass after training) and for methods without that option."""
        prototype_pass = getattr(self.options, "prototype_pass", "post-eval")
        if self.options.statistics is None or prototype_pass == "post-eval":
            return None
        skip = 0
        if prototype_pass == "last-epoch":
            skip = (self.settings.local_epochs - 1) * self.steps_per_epoch()
        dim = self.options.statistics_dim(self.data.num_classes, self.model.feature_dim)
        return FeatureSums(self.data.num_classes, dim, self.device, skip)

    def local_prototypes(self, seen: FeatureSums | None = None) -> np.ndarray:
        """Per-class means over the training split of ``prototype_vectors``: of the training-mode
        vectors ``seen`` during local training, else of an eval pass after it. The eval pass also
        fills a class whose samples all fell in a skipped one-sample batch."""

        def evaluated() -> np.ndarray:
            vectors = self.prototype_vectors(*self.forward(self.data.train_x))
            return class_means(vectors, self.data.train_y, self.data.num_classes)[0]

        return evaluated() if seen is None else seen.means_filled(self.data.class_counts() > 0, evaluated)

    def restore_personal_model(self) -> bool:
        """Load this client's persistent model from its :attr:`local_state`; False before it has one."""
        stored = {k[len(MODEL_PREFIX):]: v for k, v in self.local_state.items() if k.startswith(MODEL_PREFIX)}
        if stored:
            load_all_tensors(self.model, stored)
        return bool(stored)

    def store_personal_model(self) -> None:
        """Keep the whole model (parameters and every buffer) in :attr:`local_state`."""
        tensors = all_tensors(self.model)
        self.local_state.update({MODEL_PREFIX + k: v.detach().to("cpu", copy=True).numpy() for k, v in tensors.items()})

    def score(self, predictors: Mapping[str, Predictor]) -> tuple[float, int, dict[str, Scalar]]:
        """(loss, num_test, metrics) of :func:`~protofl.federation.scoring.local_scores`, reporting
        the predictor the method's ``inference`` option names (without it, or when it is not among
        them, the first)."""
        inference = getattr(self.options, "inference", None)
        reported = inference if inference in predictors else next(iter(predictors))
        return local_scores(self.forward, self.data, predictors, reported, self.settings)


def step_state(client: PrototypeClient, seen: FeatureSums | None) -> StepState | None:
    """What ``client``'s training step reads and writes, for a captured step kept across clients
    (None: its method does not say, see :meth:`PrototypeClient.step_constants`)."""
    constants = client.step_constants()
    if constants is None:
        return None
    accumulators = [seen, client.loss_parts] if seen is not None else [client.loss_parts]
    return StepState((type(client), repr(client.settings), constants), client.step_inputs(), accumulators)
