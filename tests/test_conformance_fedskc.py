"""FedSKC against numbers its authors' code computed (tests/conformance/fixtures/fedskc-*.npz, written
by ``python tests/conformance/make_fixtures.py fedskc``; their code is not imported here).

Where the code differs from the paper, protofl's default follows the paper and the test runs the
switch that reproduces the code: ``lcl-form="code"`` (plain cosine, LCL's positive counted twice,
a sample whose class has no knowledge its own positive), ``lcl-warmup-rounds=100``, ``silu=false``,
``prototype-pass="last-epoch"``, ``gda-mode="fedavg"`` (their GDA is computed, then overwritten by
FedAvg), ``beta=0.99``, ``gpr-entries="all"`` and ``gpr-classes="each-round"``.

Tolerances: both sides compute in float64 on the same numbers (the fixtures' inputs that cross
protofl's wire, the knowledge either way, are float32 values), so every comparison is ``FLOAT64``
(tests/conformance/common.py: float64 reorderings, a local round's 3 SGD steps included), except
where protofl itself rounds to float32 on purpose (u = 2^-24, ``FLOAT32_ROUNDING``):

- the per-class mean logits, computed in float64 and returned as float32 by ``class_means`` (and
  uploaded after a local round: class means are float32 on the wire): one rounding of each
  entry, ``float32_roundings(1)`` (scale, for the atol: the largest |entry|);
- the global knowledge, kept and sent as float32: the clients' knowledge is on a grid whose
  neighbour means and sums float32 holds exactly (conformance/fedskc.py), so what rounds is the
  division by the number of holders, once, ``float32_roundings(1)``;
- the global parameters after GPR, whose rho protofl computes from that float32 knowledge: one
  rounding of each entry g moves a class's variance by at most 4 u mean(g^2) (to first order:
  2 u from g^2, 2 u from the squared mean), so rho = sum var / sum var_prev - 1 by at most
  4 u sum_c mean(g_c^2) / sum var_prev, and an entry beta w + (1 - beta) rho (w_prev - w) by at most
  (1 - beta) times that times |w_prev - w| (:func:`gpr_rounding`), added to ``FLOAT64``'s atol.

The GDA weights are computed on their global knowledge: Eq. 4 alone, in float64, without our
rounding of the knowledge. The partition is compared exactly.
"""

import io

import numpy as np
import pytest
import torch
from conformance.common import FLOAT32_ROUNDING, FLOAT64, assert_matches, float32_roundings, load_fixture
from conformance.fedsc_fedskc_common import small_model

from protofl.federation.admission import ClientUpdate
from protofl.federation.server import legacy_strategy
from protofl.federation.wire import CLASS_COUNTS, CLASS_MEANS, ClassStatistics, ClassVectors, encode_array
from protofl.settings import ExperimentSettings
from protofl.strategies.fedskc import (
    GLOBAL_KNOWLEDGE,
    FedSKCClient,
    FedSKCStrategy,
    gda_weights,
    global_knowledge,
    knowledge_discrepancy,
    lcl_loss,
    period_review,
    variance_ratio,
)
from protofl.task.data.clients import ClientData
from protofl.task.partition import dirichlet_balanced
from protofl.task.robust import robust_average_layers
from protofl.task.statistics import class_means

pytestmark = pytest.mark.conformance

AS_THE_CODE = {  # the switches that make protofl's FedSKC the released code's
    "lcl-form": "code", "lcl-warmup-rounds": 100, "silu": False,
    "prototype-pass": "last-epoch", "gda-mode": "fedavg", "beta": 0.99, "gpr-entries": "all",
    "gpr-classes": "each-round",
}


def float_entries(prefix, arrays):
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix) and v.dtype.kind == "f"}


def rounded_once(expected):
    """The tolerance of values protofl rounds to float32 once (scale: their largest |entry|)."""
    return float32_roundings(1, float(np.abs(expected).max()))


def gpr_rounding(knowledge, previous_knowledge, beta, step):
    """How far GPR's entries move when each entry of the global ``knowledge`` (the classes held this
    round) is rounded to float32 once: (1 - beta) |d rho| ``step``, |d rho| <= 4 u sum_c mean(g_c^2)
    / sum_c var(previous_c), ``step`` the largest |w_prev - w| (module docstring)."""
    knowledge, previous_knowledge = np.asarray(knowledge, np.float64), np.asarray(previous_knowledge, np.float64)
    moved_ratio = 4 * FLOAT32_ROUNDING * np.mean(knowledge**2, axis=1).sum() / previous_knowledge.var(axis=1).sum()
    return (1 - beta) * moved_ratio * step


def test_the_fixtures_record_the_snapshot_they_came_from():
    fixture = load_fixture("fedskc-lcl")
    assert fixture.snapshot.repository == "hwang52/FedSKC"
    assert fixture.snapshot.commit == "002e4361e994274b769be09902f404290b9145c0"
    assert "make_fixtures.py fedskc" in fixture.rerun


def test_lcl_as_the_code_computes_it_loss_and_gradient():
    f = load_fixture("fedskc-lcl")
    i = f.inputs
    logits = torch.from_numpy(i["logits"]).requires_grad_(True)
    classes = np.flatnonzero(i["mask"])
    loss = lcl_loss(logits, torch.from_numpy(i["labels"]), torch.from_numpy(i["knowledge"][classes]),
                    torch.from_numpy(classes), float(i["temperature"]), "none", "code")
    loss.backward()
    assert_matches(loss.item(), f.outputs["loss"], "LCL (code form)")
    assert_matches(logits.grad, f.outputs["gradient"], "LCL's gradient")
    # the paper's form (the positive once, samples without knowledge left out) is another number
    paper = lcl_loss(logits, torch.from_numpy(i["labels"]), torch.from_numpy(i["knowledge"][classes]),
                     torch.from_numpy(classes), float(i["temperature"]), "none", "paper")
    assert abs(paper.item() - float(f.outputs["loss"])) > 0.1


def test_knowledge_is_the_per_class_mean_logit():
    f = load_fixture("fedskc-knowledge")
    means, counts = class_means(torch.from_numpy(f.inputs["vectors"]), torch.from_numpy(f.inputs["labels"]), 5)
    np.testing.assert_array_equal(counts > 0, f.outputs["mask"])
    expected = f.outputs["means"][f.outputs["mask"]]
    assert_matches(means[counts > 0], expected, "per-class mean logits (float32)", **rounded_once(expected))


def test_global_knowledge_and_the_gda_weights():
    f = load_fixture("fedskc-global-knowledge")
    i, o = f.inputs, f.outputs
    merged, mask = global_knowledge(i["knowledge"], i["held"], neighbours=1)
    np.testing.assert_array_equal(mask, o["mask"])
    expected = o["global_knowledge"][mask]
    assert_matches(merged[mask], expected, "global knowledge (Eq. 1, float32)", **rounded_once(expected))
    discrepancies = knowledge_discrepancy(i["knowledge"], i["held"], o["global_knowledge"])
    assert_matches(gda_weights(i["sizes"], discrepancies, "paper"), o["gda_weights"], "GDA weights")
    assert_matches(gda_weights(i["small_sizes"], discrepancies, "paper"), o["gda_weights_small_sizes"],
                   "GDA weights at small counts (the sigmoids not saturated)")
    # raw counts: (nearly) uniform; the smallest score (10 samples) is 7.7, so every sigmoid is
    # within e^-7.7 = 4.5e-4 of 1 and every weight within 4.5e-4 / 5 = 9e-5 of 1/5
    np.testing.assert_allclose(o["gda_weights"], 1 / 5, atol=1e-4)


def test_gda_and_fedavg_parameter_averages():
    f = load_fixture("fedskc-aggregation")
    clients = float_entries("client.", f.inputs)
    names = list(clients)
    per_client = [[clients[n][k] for n in names] for k in range(3)]
    for label, weights in (("gda", f.inputs["weights"]), ("fedavg", gda_weights(f.inputs["sizes"], None, "fedavg"))):
        averaged = robust_average_layers(per_client, weights, "method")
        for name, value in zip(names, averaged):
            assert_matches(value, f.outputs[f"{label}.{name}"], f"{label} average of {name}")


@pytest.mark.parametrize("case", ["same_classes", "class_gone"])
def test_gpr_on_every_state_entry_with_each_rounds_own_classes(case):
    f = load_fixture("fedskc-gpr")
    i = f.inputs
    current, previous = float_entries("current.", i), float_entries("previous.", i)
    mask_now = i["mask_now_class_gone"] if case == "class_gone" else i["mask_before"]
    now, before = ClassVectors(i["knowledge_now"], mask_now), ClassVectors(i["knowledge_before"], i["mask_before"])
    ratio = variance_ratio(now, before, "each-round")
    names = list(current)
    reviewed = period_review([current[n] for n in names], [previous[n] for n in names], ratio, 0.99, "paper",
                             [True] * len(names))
    for name, value in zip(names, reviewed):
        assert_matches(value, f.outputs[f"{case}.{name}"], f"GPR of {name} ({case})")
    if case == "class_gone":  # our default compares the classes of both rounds: another ratio
        assert abs(variance_ratio(now, before) - ratio) > 1e-3


def test_a_local_round_equals_the_codes():
    f = load_fixture("fedskc-local-round")
    i, o = f.inputs, f.outputs
    num_classes = len(i["mask"])
    settings = ExperimentSettings(method="fedskc", local_epochs=int(i["epochs"]), batch_size=64, lr=float(i["lr"]),
                                  amp="off", channels_last=False, batchnorm_stats="running", options=AS_THE_CODE)
    x, y = torch.from_numpy(i["x"]), torch.from_numpy(i["y"])
    data = ClientData(0, num_classes, x, y, x[:2], y[:2])
    client = FedSKCClient(settings, data, small_model(num_classes), 1, {})
    start = {k[len("start."):]: v for k, v in i.items() if k.startswith("start.")}
    names = list(client.model.state_dict())
    knowledge = ClassVectors(i["knowledge"], i["mask"]).to_config(GLOBAL_KNOWLEDGE)
    config = {"server-round": int(i["round"]), "seed": 0, **{k: encode_array(v) for k, v in knowledge.items()}}
    arrays, _, metrics = client.fit([start[n] for n in names], config)
    for name, value in zip(names, arrays):
        if value.dtype.kind == "f":
            assert_matches(value, o[f"state.{name}"], f"trained {name}")
        else:
            np.testing.assert_array_equal(value, o[f"state.{name}"])
    means = np.load(io.BytesIO(metrics[CLASS_MEANS]))
    counts = np.load(io.BytesIO(metrics[CLASS_COUNTS]))
    np.testing.assert_array_equal(counts > 0, o["knowledge_mask"])
    expected = o["knowledge"][o["knowledge_mask"]]
    assert_matches(means[counts > 0], expected, "uploaded knowledge (float32)", **rounded_once(expected))


def test_a_server_round_equals_the_codes(tmp_path):
    f = load_fixture("fedskc-server-round")
    i, o = f.inputs, f.outputs
    num_classes = i["knowledge"].shape[1]
    settings = ExperimentSettings(method="fedskc", output_dir=str(tmp_path), run_name="run", options=AS_THE_CODE)
    strategy = legacy_strategy(FedSKCStrategy)(settings, small_model(num_classes), num_classes)
    names = list(strategy.model.state_dict())
    strategy.knowledge = ClassVectors(i["previous_knowledge"], i["previous_mask"])
    strategy.global_weights = [i[f"previous.{n}"] for n in names]
    updates = [
        ClientUpdate(k, int(size), [i[f"client.{n}"][k] for n in names],
                     ClassStatistics(i["knowledge"][k], i["held"][k].astype(np.int64)))
        for k, size in enumerate(i["sizes"])
    ]
    aggregated = strategy.aggregate_updates(2, updates)
    np.testing.assert_array_equal(strategy.knowledge.mask, o["mask"])
    knowledge = o["global_knowledge"][o["mask"]]
    assert_matches(strategy.knowledge.vectors[o["mask"]], knowledge, "global knowledge (float32)",
                   **rounded_once(knowledge))
    sizes = i["sizes"] / i["sizes"].sum()
    previous_knowledge = i["previous_knowledge"][i["previous_mask"]]
    for name, value in zip(names, aggregated):
        if value.dtype.kind == "f":
            step = np.abs(i[f"previous.{name}"] - np.tensordot(sizes, i[f"client.{name}"], axes=1)).max()
            atol = FLOAT64["atol"] + gpr_rounding(knowledge, previous_knowledge, AS_THE_CODE["beta"], step)
            assert_matches(value, o[f"global.{name}"], f"global {name} after GDA and GPR", atol=atol)
    # what their GDA computed before FedAvg overwrote it: the paper mode's weights (on their knowledge)
    discrepancies = knowledge_discrepancy(i["knowledge"], i["held"], o["global_knowledge"])
    assert_matches(gda_weights(i["sizes"], discrepancies, "paper"), o["gda_weights"], "GDA weights (discarded)")


def test_the_partitioner_equals_the_codes_on_class_sorted_labels():
    f = load_fixture("fedskc-partition")
    i = f.inputs
    parts = dirichlet_balanced(i["labels"], int(i["num_clients"]), float(i["alpha"]), int(i["seed"]))
    owner = np.full(len(i["labels"]), -1)
    for k, part in enumerate(parts):
        owner[part] = k
    np.testing.assert_array_equal(owner, f.outputs["client_of_sample"])
