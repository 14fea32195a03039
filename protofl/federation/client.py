"""The client template, which a method fills in with hooks; Flower's calls reach it through a front
(:class:`~protofl.federation.numpy_front.NumPyFront`, Flower's ``NumPyClient``).

``fit``: (when the config names an ``evaluate-round``: the previous round's evaluation first, as
``evaluate`` would have done it) -> the kept model restored (a method whose ``keeps_model`` is
``"trains"``) -> ``receive`` (the model to train from, what the server sent) -> ``local_training``
(default: one call of :func:`protofl.task.train.train` through ``train_model``, with
``classification_loss`` + ``batch_loss`` on every mini-batch) -> BatchNorm statistics recomputed on
the training split (``batchnorm-stats``) -> ``local_statistics`` (per-class means of
``prototype_vectors`` and the class counts, when the method uploads them) -> ``after_fit`` (what to
keep, extra metrics) -> the model kept (``keeps_model``) -> the shared model entries, the training
size, the metrics and the method's ``uploads`` go up (the entries as ``uploaded_parameters`` gives them).

``evaluate``: the model to score -> each of ``predictors()`` scored on the local test split (and,
with ``global-test-pm``, on the global test set). The model: with ``keeps_model = "trains"``, the
kept model restored, then ``prepare_evaluation`` (default ``receive``: the shared entries loaded
over it); with ``"scores"``, the kept model, or ``prepare_evaluation``'s before there is one;
otherwise ``prepare_evaluation``'s.

The hooks and helpers of training live in :mod:`protofl.federation.client_training`, those of the
model and the broadcasts in :mod:`protofl.federation.client_exchange`; docs/adding-a-method.md
lists them all.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from protofl.federation.client_exchange import ModelExchange
from protofl.federation.client_round import ClientRound
from protofl.federation.client_state import MEMORY, ClientStateStore, LocalState
from protofl.federation.client_training import LocalTraining
from protofl.federation.scoring import Predictor, local_scores
from protofl.federation.wire import (
    COMPUTE,
    EVALUATE_ROUND,
    NUM_PARTITIONS,
    NUM_TEST,
    NUM_TRAIN,
    PARTITION_ID,
    TRAIN_LOSS,
    ClassStatistics,
    encode_array,
    encode_compute,
    evaluation_as_fit_metrics,
    round_seed,
    server_round,
)
from protofl.settings import ExperimentSettings, MethodOptions
from protofl.task.augment import make_augment
from protofl.task.capture import DeviceMeans
from protofl.task.data import ClientData, black_level
from protofl.task.inference import head_prediction
from protofl.task.models import SplitModel
from protofl.task.precision import compute_description
from protofl.task.sampling import client_seed
from protofl.task.statistics import FeatureSums
from protofl.task.train import recompute_batchnorm_stats
from protofl.task.weights import all_tensors, copy_tensors, tensor_copies
from protofl.typed_fields import Scalar


class PrototypeClient(LocalTraining, ModelExchange):
    """The client of one partition: its data, its model, the round's flow; a method overrides the
    hooks it needs. Flower's calls reach it through a front (the legacy one:
    :class:`~protofl.federation.numpy_front.NumPyFront`), which it does not derive from."""

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
        self.exchanged = self.exchanged_model()
        self.shared_names = [name for name in self.exchanged.state_dict() if self.options.shares(name)]
        self.loss_parts = DeviceMeans()
        self.precision = settings.method_precision(self.options)  # of the training and eval passes
        self.has_personal_model = False  # a kept model was restored for this message (keeps_model)

    # --- hooks for methods --------------------------------------------------------------

    def receive(self, parameters: list[np.ndarray], this_round: ClientRound) -> None:
        """Before training: set up the model to train from and read what the server sent
        (keep decoded arrays on ``self`` for ``batch_loss``). Default: load the shared entries."""
        self.load_shared(parameters)

    def exchanged_model(self) -> SplitModel:
        """The model whose entries (those the options' ``shares`` names) travel as parameters, built
        once. Default: the client's own; FML's and FedKD's: a second model, of one architecture on
        every client, trained beside the client's own."""
        return self.model

    def local_training(self, this_round: ClientRound) -> float:
        """This round's local training; returns its mean training loss. Default: one
        :meth:`train_model` of the model, as the run config says. A method may train in phases
        (the head, then the body), or a second model beside the first."""
        return self.train_model(this_round)

    def local_statistics(self, seen: FeatureSums | None) -> ClassStatistics:
        """The class statistics uploaded after training."""
        return ClassStatistics(self.local_prototypes(seen), self.data.class_counts())

    def after_fit(self, statistics: ClassStatistics | None) -> dict[str, Scalar]:
        """After training (``statistics``: what goes up): keep what the node keeps; returns extra
        scalar metrics to upload."""
        return {}

    def uploads(self) -> dict[str, np.ndarray]:
        """Named arrays uploaded after training beside the shared entries and class statistics
        (SCAFFOLD's control-variate deltas): exactly the names of the strategy's ``upload_specs``."""
        return {}

    def uploaded_parameters(self) -> list[np.ndarray]:
        """The shared entries as they go up after training, each in a form the strategy's
        ``parameter_from_wire`` reads (default: as they are; FedKD's: its matrices as factors)."""
        return self.shared_arrays()

    def prepare_evaluation(self, parameters: list[np.ndarray], this_round: ClientRound) -> None:
        """Before scoring a model this client does not keep: set up the model to score (default: as
        for training)."""
        self.receive(parameters, this_round)

    def predictors(self) -> dict[str, Predictor]:
        """The rules that classify a test sample, by name: each is logged; the one the method's
        ``inference`` option names is reported (without that option, or when it is not among
        them, the first)."""
        return {"head": head_prediction}

    # --- the calls of a front (Flower's NumPyClient's) -------------------------------------

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

    def round_of(self, config: Mapping[str, Scalar]) -> ClientRound:
        """The typed round a message's config asks for, decoded once: what the method's hooks read."""
        number = server_round(config)
        return ClientRound(number, round_seed(config, self.settings.seed), self.settings.round_lr(number),
                           {key: value for key, value in config.items() if isinstance(value, bytes)},
                           int(config[EVALUATE_ROUND]) if EVALUATE_ROUND in config else None)

    def fit(self, parameters: list[np.ndarray], config: dict[str, Scalar]):
        this_round = self.round_of(config)
        evaluated = ({} if this_round.evaluates is None
                     else self.evaluate_before_training(parameters, config, this_round))
        self.loss_parts = DeviceMeans()
        if this_round.evaluates is None or not self.scoring_sets_up_training:
            self.state.use(config, this_round.number)  # as it was before this round
            self.has_personal_model = self.options.keeps_model == "trains" and self.restore_personal_model()
            self.receive(parameters, this_round)
        self.seen = self.prototype_collector()
        loss = self.local_training(this_round)
        recompute = self.recompute_batchnorm()
        if recompute:  # in the eval pass's precision and memory format
            recompute_batchnorm_stats(self.model, self.data.train_x, this_round.seed, **self.precision)
        described = compute_description(device=self.device, model=self.model, **self.precision)
        described["batchnorm_stats"] = "recompute" if recompute else "running"
        compute = {COMPUTE: encode_compute(described)}
        metrics: dict[str, Scalar] = {PARTITION_ID: self.data.partition_id, TRAIN_LOSS: loss} | compute | evaluated
        statistics = self.local_statistics(self.seen) if self.options.statistics is not None else None
        if statistics is not None and self.settings.dp_noise > 0:
            statistics = statistics.privatized(self.settings.dp_clip, self.settings.dp_noise)
        if statistics is not None:
            metrics |= statistics.to_metrics()
        metrics |= self.after_fit(statistics)
        if self.options.keeps_model is not None:
            self.store_personal_model()
        metrics |= {name: encode_array(array) for name, array in self.uploads().items()}
        metrics |= self.loss_parts.means()
        self.state.save(config)
        return self.uploaded_parameters(), self.data.num_train, metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Scalar]):
        this_round = self.round_of(config)
        return self._scored(parameters, config, this_round, this_round.number + 1)  # as this round's fit left it

    def _scored(
        self, parameters: list[np.ndarray], config: Mapping[str, Scalar], this_round: ClientRound, before: int
    ) -> tuple[float, int, dict[str, Scalar]]:
        """The model to score set up from the state saved before round ``before`` (see the module's
        docstring), then scored."""
        self.state.use(config, before)
        keeps = self.options.keeps_model
        self.has_personal_model = keeps in ("trains", "scores") and self.restore_personal_model()
        if keeps == "trains" or not self.has_personal_model:
            self.prepare_evaluation(parameters, this_round)
        return self.score(self.predictors())

    def evaluate_before_training(
        self, parameters: list[np.ndarray], config: Mapping[str, Scalar], this_round: ClientRound
    ) -> dict[str, Scalar]:
        """What :meth:`evaluate` would have replied for the previous round, as ``EVALUATED`` fit
        metrics: the same state and model (the state before this round is the one the previous
        round's fit left), scored before training. When that model is the one training starts from
        (:attr:`scoring_sets_up_training`), training goes on from it; otherwise it is put back as it
        was."""
        untouched = None if self.scoring_sets_up_training else tensor_copies(self.model)
        loss, num_examples, metrics = self._scored(parameters, config, this_round, this_round.number)
        if untouched is not None:
            copy_tensors(all_tensors(self.model), untouched)
        return evaluation_as_fit_metrics(loss, num_examples, metrics)

    @property
    def scoring_sets_up_training(self) -> bool:
        """Whether the model scored before training is the one ``fit`` trains from: the method sets
        up scoring as training (``prepare_evaluation`` is ``receive``), from the same saved state,
        and keeps no model (both load the shared entries over the initial one) or trains its kept one
        (both restore it first). Then a fit message that carries the previous round's evaluation runs
        ``receive`` once, and copies no model tensor out and back."""
        return (type(self).prepare_evaluation is PrototypeClient.prepare_evaluation
                and self.options.keeps_model in (None, "trains"))

    def scored_round(self, this_round: ClientRound) -> ClientRound:
        """``this_round`` as the evaluate message of the round being scored carries it (that round,
        this client's seed and the learning rate in it), also when the scores ride in the next
        round's fit message: what a ``prepare_evaluation`` that trains (FedBABU's fine-tuning) trains
        with, so that both messages give the same scores."""
        if this_round.evaluates is None:
            return this_round
        scored = this_round.evaluates
        return this_round.as_scored(client_seed(self.settings.seed, scored, self.data.partition_id),
                                    self.settings.round_lr(scored))

    def score(self, predictors: Mapping[str, Predictor]) -> tuple[float, int, dict[str, Scalar]]:
        """(loss, num_test, metrics) of :func:`~protofl.federation.scoring.local_scores`, reporting
        the predictor the method's ``inference`` option names (without it, or when it is not among
        them, the first)."""
        inference = getattr(self.options, "inference", None)
        reported = inference if inference in predictors else next(iter(predictors))
        return local_scores(self.forward, self.data, predictors, reported, self.settings)
