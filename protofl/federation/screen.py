"""The magnitude screen (``screen-factor``): an update larger than any honest client of the round
could send is dropped before a server rule sees it. No Flower types: it reads the decoded updates.

What "larger" means depends on how each kind of upload legitimately scales:

- **parameters**: the change from the model the client was sent. It is the sum of the client's
  local steps, so it grows with their number: a client that took K_k steps may move
  max(1, K_k / K) times as far as the round's median client, which took K (the lower medians
  of the changes and of the step counts). Under Dirichlet(0.1) the steps differ 50-fold between
  honest clients, and so did their changes.
- **class vectors** (prototypes, per-class mean logits, knowledge): each held class's vector
  against one reference per architecture, the lower median over that architecture's clients of
  each one's largest held-class norm (the class it knows best): one vote per client, so fewer
  than half of them hostile leave it honest, and a class that only one client holds is bounded
  like every other. A class's own holders are not compared with each other, nor a client's
  classes with its own median: a class a client barely holds has a weak mean (honest mean logits
  of one class differed 32-fold between its two holders), and under Dirichlet(0.05) a client's
  confident class reached 8 times the clients' median of their median norms.
- **named uploads** (``upload_specs``), by the :data:`UploadScale` their spec declares.

A dropped update's reason names the kind, its norm and the bound; each kind's largest ratio to its
reference is recorded (``screen_*_ratio``): how close honest clients come to the bound.
"""

from __future__ import annotations

import math
from typing import Callable, Literal, Mapping, Protocol, Sequence

import numpy as np


class ClassMeans(Protocol):
    means: np.ndarray  # C x d, zero rows for absent classes
    counts: np.ndarray  # C


class ScreenedUpdate(Protocol):
    """What the screen reads of an admitted update (:class:`~protofl.federation.admission.ClientUpdate`)."""

    partition_id: int
    num_examples: int
    parameters: list[np.ndarray]
    statistics: ClassMeans | None
    uploads: dict[str, np.ndarray]


UploadScale = Literal["round", "checked", "bounded"]
"""How a named upload's magnitude legitimately varies between honest clients, and so how the
screen treats it:

- ``"round"``: comparable across the round's clients (FedPAC's heads and centroids, FedAMP's
  models, CReFF's gradients): a norm above ``screen-factor`` x the round's lower median is dropped;
- ``"checked"``: what it must be follows from what the server knows, and the method's
  ``check_update`` compares it (FedGen's label counts against the partition's, SCAFFOLD's control
  delta against the parameters and the step count): not compared by norm, whatever its scale;
- ``"bounded"``: bounded whatever it holds, by its values (CReFF's mask of classes, booleans) or by
  the method's rule (FedPAC's feature variance: a larger one lowers only its client's own weight):
  not compared by norm.
"""


def lower_median(values: Sequence[float]) -> float:
    """The lower of the two middle values (the smaller one for two values): with fewer than half
    the values hostile, it is an honest one."""
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    return float(ordered[(len(ordered) - 1) // 2])


class ScreenFindings:
    """The reasons to drop (partition -> the first reason found) and the largest ratios seen."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.reasons: dict[int, str] = {}
        self.ratios: dict[str, float] = {}

    def compare(self, what: str, ratio_key: str, partitions: Sequence[int], norms: Sequence[float],
                allowances: Sequence[float] | None = None, reference: float | None = None) -> None:
        """Each partition's ``norms`` against ``screen-factor`` x ``reference`` (default: their
        lower median), times its ``allowances`` (default 1)."""
        reference = lower_median(norms) if reference is None else reference
        if reference <= 0:  # nothing to compare with
            return
        allowances = [1.0] * len(norms) if allowances is None else allowances
        for partition, norm, allowance in zip(partitions, norms, allowances):
            ratio = norm / (reference * allowance)
            self.ratios[ratio_key] = max(self.ratios.get(ratio_key, 0.0), ratio)
            if self.factor > 0 and ratio > self.factor:
                bound = f"{self.factor:g} x the round's median {reference:.3g}"
                if allowance != 1.0:
                    bound += f" x {allowance:.3g} (its local steps over the median client's)"
                self.reasons.setdefault(partition, f"{what} norm {norm:.3g} is above {bound}")


def screen_updates(
    updates: Sequence[ScreenedUpdate], sent_parameters: Sequence[np.ndarray], upload_scales: Mapping[str, UploadScale],
    architecture: Callable[[int], str], local_steps: Callable[[int], int], factor: float,
) -> ScreenFindings:
    """The screen over one round's admitted updates: ``sent_parameters`` what they trained from,
    ``upload_scales`` each named upload's :data:`UploadScale`, ``architecture(partition)`` the
    model a client builds, ``local_steps(num_examples)`` the optimiser steps of a client of that
    training size."""
    findings = ScreenFindings(factor)
    if len(updates) < 2:
        return findings
    partitions = [u.partition_id for u in updates]
    if sent_parameters and updates[0].parameters:
        changes = [change_norm(u.parameters, sent_parameters) for u in updates]
        steps = [local_steps(u.num_examples) for u in updates]
        median_steps = lower_median(steps)
        findings.compare("parameter change", "screen_parameter_ratio", partitions, changes,
                         [max(1.0, k / median_steps) for k in steps])
    groups: dict[str, list[str]] = {}  # an indexed upload (name/0, name/1, ...) is one vector
    for name in updates[0].uploads:
        if upload_scales[name] == "round":
            groups.setdefault(name.split("/")[0], []).append(name)
    for group, names in groups.items():
        norms = [math.sqrt(sum(float(np.sum(u.uploads[n].astype(np.float64) ** 2)) for n in names)) for u in updates]
        findings.compare(f"upload {group!r}", "screen_upload_ratio", partitions, norms)
    if updates[0].statistics is not None:  # per architecture: their feature scales differ
        architectures = [architecture(p) for p in partitions]
        for name in sorted(set(architectures)):
            members = [u for u, a in zip(updates, architectures) if a == name]
            screen_class_vectors(findings, members)
    return findings


def screen_class_vectors(findings: ScreenFindings, updates: Sequence[ScreenedUpdate]) -> None:
    """Every held class's vector of clients of one architecture against ``screen-factor`` x the
    lower median of the clients' largest held-class norms (a single client: nothing to compare)."""
    if len(updates) < 2:
        return
    norms = [np.linalg.norm(u.statistics.means.astype(np.float64), axis=1) for u in updates]
    held = [u.statistics.counts > 0 for u in updates]
    reference = lower_median([float(n[h].max()) for n, h in zip(norms, held)])
    for update, n, h in zip(updates, norms, held):
        worst = int(np.argmax(np.where(h, n, -1.0)))
        findings.compare(f"class {worst} vector", "screen_prototype_ratio", [update.partition_id], [float(n[worst])],
                         reference=reference)


def change_norm(parameters: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """L2 norm of an update's change to the floating-point entries it trained from."""
    return math.sqrt(sum(
        float(np.sum((a.astype(np.float64) - r) ** 2)) for a, r in zip(parameters, reference) if r.dtype.kind == "f"
    ))
