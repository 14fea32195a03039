"""FedSKC (Wang et al., ICWS 2025): structural knowledge collaboration. Equation numbers are the
paper's; defaults follow the paper, the released code's behaviour is a switch where it differs
(spec ``fedsc_fedskc.md`` §3.9).

Knowledge: per class, the mean logits of a client's training samples through SiLU,
c <- c * sigmoid(c) (``silu = false``: raw mean logits, as the code), from an eval pass after
training (``prototype-pass = "last-epoch"``: the last epoch's training logits, as the code).

Client: round 1 (no global knowledge yet) trains with CE only; later rounds with CE + LCL (Eq. 2-3):
cross-entropy of each sample's similarities to the C global knowledge vectors (its own class the
one positive, classes without knowledge left out, temperature 0.08), similarity
cos(l, c) / U(c) with U(c) the batch's mean distance to c (``similarity-norm = "none"``: plain
cosine, as the code); ``lcl-form = "code"``: the code's LCL, plain cosine, the positive counted twice
in the denominator and a sample whose class has no knowledge its own positive; ``lcl-warmup-rounds = 100``
scales LCL by min(r / 100, 1), as the code. Uploads: parameters, the C x C knowledge, the class counts.

Server, each round:
1. global knowledge (Eq. 1): per class, each holder's vector merged with its M = 1 nearest (L2)
   other holder, then averaged over the holders;
2. GDA (Eq. 4): d_k = sum over k's classes of ||c_k^j - global^j||, parameters averaged with
   weights sigmoid(N_k - a_k d_k + b_k), normalised (``gda-mode = "paper"``: with raw sample counts
   every sigmoid is 1.0, i.e. uniform weights); ``"normalized"``: sigmoid(N_k / sum N - d_k / sum d);
   ``"fedavg"`` (or ``use-gda = false``): weights N_k (what the code uses: it computes GDA, then
   overwrites it with FedAvg);
3. GPR (Eq. 5): with rho = relative change of the summed per-class variance of the global knowledge
   since the last round (over the classes present in both rounds; ``gpr-classes = "each-round"``:
   each sum over its own round's classes, as the code), w <- beta w + (1 - beta) rho (w_prev - w)
   (``gpr-form = "paper"``; the code's form, with beta 0.99) or w <- w + (1 - beta) rho (w_prev - w)
   (``"interp"``), on every floating state entry, BatchNorm running statistics too, as the code
   (``gpr-entries = "trainable"``: the trainable parameters only, the statistics carried from step 2;
   in eval mode a BatchNorm layer whose weights shrank but whose statistics did not is off by
   (1 - beta) mu / sigma, and benchmarks/gpr_shrink.py measured more changed predictions that way);
   skipped while there is no previous knowledge.
Ablations (Table V): ``use-lcl``, ``use-gda``, ``use-gpr``. tests/test_conformance_fedskc.py checks
the code's switches against numbers the authors' code computed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F

from protofl.federation.admission import ClientUpdate, stacked_statistics
from protofl.federation.client import PrototypeClient
from protofl.federation.server_rule import ServerRule
from protofl.federation.wire import ClassStatistics, ClassVectors
from protofl.settings import MethodOptions
from protofl.task.prototypes import SimilarityNorm, multi_positive_infonce, neighbour_merge, sigmoid_discrepancy_weights
from protofl.task.robust import RobustRule, robust_mean
from protofl.task.statistics import PostOrLastEpochPass

GLOBAL_KNOWLEDGE = "global-knowledge"  # ClassVectors, C x C, in the fit config only
LCL_LOSS = "lcl-loss"
LclForm = Literal["paper", "code"]
LOGGER = logging.getLogger("flwr")  # Flower's console logger, by name: a method file imports no Flower
# the classes whose knowledge variance GPR's rho sums: those present in both rounds, or each round's own
VarianceClasses = Literal["both-rounds", "each-round"]


@dataclass(frozen=True)
class FedSKCOptions(MethodOptions):
    statistics: ClassVar[Literal["logit"]] = "logit"  # knowledge: per-class mean logits
    use_lcl: bool = True
    use_gda: bool = True
    use_gpr: bool = True
    lambda_lcl: float = 1.0
    temperature: float = 0.08
    similarity_norm: SimilarityNorm = "mean-distance"
    lcl_warmup_rounds: int = 0
    silu: bool = True
    neighbours: int = 1  # M
    lcl_form: LclForm = "paper"
    gda_mode: Literal["paper", "normalized", "fedavg"] = "paper"
    gpr_form: Literal["paper", "interp"] = "paper"
    beta: float = 0.95
    gpr_clip: bool = False  # clip rho to [-1, 1] (not in the paper)
    gpr_entries: Literal["all", "trainable"] = "all"
    gpr_classes: VarianceClasses = "both-rounds"
    prototype_pass: PostOrLastEpochPass = "post-eval"

    @property
    def capturable(self) -> bool:
        return self.lcl_form == "code"  # the paper's form leaves out samples without knowledge (a sync)

    def check(self) -> None:
        if self.temperature <= 0 or self.neighbours < 0 or self.lambda_lcl < 0:
            raise ValueError("fedskc: temperature must be > 0, neighbours and lambda-lcl >= 0")
        if not 0.0 <= self.beta <= 1.0 or self.lcl_warmup_rounds < 0:
            raise ValueError("fedskc: beta must be in [0, 1] and lcl-warmup-rounds >= 0")


# --- server math ------------------------------------------------------------------------


def global_knowledge(
    knowledge: np.ndarray, held: np.ndarray, neighbours: int = 1, rule: RobustRule = "method",
    trim_fraction: float = 0.2,
) -> tuple[np.ndarray, np.ndarray]:
    """K x C x C client knowledge -> (C x C global knowledge, C mask of classes someone holds):
    per class, each holder's vector merged with its nearest ``neighbours`` holders (L2), then the
    mean over the holders (Eq. 1), or another robust ``rule`` over them."""
    merged = np.zeros(knowledge.shape[1:], dtype=np.float32)
    mask = held.any(axis=0)
    for c in np.flatnonzero(mask):
        vectors = neighbour_merge(knowledge[held[:, c], c], neighbours, "l2")
        if rule == "method":
            merged[c] = vectors.mean(axis=0)
        else:
            merged[c] = robust_mean(vectors, np.ones(len(vectors)), rule, trim_fraction)
    return merged, mask


def knowledge_discrepancy(knowledge: np.ndarray, held: np.ndarray, global_vectors: np.ndarray) -> np.ndarray:
    """d_k = sum over the classes client k holds of ||c_k^j - global^j||_2 (Eq. 4)."""
    distances = np.linalg.norm(knowledge.astype(np.float64) - global_vectors[None].astype(np.float64), axis=2)
    return (distances * held).sum(axis=1)


def gda_weights(sizes: np.ndarray, discrepancies: np.ndarray, mode: str) -> np.ndarray:
    """Parameter-aggregation weights (sum 1): Eq. 4 as printed (``paper``), with shares
    (``normalized``), or by sample count (``fedavg``)."""
    if mode == "fedavg":
        return np.asarray(sizes, dtype=np.float64) / np.sum(sizes)
    return sigmoid_discrepancy_weights(sizes, discrepancies, "raw-counts" if mode == "paper" else "normalized")


def knowledge_variance(vectors: np.ndarray) -> float:
    """sum over the classes of the population variance of the class's C knowledge entries."""
    return float(np.asarray(vectors, dtype=np.float64).var(axis=1).sum())


def variance_ratio(current: ClassVectors, previous: ClassVectors, classes: str = "both-rounds") -> float | None:
    """rho_r = (sum var_r - sum var_(r-1)) / sum var_(r-1) (Eq. 5), both sums over the classes
    present in both rounds (``both-rounds``: a class that comes or goes would change a sum by
    itself) or each sum over its own round's classes (``each-round``, the code); None when the
    previous sum is 0. (The code's unbiased variance gives the same ratio: every vector has C entries.)"""
    if classes == "both-rounds":
        now, before = current.vectors[current.mask & previous.mask], previous.vectors[current.mask & previous.mask]
    elif classes == "each-round":
        now, before = current.vectors[current.mask], previous.vectors[previous.mask]
    else:
        raise ValueError(f"gpr classes must be both-rounds or each-round, got {classes!r}")
    before_sum = knowledge_variance(before)
    return None if before_sum <= 0 else (knowledge_variance(now) - before_sum) / before_sum


def period_review(
    weights: list[np.ndarray], previous: list[np.ndarray], ratio: float, beta: float, form: str, reviewed: list[bool]
) -> list[np.ndarray]:
    """GPR (Eq. 5) on the ``reviewed`` arrays: beta w + (1 - beta) rho (w_prev - w) (``paper``) or
    w + (1 - beta) rho (w_prev - w) (``interp``); the others (e.g. BatchNorm statistics) unchanged."""
    keep = beta if form == "paper" else 1.0
    result = []
    for w, w_prev, is_reviewed in zip(weights, previous, reviewed):
        if is_reviewed:
            w64, prev64 = w.astype(np.float64), w_prev.astype(np.float64)
            w = (keep * w64 + (1.0 - beta) * ratio * (prev64 - w64)).astype(w.dtype)
        result.append(w)
    return result


# --- client math ------------------------------------------------------------------------


def lcl_loss(
    logits: torch.Tensor, labels: torch.Tensor, knowledge: torch.Tensor, knowledge_classes: torch.Tensor,
    temperature: float, similarity_norm: str = "mean-distance", form: str = "paper",
) -> torch.Tensor:
    """LCL (Eq. 2-3), the mean over the batch. ``paper``: cross-entropy of each sample's similarities
    to the available classes' knowledge, its own class the one positive (samples of a class without
    knowledge left out): :func:`multi_positive_infonce` with one key per class, ``similarity_norm``
    its U.

    ``code``: the released code's form, plain cosine whatever ``similarity_norm``: logits
    [s(l, c^y), s(l, c^1), ..., s(l, c^M)] / tau with target 0, so the positive is counted twice in
    the denominator; a sample whose class has no knowledge takes its own (detached) logits as the
    positive, similarity 1.
    """
    if form == "paper":
        return multi_positive_infonce(logits, labels, knowledge, knowledge_classes, temperature, similarity_norm)
    if form != "code":
        raise ValueError(f"lcl form must be paper or code, got {form!r}")
    similarity = F.normalize(logits, dim=1) @ F.normalize(knowledge.to(logits.dtype), dim=1).T / temperature
    positive = labels[:, None] == knowledge_classes[None, :]
    own = torch.where(positive.any(dim=1), (similarity * positive).sum(dim=1),
                      torch.full_like(similarity[:, 0], 1.0 / temperature))
    return (torch.logsumexp(torch.cat([own[:, None], similarity], dim=1), dim=1) - own).mean()


# --- server -----------------------------------------------------------------------------


FORMS_RESULTS = "docs/results/baselines.md#fedskcs-forms-which-one-beats-fedavg"


def forms_line(options: FedSKCOptions) -> str:
    """What a FedSKC run says at its start: the forms it runs, and where their numbers are."""
    kept = f"{options.beta:g} w" if options.gpr_form == "paper" else "w"
    review = (f"GPR in the {options.gpr_form} form (w <- {kept} + (1 - {options.beta:g}) rho (w_prev - w))"
              if options.use_gpr else "no GPR")
    return (f"protofl: FedSKC with {review}, LCL as {options.lcl_form}, GDA as {options.gda_mode}. On "
            "Fashion-MNIST the paper's forms fell below FedAvg, its released code's stayed within 2 points of it and "
            f"gpr-form='interp' came out above it (significantly at Dirichlet 0.2): {FORMS_RESULTS}")


class FedSKCStrategy(ServerRule):
    options_class = FedSKCOptions
    loss_metrics = (LCL_LOSS,)
    state_fields = ("knowledge", "global_weights")
    broadcast_to_evaluate = False  # evaluation scores the global model's head

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.knowledge: ClassVectors | None = None  # the global knowledge of the last round
        self.global_weights = list(self.initial_weights)  # what the clients trained from this round
        parameters = {name for name, _ in self.model.named_parameters()}
        state = self.model.state_dict()
        every_float = self.options.gpr_entries == "all"  # BatchNorm statistics too (the code)
        self.reviewed = [name in parameters or (every_float and state[name].is_floating_point()) for name in state]
        LOGGER.log(WARNING if self.options.gpr_form == "paper" and self.options.use_gpr else INFO,
                   forms_line(self.options))

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return self.knowledge.to_config(GLOBAL_KNOWLEDGE) if self.knowledge else {}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        knowledge, counts = stacked_statistics(updates)
        held = counts > 0
        new_knowledge, new_mask = global_knowledge(knowledge, held, self.options.neighbours, **self.prototype_rule)
        discrepancies = knowledge_discrepancy(knowledge, held, new_knowledge)
        sizes = np.array([u.num_examples for u in updates])
        weights = gda_weights(sizes, discrepancies, self.options.gda_mode if self.options.use_gda else "fedavg")
        aggregated = self.average_parameters(updates, weights)
        ratio, reviewed = None, ClassVectors(new_knowledge, new_mask)
        if self.options.use_gpr and self.knowledge is not None:
            ratio = variance_ratio(reviewed, self.knowledge, self.options.gpr_classes)
            if ratio is not None:
                ratio = float(np.clip(ratio, -1.0, 1.0)) if self.options.gpr_clip else ratio
                aggregated = period_review(
                    aggregated, self.global_weights, ratio, self.options.beta, self.options.gpr_form, self.reviewed
                )
        self.knowledge = reviewed
        self.global_weights = aggregated
        self.recorder.update(
            server_round,
            gda_weight_min=float(weights.min()),
            gda_weight_max=float(weights.max()),
            gpr_ratio=ratio,
            knowledge_variance=knowledge_variance(new_knowledge[new_mask]),
        )
        return aggregated


# --- client -----------------------------------------------------------------------------


class FedSKCClient(PrototypeClient):
    options_class = FedSKCOptions

    def receive(self, parameters, this_round):
        """The global model, the available classes' knowledge vectors and their class ids (None
        before there is any), and LCL's weight this round."""
        self.load_shared(parameters)
        received = self.received_masked_vectors(this_round, GLOBAL_KNOWLEDGE, dim=self.data.num_classes)
        self.global_knowledge = None
        if self.options.use_lcl and received is not None and received.mask.any():
            classes = np.flatnonzero(received.mask)
            self.global_knowledge = (
                torch.from_numpy(received.vectors[classes]).to(self.device),
                torch.from_numpy(classes).to(self.device),
            )
        warmup = self.options.lcl_warmup_rounds
        self.lcl_weight = self.options.lambda_lcl * (min(this_round.number / warmup, 1.0) if warmup > 0 else 1.0)

    def batch_loss(self, features, logits, labels, inputs):
        if self.global_knowledge is None:
            return None  # round 1: CE only
        o = self.options
        lcl = lcl_loss(logits, labels, *self.global_knowledge, o.temperature, o.similarity_norm, o.lcl_form)  # Eq. 3
        self.record_loss(**{LCL_LOSS: lcl})
        return self.lcl_weight * lcl

    def step_constants(self):
        return self.global_knowledge is None, self.lcl_weight

    def step_inputs(self):
        if self.global_knowledge is None:
            return {}
        knowledge, classes = self.global_knowledge
        return {"knowledge": knowledge, "classes": classes}

    def local_statistics(self, seen) -> ClassStatistics:
        """Knowledge: per-class mean logits, through SiLU with ``silu`` (the paper)."""
        statistics = super().local_statistics(seen)
        if not self.options.silu:
            return statistics
        # in float64, rounded once: torch's float32 exp differs in its last bit from one CPU's
        # vectorised kernels to another's, and the upload would with it
        knowledge = F.silu(torch.from_numpy(statistics.means).double()).float().numpy()
        return ClassStatistics(knowledge, statistics.counts)


STRATEGY, CLIENT = FedSKCStrategy, FedSKCClient
