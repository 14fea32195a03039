"""CReFF (Shang et al., IJCAI 2022): FedAvg whose server re-trains the classifier on federated
features, synthetic features whose classifier gradients match the clients' real ones.

Client, each round, before training (Algorithm 1 of the paper): with the body received and the
server's classifier W_syn (broadcast), the gradient of the cross-entropy w.r.t. W_syn on a batch of
``real-batch`` of its samples of class c (features from the body in eval mode), averaged over
``gradient-repeats`` batches drawn without replacement from the round's seed, for each class c it
holds (Eq. 3): uploaded as ``class-gradients/<i>`` (C x the shape of W_syn's i-th parameter) with
the classes it holds (``gradient-classes``, booleans). Then it trains as FedAvg's client.

Server: FedAvg (``weighted = false``: unweighted, FedNH's code). The real gradient of class c is the
unweighted mean over the clients that hold it. The federated features (``features-per-class`` per
class, standard normal at the start, kept across rounds) take ``match-epochs`` SGD steps at
``feature-lr`` on sum_c D(grad of CE(W_syn f_c, c), real gradient of c) (Eq. 4-5; D: per output row
1 - cosine, FedNH's and CReFF's ``ours`` distance; a bias's gradient too, where the head has one,
which FedNH's code's heads have not), over the classes some client sent. A fresh
linear classifier (with bias, drawn from the round's server seed) then trains ``retrain-epochs``
epochs of mini-batches of ``batch-size`` on the features at ``classifier-lr`` (Eq. 6): it is the
next W_syn, and GM's head (its weight; its bias where the model's head has one).

GM: the aggregated body with the re-trained classifier. PM: as FedAvg's (the re-trained classifier
stays on the server). Defaults are FedNH's code's (its Table 1's CReFF): 100 features per class, 100
match epochs, 300 re-train epochs, both learning rates 0.01, real batches of 64, 10 repeats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protofl.federation.admission import ClientUpdate
from protofl.federation.client import PrototypeClient
from protofl.federation.wire import ArraySpec, indexed
from protofl.strategies.families.averaging import AveragingStrategy, GlobalModelAveraging
from protofl.strategies.families.model_parts import HEAD
from protofl.task.models import SplitModel
from protofl.task.server_training import one_cpu_thread, shuffles

CLASSIFIER = "creff-classifier"  # W_syn (broadcast), one array per head parameter
CLASS_GRADIENTS = "class-gradients"  # uploaded: C x (parameter shape), per head parameter
GRADIENT_CLASSES = "gradient-classes"  # uploaded: C booleans, the classes whose gradients it sent


@dataclass(frozen=True)
class CReFFOptions(GlobalModelAveraging):
    features_per_class: int = 100
    match_epochs: int = 100
    retrain_epochs: int = 300
    feature_lr: float = 0.01
    classifier_lr: float = 0.01
    real_batch: int = 64
    gradient_repeats: int = 10

    capturable: ClassVar[bool] = True  # FedAvg's step

    def check(self) -> None:
        for key in ("features_per_class", "real_batch", "gradient_repeats"):
            if getattr(self, key) < 1:
                raise ValueError(f"creff.{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        for key in ("match_epochs", "retrain_epochs"):
            if getattr(self, key) < 0:
                raise ValueError(f"creff.{key.replace('_', '-')} must be >= 0, got {getattr(self, key)}")
        for key in ("feature_lr", "classifier_lr"):
            if not getattr(self, key) > 0:  # also NaN
                raise ValueError(f"creff.{key.replace('_', '-')} must be > 0, got {getattr(self, key)}")


def linear_head(model: SplitModel) -> nn.Linear:
    if not isinstance(model.head, nn.Linear):
        raise ValueError(f"creff re-trains a linear classifier head; this model's head is {type(model.head).__name__}")
    return model.head


# --- the math ---------------------------------------------------------------------------------


def classifier_gradients(features: torch.Tensor, label: int, classifier: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradient of the mean cross-entropy of ``features`` (all of class ``label``) w.r.t. the
    linear classifier's parameters (weight, and bias if given)."""
    labels = torch.full((1, len(features)), label, dtype=torch.long, device=features.device)
    return [g[0] for g in per_class_gradients(features.unsqueeze(0), labels, classifier)]


def per_class_gradients(features: torch.Tensor, labels: torch.Tensor,
                        classifier: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """For each group g of ``features`` (G x m x d, ``labels`` G x m), the gradient of its mean
    cross-entropy w.r.t. the linear classifier (weight C x d, bias C if given), in closed form:
    (softmax - one-hot)^T f / m and the mean of softmax - one-hot. Differentiable in ``features``."""
    weight = classifier[0]
    logits = features @ weight.T + (classifier[1] if len(classifier) > 1 else 0)
    error = logits.softmax(-1) - F.one_hot(labels, weight.shape[0]).to(logits.dtype)  # G x m x C
    gradients = [error.transpose(1, 2) @ features / features.shape[1]]
    return gradients + ([error.mean(1)] if len(classifier) > 1 else [])


def gradient_distance(synthetic: Sequence[torch.Tensor], real: Sequence[torch.Tensor]) -> torch.Tensor:
    """D (FedNH's and CReFF's ``distance_wb``), for each leading index: per output row of each
    parameter's gradient, 1 - the cosine of the two (a bias: one row), summed; 1e-6 added to the
    norms' product."""
    total = 0
    for s, r in zip(synthetic, real):
        s, r = (s, r) if s.dim() > 2 else (s.unsqueeze(1), r.unsqueeze(1))  # a bias is one row
        total = total + (1 - (s * r).sum(-1) / (s.norm(dim=-1) * r.norm(dim=-1) + 1e-6)).sum(-1)
    return total


def match_features(features: torch.Tensor, classifier: Sequence[torch.Tensor], real: dict[int, list[torch.Tensor]],
                   epochs: int, lr: float) -> torch.Tensor:
    """Eq. 4-5: ``epochs`` SGD steps at ``lr`` of the federated features (C x m x d, class c's the
    c-th) on sum_c D(their gradient of class c, ``real[c]``), the classes of ``real`` only."""
    features = features.detach().clone()
    classes = sorted(real)
    if not classes or epochs == 0:
        return features
    index = torch.tensor(classes, device=features.device)
    targets = [torch.stack([real[c][i] for c in classes]) for i in range(len(classifier))]
    weights = [p.detach() for p in classifier]
    labels = index.unsqueeze(1).expand(-1, features.shape[1])
    for _ in range(epochs):
        matched = features[index].requires_grad_(True)
        loss = gradient_distance(per_class_gradients(matched, labels, weights), targets).sum()
        (gradient,) = torch.autograd.grad(loss, [matched])
        features[index] -= lr * gradient
    return features


def retrain_classifier(classifier: nn.Linear, features: torch.Tensor, epochs: int, lr: float, batch_size: int,
                       orders: Iterator[torch.Tensor]) -> nn.Linear:
    """Eq. 6: ``epochs`` epochs of SGD at ``lr`` of ``classifier`` with the cross-entropy of the
    federated features (C x m x d) and their classes, in mini-batches of ``batch_size`` (the last one
    smaller) taken in each epoch's order (``orders``: a permutation of the C m features each); the
    gradients in closed form (:func:`per_class_gradients`)."""
    num_classes, per_class, dim = features.shape
    inputs = features.reshape(-1, dim)
    labels = torch.arange(num_classes, device=features.device).repeat_interleave(per_class)
    parameters = [p for p in (classifier.weight, classifier.bias) if p is not None]
    with torch.no_grad(), one_cpu_thread():  # small steps: one thread (task/server_training.py)
        for _ in range(epochs):
            order = next(orders).to(features.device)
            for start in range(0, len(order), batch_size):
                batch = order[start:start + batch_size]
                gradients = per_class_gradients(inputs[batch].unsqueeze(0), labels[batch].unsqueeze(0), parameters)
                for parameter, gradient in zip(parameters, gradients):
                    parameter -= lr * gradient[0]
    return classifier


# --- server -----------------------------------------------------------------------------------


class CReFFStrategy(AveragingStrategy):
    options_class = CReFFOptions
    state_fields = ("federated_features", "classifier")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        head = linear_head(self.model)
        self.head_dtype = head.weight.detach().cpu().numpy().dtype
        self.head_entries = [i for i, name in enumerate(self.model.state_dict()) if name.startswith(HEAD)]
        with self.seeded(0):
            features = torch.randn(head.out_features, self.options.features_per_class, head.in_features,
                                   dtype=head.weight.dtype)
            initial = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None,
                                dtype=head.weight.dtype)
        self.federated_features = features.numpy()
        self.classifier = [p.detach().numpy() for p in initial.parameters()]  # W_syn

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return indexed(CLASSIFIER, self.classifier)

    def upload_specs(self) -> dict[str, ArraySpec]:
        C = self.num_classes
        specs = {name: ArraySpec((C, *p.shape), (p.dtype.name,))
                 for name, p in indexed(CLASS_GRADIENTS, self.classifier).items()}
        return specs | {GRADIENT_CLASSES: ArraySpec((C,), ("bool",), scale="bounded")}  # booleans: no magnitude

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        parameters = super().aggregate_updates(server_round, updates)
        names = list(indexed(CLASS_GRADIENTS, self.classifier))
        real = {}
        for c in range(self.num_classes):  # the unweighted mean over the clients that hold c
            holders = [u for u in updates if u.uploads[GRADIENT_CLASSES][c]]
            if holders:
                mean = self.average_arrays([[u.uploads[n][c] for n in names] for u in holders], [1.0] * len(holders))
                real[c] = [torch.from_numpy(g.astype(self.head_dtype)).to(self.device) for g in mean]
        o = self.options
        classifier = [torch.from_numpy(p).to(self.device) for p in self.classifier]
        features = torch.from_numpy(self.federated_features).to(self.device)
        features = match_features(features, classifier, real, o.match_epochs, o.feature_lr)
        num_classes, _, dim = features.shape
        with self.seeded(server_round):  # a fresh classifier each round, as FedNH's code
            retrained = nn.Linear(dim, num_classes, dtype=features.dtype).to(self.device)
        orders = shuffles(num_classes * o.features_per_class, self.server_generator(server_round))
        retrained = retrain_classifier(retrained, features, o.retrain_epochs, o.classifier_lr,
                                       self.settings.batch_size, orders)
        self.federated_features = features.cpu().numpy()
        self.classifier = [p.detach().cpu().numpy() for p in list(retrained.parameters())[:len(self.classifier)]]
        return parameters

    def global_model_weights(self, shared: list[np.ndarray]) -> list[np.ndarray] | None:
        weights = list(shared)
        for index, value in zip(self.head_entries, self.classifier):
            weights[index] = value
        return weights


# --- client -----------------------------------------------------------------------------------


class CReFFClient(PrototypeClient):
    options_class = CReFFOptions

    def receive(self, parameters, this_round):
        self.load_shared(parameters)
        head = linear_head(self.model)
        classifier = self.received_like(this_round, CLASSIFIER, [p for p in head.parameters()])
        if classifier is None:
            raise ValueError("CReFF: the server sent no classifier")
        self.real_gradients = self.class_gradients(classifier, this_round.seed)

    def class_gradients(self, classifier: list[torch.Tensor], seed: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Eq. 3: per class held, the mean over ``gradient-repeats`` batches of ``real-batch`` of its
        samples (without replacement) of their gradient w.r.t. ``classifier``; zeros elsewhere."""
        features, _ = self.forward(self.data.train_x)  # the body received, in eval mode
        features = features.to(classifier[0].dtype)
        generator = torch.Generator().manual_seed(seed)
        labels = self.data.train_y
        gradients = [torch.zeros((self.data.num_classes, *p.shape), dtype=p.dtype, device=p.device) for p in classifier]
        held = np.zeros(self.data.num_classes, bool)
        for c in range(self.data.num_classes):
            members = torch.nonzero(labels == c).flatten()
            if len(members) == 0:
                continue
            held[c] = True
            for _ in range(self.options.gradient_repeats):
                drawn = torch.randperm(len(members), generator=generator)[:self.options.real_batch]
                batch = members[drawn.to(members.device)]
                for total, g in zip(gradients, classifier_gradients(features[batch], c, classifier)):
                    total[c] += g / self.options.gradient_repeats
        return [g.cpu().numpy() for g in gradients], held

    def prepare_evaluation(self, parameters, this_round):
        self.load_shared(parameters)  # PM: as FedAvg's

    def uploads(self):
        gradients, held = self.real_gradients
        return indexed(CLASS_GRADIENTS, gradients) | {GRADIENT_CLASSES: held}


STRATEGY, CLIENT = CReFFStrategy, CReFFClient
