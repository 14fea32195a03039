"""FedRCL against numbers its authors' code (skynbe/FedRCL) computed: tests/conformance/fixtures/
fedrcl-*.npz, written by ``python tests/conformance/make_fixtures.py fedrcl`` (the calls are described
in tests/conformance/fedrcl.py; their code is not imported here).

What is compared is the model-agnostic math: one level's per-sample SCL and penalty terms and their
gradients, and a local epoch of the whole client objective (CE + the mean over levels of each term,
plain SGD) on the CNN, whose levels (its two MaxPool2d outputs and its feature) are the same modules'
outputs on both sides. Not compared: protofl's ResNets end each block in its ReLU, so their levels
are the authors' ``feature_relu = True`` ones, not the default pre-ReLU sums. Every input keeps the
values their ``topk`` picks (and those compared with the 0.7 threshold) at least 1e-9 from the
next candidate (checked when the fixtures were made): on a tie, topk's gradient goes to one of the
tied entries, which either side may choose.

Tolerances: both sides compute in float64 (tests/conformance/common.py, ``FLOAT64``), the same
formulas in other orders: an L2 normalisation and dot products of C <= 512 terms (a similarity
errs by about C u = 6e-14, u = 2^-53), a logsumexp of 3 logits (resp. a softplus of one) of size
<= 1/tau = 20 (their log_softmax, our logsumexp - p / tau: about 20 u = 2e-15 each), means over
the batch and over the levels. Gradients go through the same steps; nearly parallel features
amplify the rounding of z_j - s z_i by 1 / sqrt(2 (1 - s)), at most 16 here (s <= 0.9971).
So values (|x| <= 29) and gradients (|g| <= 2) differ by well under 1e-12 absolute: ``FLOAT64``
(rtol 1e-9, atol 1e-12), whose margin also covers the local epoch's two SGD steps at lr 0.1 (the
second from weights 1e-16 apart, which the loss's curvature amplifies at most tenfold). The trained
weights are compared in full where small, and every tensor by fingerprint relative to the
weights' norm (as tests/test_conformance_fedsa.py does), and so is their change from the initial
weights, relative to the change's norm plus the rounding of the subtraction (u per entry on each
side, ``2 U |w|``). What differs shows far above that: a float32 rounding of the similarities
moves the trained weights by 3e-9, a tau off by 2e-6 by 4e-8, the easiest positive, the most
similar partner, 3 negatives or the feature level alone by 4e-3 or more (measured, all caught).
"""

import numpy as np
import pytest
import torch
from conformance.common import FLOAT64, assert_matches, fingerprint, load_fixture, pixels_to_input

from protofl.federation.wire import CONTRASTIVE_LOSS, TRAIN_LOSS
from protofl.settings import ExperimentSettings
from protofl.strategies.fedrcl import PENALTY_LOSS, FedRCLClient, feature_levels, relaxed_contrastive_terms
from protofl.task.data import ClientData
from protofl.task.models import build_model

pytestmark = pytest.mark.conformance

U = 2.0**-53  # float64's unit roundoff
CASES = ["random", "collapsed", "mixed", "singleton_few_negatives", "one_class", "singletons", "map"]


@pytest.fixture(autouse=True)
def one_thread():
    """Batches of at most 15: a second CPU thread only adds waiting (on a shared machine the local
    epoch took 1-3 s on two threads, 0.1 s on one). Float64 reorderings only: within ``FLOAT64``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_fixtures_record_the_snapshot_they_came_from():
    for name in ("fedrcl-terms", "fedrcl-local-round"):
        fixture = load_fixture(name)
        assert fixture.snapshot.repository == "skynbe/FedRCL"
        assert fixture.snapshot.commit == "378beb409add17838567ea25238afadb3258514f"
        assert "make_fixtures.py fedrcl" in fixture.rerun


@pytest.mark.parametrize("case", CASES)
def test_one_levels_terms_and_their_gradients_equal_the_codes(case):
    f = load_fixture("fedrcl-terms")
    i, o = f.inputs, f.outputs
    labels = torch.from_numpy(i[f"{case}.labels"])
    for term, index in (("scl", 0), ("penalty", 1)):
        features = torch.from_numpy(i[f"{case}.features"]).requires_grad_(True)
        per_sample = relaxed_contrastive_terms(features, labels, float(i["temperature"]), float(i["threshold"]),
                                               int(i["negatives"]))[index]
        per_sample.mean().backward()
        assert_matches(per_sample.detach(), o[f"{case}.{term}"], f"{case}: per-sample {term}")
        assert_matches(features.grad, o[f"{case}.{term}.gradient"], f"{case}: gradient of the mean {term}")


def test_the_cases_cover_the_edges():
    """What the cases are there for, in the authors' numbers (so a regenerated fixture keeps them)."""
    f = load_fixture("fedrcl-terms")
    i, o = f.inputs, f.outputs
    fires = {case: o[f"{case}.penalty"] > 1e-6 for case in CASES}  # inactive: softplus(-(1 + s_ii) / tau) ~ 4e-18
    assert fires["collapsed"].sum() >= 10 and not fires["random"].any()
    assert fires["mixed"].any() and not fires["mixed"].all()
    # in "mixed", samples whose partners lie on both sides of the threshold: none fires (the least
    # similar partner decides, not the most similar one nor any pair above it)
    z = i["mixed.features"] / np.linalg.norm(i["mixed.features"], axis=1, keepdims=True)
    similarity, labels = z @ z.T, i["mixed.labels"]
    partners = (labels[:, None] == labels[None, :]) & ~np.eye(len(labels), dtype=bool)
    above = (partners & (similarity >= float(i["threshold"]))).any(1)
    below = (partners & (similarity < float(i["threshold"]))).any(1)
    assert (above & below).sum() >= 2 and not fires["mixed"][above & below].any()
    assert not fires["singleton_few_negatives"].any() and not fires["singletons"].any()
    np.testing.assert_array_equal(o["one_class.scl"], 0.0)  # no negatives: only the positive's logit


def _assert_fingerprints(arrays: dict[str, np.ndarray], expected: dict[str, np.ndarray], what: str,
                         extra_atol: dict[str, float] | None = None) -> None:
    for name, array in arrays.items():
        theirs = expected[name]
        atol = FLOAT64["rtol"] * theirs[1] + (extra_atol or {}).get(name, 0.0)  # [1]: their array's L2 norm
        assert_matches(fingerprint(array), theirs, f"{what} {name}", rtol=0.0, atol=atol)


def test_a_local_epoch_equals_the_codes():
    f = load_fixture("fedrcl-local-round")
    i, o = f.inputs, f.outputs
    seed, n = int(i["order_seed"]), len(i["labels"])
    # the batch order protofl's training loop draws from the fit config's seed (protofl/task/train.py)
    # is the one the fixture trained their client on
    np.testing.assert_array_equal(torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy(),
                                  i["order"])
    model = build_model("cnn", 1, int(i["num_classes"]), int(i["image_size"]), seed=int(i["model_seed"]))
    pools = [m for m in model.body.modules() if isinstance(m, torch.nn.MaxPool2d)]
    assert feature_levels(model) == [*pools, model.body]  # the levels the fixture took
    initial = {name: t.detach().numpy().copy() for name, t in model.state_dict().items()}
    _assert_fingerprints(initial, {k: i[f"initial.{k}.fingerprint"] for k in initial}, "initial")

    settings = ExperimentSettings(method="fedrcl", model="cnn", local_epochs=1, batch_size=int(i["batch_size"]),
                                  lr=float(i["lr"]), momentum=0.0, weight_decay=0.0, max_grad_norm=0.0, amp="off",
                                  channels_last=False)
    x, y = pixels_to_input(i["pixels"]), torch.from_numpy(i["labels"])
    data = ClientData(0, int(i["num_classes"]), x, y, x[:2], y[:2])
    client = FedRCLClient(settings, data, model, 1, {})
    names = list(client.model.state_dict())
    arrays, num_train, metrics = client.fit([initial[k] for k in names], {"server-round": 1, "seed": seed})
    assert num_train == n
    trained = dict(zip(names, arrays))
    for name in [k[len("trained."):] for k in o if k.startswith("trained.") and not k.endswith(".fingerprint")]:
        assert_matches(trained[name], o[f"trained.{name}"], f"trained {name}")
    _assert_fingerprints(trained, {k: o[f"trained.{k}.fingerprint"] for k in trained}, "trained")
    change = {k: trained[k] - initial[k] for k in names}
    subtraction = {k: 2 * U * np.linalg.norm(trained[k]) for k in names}  # u |w| on each side
    _assert_fingerprints(change, {k: o[f"change.{k}.fingerprint"] for k in names}, "change of", subtraction)
    # the uploaded loss parts: each one's mean over the batches (of its mean over the levels)
    assert_matches(metrics[CONTRASTIVE_LOSS], o["scl"].mean(), CONTRASTIVE_LOSS)
    assert_matches(metrics[PENALTY_LOSS], o["penalty"].mean(), PENALTY_LOSS)
    assert_matches(metrics[TRAIN_LOSS], o["total"].mean(), "train-loss (CE + scl + penalty)")
