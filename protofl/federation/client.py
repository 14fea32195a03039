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
``prototype_vectors``, ``local_statistics``, ``after_fit``, ``prepare_evaluation``,
``predictors``; the method's options ``prototype_pass`` and ``inference``, when it has them, choose
where class statistics come from and which predictor is reported. Helpers: ``load_shared``, ``restore_personal_model`` /
``store_personal_model`` (a model kept on the node across rounds), ``received`` /
``global_prototypes`` (decode what the server sent), ``record_loss`` (a loss part averaged into
the fit metrics).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common import Scalar

from protofl.federation.checkpoint import ClientStateStore
from protofl.federation.wire import (
    CORRECT,
    EVALUATE_ROUND,
    EVALUATED,
    GLOBAL_PROTOTYPES,
    NUM_PARTITIONS,
    NUM_TEST,
    NUM_TRAIN,
    PARTITION_ID,
    PM_L,
    PM_V,
    TRAIN_LOSS,
    ArraySpec,
    ClassStatistics,
    ClassVectors,
    checkpointed_round,
    decode_array,
    decode_class_vectors,
    round_seed,
    run_identity,
    server_round,
)
from protofl.report import class_weighted_accuracy
from protofl.settings import ExperimentSettings, MethodOptions
from protofl.task.augment import make_augment
from protofl.task.data import ClientData, black_level, load_global_test
from protofl.task.models import SplitModel
from protofl.task.privacy import privatize_class_means
from protofl.task.train import (
    FeatureSums,
    class_means,
    features_and_logits,
    head_loss_and_correct,
    head_prediction,
    recompute_batchnorm_stats,
    stale_batchnorm,
    steps_per_epoch,
    train,
)

MODEL_PREFIX = "model/"  # local_state names of the personal model's entries
# predict(features, logits) -> predicted labels
Predictor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PrototypeClient(NumPyClient):
    """NumPyClient holding one partition's data; a method overrides the hooks it needs."""

    options_class: type[MethodOptions] = MethodOptions

    def __init__(
        self,
        settings: ExperimentSettings,
        data: ClientData,
        model: SplitModel,
        num_partitions: int,
        store: ClientStateStore | Any,
    ) -> None:
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
        self.store = store if isinstance(store, ClientStateStore) else ClientStateStore(store, data.partition_id)
        self._local_state: dict[str, np.ndarray] | None = None  # read from the store when first used
        self._state_round: tuple[tuple[str, str], int | None] = (("", ""), None)  # (run, read before round)
        self.max_payload_bytes = int(settings.max_payload_mb * 2**20)
        self.shared_names = [name for name in self.model.state_dict() if self.options.shares(name)]
        self.loss_parts: dict[str, list[torch.Tensor]] = {}

    # --- hooks for methods --------------------------------------------------------------

    def receive(self, parameters: list[np.ndarray], config: Mapping[str, Scalar]) -> None:
        """Before training: set up the model to train from and read what the server sent
        (keep decoded arrays on ``self`` for ``batch_loss``). Default: load the shared entries."""
        self.load_shared(parameters)

    def batch_loss(self, features: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """The method's loss added to the cross-entropy of one training mini-batch; None: nothing."""
        return None

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
        return {
            PARTITION_ID: self.data.partition_id,
            NUM_PARTITIONS: self.num_partitions,
            NUM_TRAIN: self.data.num_train,
            NUM_TEST: self.data.num_test,
        }

    def get_parameters(self, config: dict[str, Scalar]) -> list[np.ndarray]:
        return self.shared_arrays()

    def fit(self, parameters: list[np.ndarray], config: dict[str, Scalar]):
        evaluated = self.evaluate_before_training(parameters, config) if EVALUATE_ROUND in config else {}
        self.loss_parts = {}
        self._use_state_of(config, server_round(config))  # as it was before this round
        self.receive(parameters, config)
        seen = self.prototype_collector()
        loss = train(
            self.model, self.data.train_x, self.data.train_y,
            extra_loss=self._extra_loss(seen), **self.train_kwargs(config),
        )
        if self.recompute_batchnorm():
            recompute_batchnorm_stats(self.model, self.data.train_x, round_seed(config, self.settings.seed))
        metrics: dict[str, Scalar] = {PARTITION_ID: self.data.partition_id, TRAIN_LOSS: float(loss)} | evaluated
        statistics = self.local_statistics(seen) if self.options.statistics is not None else None
        if statistics is not None and self.settings.dp_noise > 0:
            statistics = self.privatize(statistics)
        if statistics is not None:
            metrics |= statistics.to_metrics()
        metrics |= self.after_fit(statistics)
        metrics |= {key: float(torch.stack(values).mean()) for key, values in self.loss_parts.items() if values}
        if self._local_state:
            run, _ = self._state_round
            self.store.save(*run, server_round(config), self._local_state, checkpointed_round(config))
        return self.shared_arrays(), self.data.num_train, metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Scalar]):
        return self._scored(parameters, config, server_round(config) + 1)  # as this round's fit left it

    def _scored(
        self, parameters: list[np.ndarray], config: Mapping[str, Scalar], before: int
    ) -> tuple[float, int, dict[str, Scalar]]:
        """The model to score set up from the state saved before round ``before``, then scored."""
        self._use_state_of(config, before)
        self.prepare_evaluation(parameters, config)
        return self.score(self.predictors())

    def evaluate_before_training(self, parameters: list[np.ndarray], config: Mapping[str, Scalar]) -> dict[str, Scalar]:
        """What :meth:`evaluate` would have replied for the previous round, as ``EVALUATED`` fit
        metrics: the same state and model (the state before this round is the one the previous
        round's fit left), scored before training; the model is then put back as it was."""
        untouched = {name: tensor.clone() for name, tensor in self._all_model_tensors().items()}
        loss, num_examples, metrics = self._scored(parameters, config, server_round(config))
        with torch.no_grad():
            for name, tensor in self._all_model_tensors().items():
                tensor.copy_(untouched[name])
        return {EVALUATED + k: v for k, v in metrics.items()} | {
            f"{EVALUATED}loss": float(loss), f"{EVALUATED}num-examples": num_examples,
        }

    # --- helpers ------------------------------------------------------------------------

    def _all_model_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the model (also those not in ``state_dict``), by name."""
        return dict(self.model.named_buffers()) | self.model.state_dict(keep_vars=True)

    @property
    def local_state(self) -> dict[str, np.ndarray]:
        """Named arrays this client keeps for its partition across rounds (a personal model,
        FedSA's margin, ...): what it saved after its last fit before this round; saved again
        after this fit. Never sent."""
        if self._local_state is None:
            run, before = self._state_round
            self._local_state = self.store.load(*run, before)
        return self._local_state

    def _use_state_of(self, config: Mapping[str, Scalar], before: int) -> None:
        self._state_round = (run_identity(config), before)
        self._local_state = None

    def privatize(self, statistics: ClassStatistics) -> ClassStatistics:
        """Differentially private class vectors (``dp-clip``, ``dp-noise``): clipped, with Gaussian
        noise from the OS's entropy, never from the run seed, which the server knows."""
        s = self.settings
        rng = np.random.default_rng()
        means = privatize_class_means(statistics.means, statistics.counts, s.dp_clip, s.dp_noise, rng)
        return ClassStatistics(means, statistics.counts)

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
        for key, value in parts.items():
            self.loss_parts.setdefault(key, []).append(value.detach())

    def train_kwargs(self, config: Mapping[str, Scalar]) -> dict[str, Any]:
        s = self.settings
        return {
            "epochs": s.local_epochs,
            "batch_size": s.batch_size,
            "partial_batch": s.partial_batch,
            "lr": s.round_lr(server_round(config)),
            "momentum": s.momentum,
            "weight_decay": s.weight_decay,
            "max_grad_norm": s.max_grad_norm,
            "seed": round_seed(config, s.seed),
            "augment": self.augment,
            "amp": s.amp,
            "channels_last": s.channels_last,
        }

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, logits) of ``x`` in eval mode, with the run's ``amp`` and ``channels-last``."""
        return features_and_logits(self.model, x, amp=self.settings.amp, channels_last=self.settings.channels_last)

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

        if seen is None:
            return evaluated()
        prototypes = seen.means()
        missing = (self.data.class_counts() > 0) & (seen.counts.cpu().numpy() == 0)
        if missing.any():
            prototypes[missing] = evaluated()[missing]
        return prototypes

    def restore_personal_model(self) -> bool:
        """Load this client's persistent model from its :attr:`local_state`; False before it has one."""
        stored = {k[len(MODEL_PREFIX):]: v for k, v in self.local_state.items() if k.startswith(MODEL_PREFIX)}
        if not stored:
            return False
        self.model.load_state_dict({k: torch.from_numpy(stored[k]) for k in self.model.state_dict()})
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():  # also those not in state_dict (a frozen head)
                buffer.copy_(torch.from_numpy(stored[name]))
        return True

    def store_personal_model(self) -> None:
        """Keep the whole model (parameters and every buffer) in :attr:`local_state`."""
        tensors = self._all_model_tensors()
        self.local_state.update({MODEL_PREFIX + k: v.detach().cpu().numpy().copy() for k, v in tensors.items()})

    def score(self, predictors: Mapping[str, Predictor]) -> tuple[float, int, dict[str, Scalar]]:
        """Each predictor on the local test split (``correct-<name>`` when there are several), the
        reported one also as ``correct`` and on the global test set; the loss is the head's:
        (loss, num_test, metrics)."""
        inference = getattr(self.options, "inference", None)
        reported = inference if inference in predictors else next(iter(predictors))
        features, logits = self.forward(self.data.test_x)
        loss, _ = head_loss_and_correct(logits, self.data.test_y)
        y = self.data.test_y
        correct = {name: int((predict(features, logits) == y).sum()) for name, predict in predictors.items()}
        metrics: dict[str, Scalar] = {f"{CORRECT}-{name}": n for name, n in correct.items()} if len(correct) > 1 else {}
        metrics |= {CORRECT: correct[reported], PARTITION_ID: self.data.partition_id}
        if self.settings.global_test_pm:
            metrics |= self.global_test_scores(predictors[reported], features, logits)
        return loss, self.data.num_test, metrics

    def global_test_scores(
        self, predict: Predictor, test_features: torch.Tensor, test_logits: torch.Tensor
    ) -> dict[str, Scalar]:
        """FedNH's PM(L) and PM(V) of the current model on the (balanced) global test set.

        PM(L) weights each class by this client's share of it in training, PM(V) weights the
        classes it holds equally. With ``test-fraction=0`` the local test split is the global
        test set, scored once (``test_features``, ``test_logits``).
        """
        s = self.settings
        if s.test_fraction == 0:
            y, predicted = self.data.test_y, predict(test_features, test_logits)
        else:
            x, y = load_global_test(s.dataset, s.data_dir, str(self.device), s.global_test_pm_per_class,
                                    s.normalisation)
            predicted = predict(*self.forward(x))
        correct = torch.bincount(y[predicted == y], minlength=self.data.num_classes).cpu().numpy()
        tested = torch.bincount(y, minlength=self.data.num_classes).cpu().numpy()
        counts = self.data.class_counts()
        return {
            PM_L: class_weighted_accuracy(correct, tested, counts),
            PM_V: class_weighted_accuracy(correct, tested, counts > 0),
        }
