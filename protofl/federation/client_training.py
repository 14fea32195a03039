"""The client template's local training: each call of the training loop (:func:`protofl.task.train.train`)
on the client's training split, the loss it runs on every mini-batch (``classification_loss`` plus the
method's ``batch_loss``), what a captured step reads and adds to, and the class statistics collected
on the way.

:class:`LocalTraining` is the half of :class:`~protofl.federation.client.PrototypeClient` that a
method's ``local_training`` calls (``train_model``, once by default, or once per phase) and whose
loss hooks it overrides.
"""

from __future__ import annotations

from typing import Any, Hashable, Iterator, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from protofl.federation.client_round import ClientRound
from protofl.task.capture import DeviceMeans, StepState
from protofl.task.inference import features_and_logits
from protofl.task.models import seed_dropout
from protofl.task.precision import to_channels_last
from protofl.task.statistics import FeatureSums, class_means
from protofl.task.train import BatchLoss, batches, stale_batchnorm, steps_per_epoch, train


class LocalTraining:
    """Local training for a client (mixed into :class:`~protofl.federation.client.PrototypeClient`,
    whose ``settings``, ``options``, ``data``, ``model``, ``precision`` and ``augment`` it uses)."""

    seen: FeatureSums | None = None  # this fit's class statistics collected in training (prototype-pass)
    loss_parts: DeviceMeans

    # --- hooks for methods --------------------------------------------------------------

    def classification_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The task loss of one training mini-batch (FedRoD: a balanced softmax). Default: cross-entropy."""
        return F.cross_entropy(logits, labels)

    def batch_loss(self, features: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                   inputs: torch.Tensor) -> torch.Tensor | None:
        """The method's loss added to ``classification_loss`` on one training mini-batch; it may run
        the batch's ``inputs`` through reference models (:meth:`frozen_copy`). None: nothing."""
        return None

    def gradient_offsets(self) -> dict[str, torch.Tensor]:
        """Tensors added to the named parameters' gradients at every step (SCAFFOLD's c - c_i)."""
        return {}

    def step_constants(self) -> Hashable | None:
        """Values the step computes with beyond the options (a margin): a kept captured step serves
        equal ones (None: no). Default: ``()`` for a method without its own loss, else None."""
        plain = (type(self).batch_loss is LocalTraining.batch_loss
                 and type(self).classification_loss is LocalTraining.classification_loss)
        return () if plain else None

    def step_inputs(self) -> dict[str, torch.Tensor]:
        """The tensors ``batch_loss`` reads besides the model's (received prototypes), by name."""
        return {}

    def prototype_vectors(self, features: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The vectors whose per-class means are the class statistics (default: the features, or the
        logits with ``statistics = "logit"``)."""
        return logits if self.options.statistics == "logit" else features

    # --- helpers ------------------------------------------------------------------------

    def train_model(self, this_round: ClientRound, *, model: torch.nn.Module | None = None,
                    loss: BatchLoss | None = None, epochs: int | None = None, lr: float | None = None,
                    phase: str = "", clip_groups: list[list[torch.Tensor]] | None = None) -> float:
        """One call of the training loop on the training split, in ``this_round``: ``model``
        (default: the client's), its parameters with ``requires_grad`` only, with ``loss`` (default: for
        the client's model ``classification_loss`` + ``batch_loss``, collecting the class statistics of
        a ``prototype-pass`` in training; for another, cross-entropy) for ``epochs`` (default: the run's
        ``local-epochs``) at ``lr`` (default: the round's). ``phase`` names a call whose step differs
        from the method's others (FedRep's head and body), for a kept captured step. ``clip_groups``: the
        run's ``max-grad-norm`` clips each group of parameters on its own (FML's two models). Returns
        the mean training loss."""
        model = self.model if model is None else model
        kwargs = self.train_kwargs(this_round) | {"model": model}
        kwargs |= {"epochs": epochs} if epochs is not None else {}
        kwargs |= {"lr": lr} if lr is not None else {}
        kwargs |= {"clip_groups": clip_groups} if clip_groups is not None else {}
        offsets = self.gradient_offsets()
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        kwargs["gradient_offsets"] = [offsets.get(name) for name, _ in trainable] if offsets else None
        batch_loss = self.default_loss() if loss is None and model is self.model else loss
        # a loss of the caller's own or another model: what its step reads is not known, so no step is kept
        step_state = self.step_state(phase, offsets) if loss is None and model is self.model else None
        return train(x=self.data.train_x, y=self.data.train_y, loss=batch_loss, step_state=step_state, **kwargs)

    def training_batches(self, this_round: ClientRound, *, model: torch.nn.Module | None = None,
                         batch_size: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The (inputs, labels) of one local training in ``this_round`` (``batch_size``: default
        the run's), in the order and with the augmentation :meth:`train_model` draws from the round's
        seed; ``model`` (default: the client's) in training mode, its dropout seeded as there. For a
        method whose step is its own (pFedMe's inner loop, Per-FedAvg's two half-batches)."""
        model = self.model if model is None else model
        arguments = self.train_kwargs(this_round)
        generator = torch.Generator().manual_seed(arguments["seed"])
        # the memory format train's step runs in, whatever an eval pass left the model in
        channels_last = to_channels_last(model, self.data.train_x, arguments["channels_last"],
                                         arguments["cuda_graphs"])
        model.train()
        seed_dropout(model, generator)
        return batches(self.data.train_x, self.data.train_y, epochs=arguments["epochs"],
                       batch_size=batch_size or arguments["batch_size"], generator=generator,
                       partial_batch=arguments["partial_batch"], augment=self.augment, channels_last=channels_last)

    def default_loss(self) -> BatchLoss | None:
        """``classification_loss`` + ``batch_loss``, also collecting the class statistics of a
        ``prototype-pass`` in training; None when that is the plain cross-entropy."""
        own_loss = type(self).batch_loss is not LocalTraining.batch_loss
        plain = type(self).classification_loss is LocalTraining.classification_loss
        seen = self.seen
        if seen is None and not own_loss and plain:
            return None

        def loss(inputs: torch.Tensor, features: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor):
            if seen is not None:
                seen.add(self.prototype_vectors(features.detach(), logits.detach()), labels)
            total = self.classification_loss(logits, labels)
            extra = self.batch_loss(features, logits, labels, inputs) if own_loss else None
            return total if extra is None else total + extra

        return loss

    def step_state(self, phase: str = "", offsets: Mapping[str, torch.Tensor] | None = None) -> StepState | None:
        """What this client's training step reads and writes, for a captured step kept across
        clients (None: its method does not say, see :meth:`step_constants`)."""
        constants = self.step_constants()
        if constants is None:
            return None
        accumulators = [self.seen, self.loss_parts] if self.seen is not None else [self.loss_parts]
        inputs = self.step_inputs() | {f"gradient-offset/{name}": t for name, t in (offsets or {}).items()}
        return StepState((type(self), repr(self.settings), phase, constants), inputs, accumulators)

    def train_kwargs(self, this_round: ClientRound) -> dict[str, Any]:
        """The training loop's arguments in ``this_round``."""
        arguments = self.settings.train_arguments(this_round.number, this_round.seed, self.options)
        return arguments | self.precision | {"augment": self.augment}

    def record_loss(self, **parts: torch.Tensor) -> None:
        """Loss parts of one mini-batch; each one's mean over the batches is uploaded as a metric."""
        self.loss_parts.add(**parts)

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
