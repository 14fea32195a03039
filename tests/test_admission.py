"""Admission (federation/admission) on its own, without a strategy or a Flower round: who may
reply, the checks of a fit reply, the screen, and the check of what goes out."""

import numpy as np
import pytest
from fakes import FakeProxy

from protofl.federation.admission import Admission, ClientUpdate, output_problem
from protofl.federation.wire import Blobs, ClassStatistics, PayloadError, Reply, encode_array
from protofl.settings import ExperimentSettings, MethodOptions

C, D = 3, 2
REFERENCES = [np.zeros((2, 2), np.float32), np.zeros(2, np.int64)]
COUNTS = np.array([2, 0, 1])


def admission(check_update=lambda update: None, **settings):
    known = {0: (3, 5, COUNTS), 1: (3, 5, COUNTS), 2: (3, 5, COUNTS)}.get
    admitted = Admission(ExperimentSettings(**settings), MethodOptions(), REFERENCES, C, D, ("extra-loss",),
                         known, check_update)
    admitted.asked = {"100": 0, "101": 1, "102": 2}
    return admitted


def fit_reply(parameters, num_examples, metrics):
    """A fit reply as a front hands it to the server template (protofl.federation.wire.Reply)."""
    return Reply(Blobs([encode_array(a) for a in parameters]), num_examples, metrics)


def reply(pid, shift=0.0, means=None, num_examples=3, **metrics):
    parameters = [REFERENCES[0] + np.float32(shift), REFERENCES[1]]
    means = np.ones((C, D), np.float32) if means is None else means
    metrics = {"partition-id": pid, "train-loss": 1.0, **ClassStatistics(means, COUNTS).to_metrics(), **metrics}
    return FakeProxy(str(100 + pid)), fit_reply(parameters, num_examples, metrics)


def test_only_asked_nodes_reply_once_and_a_bad_reply_drops_alone(caplog):
    gate = admission()
    stranger = (FakeProxy("999"), reply(0)[1])
    results = [reply(0), reply(0), stranger, reply(1, num_examples=4), reply(2, **{"extra-loss": -1.0})]
    updates, dropped = gate.replies(5, "fit", results, gate.fit_update)
    assert [u.partition_id for u in updates] == [0]
    assert [(d["node"], d["partition"], d["reason"]) for d in dropped] == [
        ("100", None, "a second reply from this node this round"),
        ("999", None, "this node was not asked this round"),
        ("101", 1, "num_examples 4 is not partition 1's training size"),
        ("102", 2, "extra-loss must be a finite float >= 0, got -1.0"),
    ]
    assert all(d["stage"] == "fit" for d in dropped)
    assert "round 5: dropped the fit result of node 999: this node was not asked this round" in caplog.text
    np.testing.assert_array_equal(updates[0].statistics.counts, COUNTS)


def test_the_methods_own_check_drops_an_update():
    def refuse_partition_1(update: ClientUpdate):
        if update.partition_id == 1:
            raise PayloadError("not this one")

    gate = admission(refuse_partition_1)
    updates, dropped = gate.replies(1, "fit", [reply(0), reply(1)], gate.fit_update)
    assert [u.partition_id for u in updates] == [0] and dropped[0]["reason"] == "not this one"


def test_the_screen_drops_the_update_far_above_the_rounds_median():
    gate = admission(screen_factor=10.0)
    results = [reply(0, shift=0.1), reply(1, shift=0.2), reply(2, shift=5.0)]
    updates, _ = gate.replies(1, "fit", results, gate.fit_update)
    kept, dropped, ratios = gate.screen(1, updates)
    assert [u.partition_id for u in kept] == [0, 1]
    assert [(d["stage"], d["node"], d["partition"]) for d in dropped] == [("screen", "102", 2)]
    assert ratios["screen_parameter_ratio"] == pytest.approx(25.0)  # norms 0.2, 0.4, 10: 10 / the median 0.4
    assert ratios["screen_prototype_ratio"] == pytest.approx(1.0)


def test_a_parameter_change_may_grow_with_the_clients_local_steps():
    """Under Dirichlet(0.1) honest training sizes differ 50-fold, and so do the changes their local
    steps add up to (SCAFFOLD on Fashion-MNIST: 0.008 after one step, 0.46 after 32). A change is
    compared with the median client's scaled by its steps over that client's (the lower medians);
    a client of few steps that moves as far as one of many is still dropped."""
    sizes = {0: 10, 1: 20, 2: 500, 3: 500}  # 2, 4, 100 and 100 steps (batch 10, 2 epochs)
    gate = Admission(ExperimentSettings(), MethodOptions(), REFERENCES, C, D, (),
                     lambda p: (sizes[p], 5, np.array([sizes[p], 0, 0])), lambda update: None)
    gate.asked = {str(100 + p): p for p in sizes}

    def replies(changes):
        means = np.array([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]], np.float32)
        return [(FakeProxy(str(100 + p)),
                 fit_reply([REFERENCES[0] + np.float32(shift), REFERENCES[1]], sizes[p],
                           {"partition-id": p, "train-loss": 1.0,
                            **ClassStatistics(means, np.array([sizes[p], 0, 0])).to_metrics()}))
                for p, shift in enumerate(changes)]

    updates, _ = gate.replies(1, "fit", replies([0.01, 0.02, 0.5, 0.5]), gate.fit_update)
    kept, dropped, ratios = gate.screen(1, updates)
    assert len(kept) == 4 and ratios["screen_parameter_ratio"] == pytest.approx(1.0)
    updates, _ = gate.replies(2, "fit", replies([0.01, 0.5, 0.02, 0.02]), gate.fit_update)
    kept, dropped, _ = gate.screen(2, updates)
    assert [d["partition"] for d in dropped] == [1]
    assert dropped[0]["reason"] == "parameter change norm 1 is above 10 x the round's median 0.04"


def test_what_goes_out_must_have_the_shapes_sent_and_be_finite():
    assert output_problem(list(REFERENCES), REFERENCES, {"prototypes": np.ones((C, D))}) is None
    assert output_problem(REFERENCES[:1], REFERENCES, {}) == "the aggregate has 1 arrays, expected 2"
    assert output_problem([REFERENCES[0].astype(np.float64), REFERENCES[1]], REFERENCES, {}) == \
        "aggregate array 0 is float64(2, 2), not float32(2, 2)"
    assert output_problem([REFERENCES[0] + np.nan, REFERENCES[1]], REFERENCES, {}) == "aggregate array 0 is not finite"
    assert output_problem(None, REFERENCES, {"anchors": np.array([np.inf])}) == "the broadcast 'anchors' is not finite"
