"""Evaluation: the global model on the server's test set (GM), and the clients' scores of their own
models (PM) in either protocol (``evaluation-message``): carried by the next round's fit replies
(``EVALUATED`` metrics, the default), or by replies to a separate evaluate message. Both are
checked the same way, and their PM fields recorded in the round whose model was scored.
"""

from __future__ import annotations

import time
from logging import INFO
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from flwr.common.logger import log

from protofl.federation.admission import Admission
from protofl.federation.wire import (
    CORRECT,
    PARTITION_ID,
    PM_L,
    PM_V,
    PayloadError,
    Reply,
    checked_count,
    checked_loss,
    embedded_evaluation,
)
from protofl.report import RunRecorder, personalized_stats, progress_line
from protofl.typed_fields import is_int, is_number
from protofl.task.models import SplitModel
from protofl.task.capture import CudaGraphs
from protofl.task.inference import features_and_logits, head_loss_and_correct
from protofl.task.precision import Amp, ChannelsLast
from protofl.task.weights import set_weights


def global_model_scores(
    model: SplitModel, weights: list[np.ndarray], test: tuple[torch.Tensor, torch.Tensor], *, amp: Amp = "off",
    channels_last: ChannelsLast = False, cuda_graphs: CudaGraphs = "off",
) -> tuple[float, float]:
    """GM: (loss, accuracy) of ``model`` with ``weights`` on the global test set (``amp``,
    ``channels_last`` and ``cuda_graphs``: the run's, as the clients score)."""
    set_weights(model, weights)
    x, y = test
    _, logits = features_and_logits(model.to(x.device), x, amp=amp, channels_last=channels_last,
                                    cuda_graphs=cuda_graphs)
    loss, correct = head_loss_and_correct(logits, y)
    return loss, correct / len(y)


class PersonalizedEvaluation:
    """The clients' evaluations of a round's model, checked and recorded in that round; and the
    round whose scores the next fit message asks for (``pending``). ``predictor_names``: the
    predictors the method's clients may report (``correct-<name>``), each a field of the results."""

    def __init__(self, recorder: RunRecorder, admission: Admission, predictor_names: Sequence[str]) -> None:
        self.recorder, self.admission = recorder, admission
        self.reported_keys = {CORRECT} | {f"{CORRECT}-{name}" for name in predictor_names}
        self.pending: int | None = None  # the round the next fit message's clients score

    def checked(self, partition_id: int, res: Reply) -> tuple[int, Reply]:
        """An evaluation checked: its partition, its size (the partition's test size), a finite
        loss >= 0, counts of correct predictions within its size, of the method's predictors only,
        PM(L)/PM(V) in [0, 1]."""
        metrics: Mapping[str, Any] = dict(res.metrics)
        if metrics.get(PARTITION_ID, partition_id) != partition_id:
            raise PayloadError(f"partition-id {metrics.get(PARTITION_ID)!r} is not this node's ({partition_id})")
        checked_count(res.num_examples, "num_examples", 1)
        known = self.admission.known_sizes(partition_id)
        if known is not None and res.num_examples != known[1]:
            raise PayloadError(f"num_examples {res.num_examples} is not partition {partition_id}'s test size")
        checked_loss(res.loss, "loss")
        if CORRECT not in metrics:
            raise PayloadError(f"missing {CORRECT!r}")
        for key, value in metrics.items():
            if key.startswith(CORRECT) and key not in self.reported_keys:
                raise PayloadError(f"{key!r} names no predictor of this method")
            if key.startswith(CORRECT) and not (is_int(value) and 0 <= value <= res.num_examples):
                raise PayloadError(f"{key} must be an integer in [0, {res.num_examples}], got {value!r}")
            if key in (PM_L, PM_V) and not (is_number(value) and 0.0 <= value <= 1.0):
                raise PayloadError(f"{key} must be a number in [0, 1], got {value!r}")
        return partition_id, res

    def checked_embedded(self, partition_id: int, res: Reply) -> tuple[int, Reply]:
        """The evaluation a fit reply carries, checked as an evaluate reply."""
        return self.checked(partition_id, embedded_evaluation(res))

    def record(
        self, server_round: int, results: Sequence[tuple[Any, Reply]], in_fit: bool = False,
        started: float | None = None,
    ) -> tuple[float | None, dict[str, Any]]:
        """Check the evaluations of ``server_round``'s model, from evaluate replies or (``in_fit``)
        from the next round's fit replies, and record their PM fields in that round (with the
        round's ``seconds`` since ``started``, when given)."""
        parse = self.checked_embedded if in_fit else self.checked
        checked, dropped = self.admission.replies(server_round, "evaluate", results, parse)
        valid = [res for _, res in sorted(checked, key=lambda pair: pair[0])]  # arrival order must not change sums
        fields = personalized_fields(valid)
        totals = [res.num_examples for res in valid]
        loss = float(np.average([res.loss for res in valid], weights=totals)) if valid else None
        previous = self.recorder.rounds.get(server_round, {}).get("dropped") or []
        timing = {} if started is None else {"seconds": time.perf_counter() - started}
        record = self.recorder.update(
            server_round, personalized_loss=loss, **timing,
            **({"dropped": previous + dropped} if dropped else {}), **fields,
        )
        self.recorder.write()
        log(INFO, "round %d: %s", server_round, progress_line(record))
        return loss, {k: v for k, v in fields.items() if isinstance(v, float)}


def personalized_fields(results: Sequence[Reply]) -> dict[str, Any]:
    """PM fields of a round from valid evaluation results: sample-weighted accuracy and its
    across-client statistics, each predictor's accuracy, and FedNH's PM(L) / PM(V); each over
    the results that report it."""
    fields: dict[str, Any] = {}
    for key in sorted({k for res in results for k in res.metrics if k.startswith(CORRECT)}):
        reporting = [res for res in results if key in res.metrics]
        correct = [int(res.metrics[key]) for res in reporting]
        stats = personalized_stats(correct, [res.num_examples for res in reporting])
        suffix = key[len(CORRECT):].replace("-", "_")
        if suffix:
            fields[f"personalized_accuracy{suffix}"] = stats["accuracy"]
        else:
            fields.update(
                personalized_accuracy=stats["accuracy"],
                personalized_accuracy_mean=stats["mean"],
                personalized_std=stats["std"],
                personalized_min=stats["min"],
                personalized_worst10=stats["worst10"],
            )
    for key in (PM_L, PM_V):  # unweighted over clients, as the paper
        values = [float(res.metrics[key]) for res in results if key in res.metrics]
        if values:
            name = key.replace("-", "_")
            fields.update({name: float(np.mean(values)), f"{name}_std": float(np.std(values))})
    return fields
