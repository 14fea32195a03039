"""FedSC against numbers its authors' code computed (tests/conformance/fixtures/fedsc-*.npz, written by
``python tests/conformance/make_fixtures.py fedsc``; their code is not imported here).

protofl's default follows the paper; the released code is reproduced by ``rpcl-form="code"`` (plain
cosine; its positive lookup fails and falls back to the sample's own feature;
negatives pooled over the batch), ``use-cpdr=false`` (its CPDR is MSE(z, z.detach()): 0, zero
gradient), ``neighbours=0`` (its neighbour merge writes into a copy it discards) and
``prototype-pass="last-epoch"``. Its consistent prototypes weight the i-th holder of a class by the
i-th participant's e: equal to ours (Eq. 12) when every participant holds every class, and a
documented divergence otherwise (it only feeds CPDR, which the code zeroes).

Tolerances: both sides compute in float64 on the same numbers (the fixtures' inputs that cross
protofl's wire, the prototypes either way, are float32 values), so every comparison is ``FLOAT64``
(tests/conformance/common.py: float64 reorderings, a local round's 3 SGD steps included), except
where protofl itself rounds to float32 on purpose:

- the consistent prototypes (Eq. 12) go out as float32: protofl computes them in float64 and rounds
  each entry once, ``float32_roundings(1)`` (a sum of non-negative terms: no cancellation, the
  rounding is relative to the entry itself; scale: the largest entry, for the atol);
- the uploaded prototypes (class means: float32 on the wire): the last epoch's mean features,
  computed in float64 and rounded once, ``float32_roundings(1)`` (scale: the largest |entry|).

The relational prototypes need none: with ``neighbours=0`` they are the clients' float32
prototypes as they came.
"""

import io

import numpy as np
import pytest
import torch
from conformance.common import assert_matches, float32_roundings, load_fixture
from conformance.fedsc_fedskc_common import small_model

from protofl.federation.admission import ClientUpdate
from protofl.federation.server import legacy_strategy
from protofl.federation.wire import CLASS_COUNTS, CLASS_MEANS, ClassStatistics, ClassVectors, encode_array
from protofl.settings import ExperimentSettings
from protofl.strategies.fedsc import (
    CONSISTENT_PROTOTYPES,
    RELATIONAL_LABELS,
    RELATIONAL_PROTOTYPES,
    FedSCClient,
    FedSCStrategy,
    consistent_prototypes,
    label_discrepancy,
    relational_prototypes,
    rpcl_loss,
)
from protofl.task.data.clients import ClientData
from protofl.task.prototypes import sigmoid_discrepancy_weights

pytestmark = pytest.mark.conformance

AS_THE_CODE = {"rpcl-form": "code", "use-cpdr": False, "neighbours": 0,
               "prototype-pass": "last-epoch"}


def class_major(rows, held):
    """Our relational rows (client-major: ``rows[held]``) in the code's order (class, then participant):
    (rows, their classes, their clients)."""
    clients, classes = np.nonzero(held)
    order = np.lexsort((clients, classes))
    return rows[order], classes[order], clients[order]


def test_the_fixtures_record_the_snapshot_they_came_from():
    fixture = load_fixture("fedsc-server")
    assert fixture.snapshot.repository == "hwang52/FedSC"
    assert fixture.snapshot.commit == "a04dc8e630706a0c3f12f716c45857ead95a4940"


def test_rpcl_and_cpdr_as_the_code_computes_them():
    f = load_fixture("fedsc-client-losses")
    i = f.inputs
    features = torch.from_numpy(i["features"]).requires_grad_(True)
    rpcl = rpcl_loss(features, torch.from_numpy(i["labels"]), torch.from_numpy(i["relational"]),
                     torch.from_numpy(i["relational_labels"]), float(i["temperature"]), "none", "code")
    rpcl.backward()
    assert_matches(rpcl.item(), f.outputs["rpcl"], "RPCL (code form)")
    assert float(f.outputs["cpdr"]) == 0.0  # MSE(z, z.detach()): why use-cpdr=false is the code
    assert_matches(features.grad, f.outputs["gradient"], "gradient of RPCL + CPDR")
    paper = rpcl_loss(features, torch.from_numpy(i["labels"]), torch.from_numpy(i["relational"]),
                      torch.from_numpy(i["relational_labels"]), float(i["temperature"]), "none", "paper")
    assert abs(paper.item() - float(f.outputs["rpcl"])) > 0.1


@pytest.mark.parametrize("case", ["every_class", "missing_classes"])
def test_relational_prototypes_discrepancies_and_weights(case):
    f = load_fixture("fedsc-server")
    prototypes, held, counts = (f.inputs[f"{case}.{k}"] for k in ("prototypes", "held", "counts"))
    o = {k[len(case) + 1:]: v for k, v in f.outputs.items() if k.startswith(case)}
    relational = relational_prototypes(prototypes, held, neighbours=0, metric="angle")
    rows, labels, _ = class_major(relational[held], held)
    np.testing.assert_array_equal(labels, o["relational_labels"])
    assert_matches(rows, o["relational"], "relational prototypes (no merge)")
    discrepancies = label_discrepancy(counts)
    assert_matches(discrepancies, o["discrepancies"], "label discrepancy (Eq. 10)")
    weights = sigmoid_discrepancy_weights(counts.sum(axis=1), discrepancies)  # Eq. 11
    consistent, mask = consistent_prototypes(relational, held, weights)
    np.testing.assert_array_equal(mask, o["consistent_mask"])
    # their e, read back from the in-place scaling: the i-th prototype of each class times the i-th e
    scale = np.linalg.norm(o["relational_after_co_p"], axis=1) / np.linalg.norm(o["relational"], axis=1)
    position = np.concatenate([np.arange((labels == c).sum()) for c in np.unique(labels)])
    assert_matches(scale, weights[position], "their sigmoid weights e (Eq. 11)")
    if case == "every_class":
        assert_matches(consistent, o["consistent"], "consistent prototypes (Eq. 12)",
                       **float32_roundings(1, np.abs(o["consistent"]).max()))
    else:  # the code's misindexing: class c's i-th holder weighted by participant i's e, no renormalising
        for c in range(held.shape[1]):
            holders = np.flatnonzero(held[:, c])
            expected = sum(weights[i] * prototypes[k, c] for i, k in enumerate(holders))
            assert_matches(o["consistent"][c], expected, f"the code's consistent prototype of class {c}")
        assert not np.allclose(consistent, o["consistent"], atol=1e-3)


def test_a_local_round_equals_the_codes():
    f = load_fixture("fedsc-local-round")
    i, o = f.inputs, f.outputs
    num_classes = len(i["consistent_mask"])
    settings = ExperimentSettings(method="fedsc", local_epochs=int(i["epochs"]), batch_size=64, lr=float(i["lr"]),
                                  amp="off", channels_last=False, batchnorm_stats="running", options=AS_THE_CODE)
    x, y = torch.from_numpy(i["x"]), torch.from_numpy(i["y"])
    client = FedSCClient(settings, ClientData(0, num_classes, x, y, x[:2], y[:2]), small_model(num_classes), 1, {})
    start = {k[len("start."):]: v for k, v in i.items() if k.startswith("start.")}
    names = list(client.model.state_dict())
    consistent = ClassVectors(i["consistent"], i["consistent_mask"]).to_config(CONSISTENT_PROTOTYPES)
    config = {"server-round": int(i["round"]), "seed": 0, RELATIONAL_PROTOTYPES: encode_array(i["relational"]),
              RELATIONAL_LABELS: encode_array(i["relational_labels"]),
              **{k: encode_array(v) for k, v in consistent.items()}}
    arrays, _, metrics = client.fit([start[n] for n in names], config)
    for name, value in zip(names, arrays):
        if value.dtype.kind == "f":
            assert_matches(value, o[f"state.{name}"], f"trained {name}")
        else:
            np.testing.assert_array_equal(value, o[f"state.{name}"])
    counts = np.load(io.BytesIO(metrics[CLASS_COUNTS]))
    np.testing.assert_array_equal(counts, o["class_counts"])
    means = np.load(io.BytesIO(metrics[CLASS_MEANS]))
    expected = o["prototypes"][counts > 0]
    assert_matches(means[counts > 0], expected, "uploaded prototypes", **float32_roundings(1, np.abs(expected).max()))


def test_a_server_round_equals_the_codes(tmp_path):
    f = load_fixture("fedsc-server-round")
    i, o = f.inputs, f.outputs
    num_classes = i["counts"].shape[1]
    settings = ExperimentSettings(method="fedsc", output_dir=str(tmp_path), run_name="run", options=AS_THE_CODE)
    strategy = legacy_strategy(FedSCStrategy)(settings, small_model(num_classes), num_classes)
    names = list(strategy.model.state_dict())
    updates = [
        ClientUpdate(k, int(counts.sum()), [i[f"client.{n}"][k] for n in names],
                     ClassStatistics(i["prototypes"][k], counts))
        for k, counts in enumerate(i["counts"])
    ]
    aggregated = strategy.aggregate_updates(2, updates)
    for name, value in zip(names, aggregated):
        if value.dtype.kind == "f":
            assert_matches(value, o[f"global.{name}"], f"FedAvg of {name}")
    sent = strategy.broadcast(3)
    held = i["counts"] > 0
    rows, labels, clients = class_major(sent[RELATIONAL_PROTOTYPES], held)
    np.testing.assert_array_equal(labels, o["relational_labels"])
    # the code's get_co_p scales its relational prototypes by e in place before they go out (every
    # participant holds every class here, so the i-th holder is participant i); RPCL's cosine ignores it
    weights = sigmoid_discrepancy_weights(i["counts"].sum(axis=1), label_discrepancy(i["counts"]))
    scaled = rows * weights[clients][:, None]
    assert_matches(scaled, o["relational"], "broadcast relational prototypes (times the code's e)")
    np.testing.assert_array_equal(sent[f"{CONSISTENT_PROTOTYPES}-mask"], o["consistent_mask"])
    assert_matches(sent[CONSISTENT_PROTOTYPES], o["consistent"], "broadcast consistent prototypes",
                   **float32_roundings(1, np.abs(o["consistent"]).max()))
