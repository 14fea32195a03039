"""A client's scores of its own model, as the evaluation metrics of the wire: every predictor on the
local test split (``correct-<name>`` when there are several), the reported one as ``correct``, and,
with ``global-test-pm``, FedNH's PM(L) and PM(V) on the global test set."""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from protofl.federation.wire import CORRECT, PARTITION_ID, PM_L, PM_V
from protofl.report import class_weighted_accuracy
from protofl.settings import ExperimentSettings
from protofl.typed_fields import Scalar
from protofl.task.data import ClientData, load_global_test
from protofl.task.inference import head_loss_and_correct

# predict(features, logits) -> predicted labels
Predictor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# x -> (features, logits) of the model being scored
Forward = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


def local_scores(
    forward: Forward, data: ClientData, predictors: Mapping[str, Predictor], reported: str,
    settings: ExperimentSettings,
) -> tuple[float, int, dict[str, Scalar]]:
    """Each predictor on the local test split, the ``reported`` one also as ``correct`` and on the
    global test set; the loss is the head's: (loss, num_test, metrics)."""
    features, logits = forward(data.test_x)
    loss, _ = head_loss_and_correct(logits, data.test_y)
    y = data.test_y
    correct = {name: int((predict(features, logits) == y).sum()) for name, predict in predictors.items()}
    metrics: dict[str, Scalar] = {f"{CORRECT}-{name}": n for name, n in correct.items()} if len(correct) > 1 else {}
    metrics |= {CORRECT: correct[reported], PARTITION_ID: data.partition_id}
    if settings.global_test_pm:
        metrics |= global_test_scores(forward, data, settings, predictors[reported], features, logits)
    return loss, data.num_test, metrics


def global_test_scores(
    forward: Forward, data: ClientData, settings: ExperimentSettings, predict: Predictor,
    test_features: torch.Tensor, test_logits: torch.Tensor,
) -> dict[str, Scalar]:
    """FedNH's PM(L) and PM(V) of the current model on the (balanced) global test set.

    PM(L) weights each class by this client's share of it in training, PM(V) weights the
    classes it holds equally. With ``test-fraction=0`` the local test split is the global
    test set, scored once (``test_features``, ``test_logits``).
    """
    s = settings
    if s.test_fraction == 0:
        y, predicted = data.test_y, predict(test_features, test_logits)
    else:
        x, y = load_global_test(s.dataset, s.data_dir, str(data.train_x.device), s.global_test_pm_per_class,
                                s.normalisation)
        predicted = predict(*forward(x))
    correct = torch.bincount(y[predicted == y], minlength=data.num_classes).cpu().numpy()
    tested = torch.bincount(y, minlength=data.num_classes).cpu().numpy()
    counts = data.class_counts()
    return {
        PM_L: class_weighted_accuracy(correct, tested, counts),
        PM_V: class_weighted_accuracy(correct, tested, counts > 0),
    }
