"""Hostile clients, in process: every attack class against every method's strategy.

Four nodes hold the four partitions of digits; three send honest-looking updates, node 103
(partition 3) attacks. The server must not raise, must broadcast only finite arrays, and must end
the round exactly where the three honest updates alone would have taken it (the attack dropped),
or, for attacks that are converted rather than dropped, where the honest equivalent takes it.
"""

import io
import json
import pickle

import numpy as np
import pytest
from fakes import OK, FakeProxy, uploads_class_statistics
from flwr.common import EvaluateRes, FitRes, Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from inprocess import TEMPLATE_METHODS
from replies import (
    N, aggregate_fit, altered, assert_same_state, class_means_of, exchanges_nothing, honest_update, make_strategy,
    scaled_parameters, server_state,
)

from protofl.federation.wire import CLASS_COUNTS, CLASS_MEANS, ClassVectors, encode_array
from protofl.strategies import METHODS
from protofl.task.data import load_dataset

HOSTILE = 3


def _pickled_array():
    return b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, 'shape': (1,), }" + b" " * 53 + b"\n" + \
        pickle.dumps([1])


# Each attack: (strategy, honest reply of partition 3) -> the list of (proxy, reply) the hostile node sends.
def attack_huge_class_vector(strategy, res):
    means = class_means_of(res)
    means[np.flatnonzero(means.any(axis=1))[0]] = 1e21
    return [(FakeProxy("103"), altered(res, **{CLASS_MEANS: encode_array(means)}))]


def attack_scaled_parameters(strategy, res):
    return [(FakeProxy("103"), altered(res, parameters=scaled_parameters(strategy, res, 1e6)))]


def attack_inflated_size(strategy, res):  # 10^12 samples, counts (where sent) raised to add up
    if CLASS_COUNTS not in res.metrics:
        return [(FakeProxy("103"), altered(res, num_examples=10**12))]
    counts = np.load(io.BytesIO(res.metrics[CLASS_COUNTS]))
    counts[np.argmax(counts)] += 10**12 - counts.sum()
    return [(FakeProxy("103"), altered(res, num_examples=10**12, **{CLASS_COUNTS: encode_array(counts)}))]


def attack_overflowing_counts(strategy, res):  # int64 values that wrap around to the true total
    counts = np.load(io.BytesIO(res.metrics[CLASS_COUNTS]))
    counts[:4] += 2**62  # each still a valid int64; 4 x 2**62 = 2**64 wraps to 0 in an int64 sum
    assert counts.sum() == res.num_examples
    return [(FakeProxy("103"), altered(res, **{CLASS_COUNTS: encode_array(counts)}))]


def attack_shifted_counts(strategy, res):  # the right total, the wrong classes
    counts = np.load(io.BytesIO(res.metrics[CLASS_COUNTS]))
    return [(FakeProxy("103"), altered(res, **{CLASS_COUNTS: encode_array(np.roll(counts, 1))}))]


def attack_twice(strategy, res):
    return [(FakeProxy("103"), res), (FakeProxy("103"), altered(res, parameters=scaled_parameters(strategy, res, 5.0)))]


def attack_other_partition(strategy, res):
    return [(FakeProxy("103"), altered(res, **{"partition-id": 0}))]


def attack_not_asked(strategy, res):
    return [(FakeProxy("999"), res)]


def attack_bool_loss(strategy, res):
    return [(FakeProxy("103"), altered(res, **{"train-loss": True}))]


def attack_huge_text(strategy, res):  # a reason quoting it must not flood the logs or results.json
    return [(FakeProxy("103"), altered(res, **{"train-loss": "x" * 10**6, "partition-id": "y" * 10**6}))]


def attack_malformed_blobs(strategy, res):
    metrics = {CLASS_MEANS: _pickled_array()} if CLASS_MEANS in res.metrics else {}
    if not metrics and not res.parameters.tensors:  # its named arrays alone (FedAMP's models)
        metrics = {_upload_name(strategy): _pickled_array()}
    parameters = Parameters(tensors=[b"junk", 42], tensor_type="numpy.ndarray")  # not even bytes
    return [(FakeProxy("103"), altered(res, parameters=parameters if res.parameters.tensors else None, **metrics))]


def attack_not_a_mapping(strategy, res):
    bad = FitRes(OK, res.parameters, res.num_examples, res.metrics)
    bad.metrics = [("partition-id", 3)]
    return [(FakeProxy("103"), bad)]


def _upload_name(strategy):
    return sorted(strategy.upload_specs())[0]


def attack_missing_upload(strategy, res):
    metrics = {k: v for k, v in res.metrics.items() if k != _upload_name(strategy)}
    return [(FakeProxy("103"), FitRes(OK, res.parameters, res.num_examples, metrics))]


def _upload_replaced(strategy, res, change):
    name = _upload_name(strategy)
    bad = change(np.load(io.BytesIO(res.metrics[name])))
    metrics = {k: v for k, v in res.metrics.items() if k != name} | {name: encode_array(bad)}
    return [(FakeProxy("103"), FitRes(OK, res.parameters, res.num_examples, metrics))]


def attack_non_finite_upload(strategy, res):
    return _upload_replaced(strategy, res, lambda a: a * np.inf)


def attack_reshaped_upload(strategy, res):
    return _upload_replaced(strategy, res, lambda a: np.concatenate([a.ravel(), a.ravel()]))


def attack_retyped_upload(strategy, res):
    return _upload_replaced(strategy, res, lambda a: a.astype(np.float64 if a.dtype == np.float32 else np.float32))


def attack_huge_upload(strategy, res):  # finite, the right shape: caught by the magnitude screen
    return _upload_replaced(strategy, res, lambda a: (a * 1e6).astype(a.dtype))


UPLOAD_ATTACKS = ("missing_upload", "non_finite_upload", "reshaped_upload", "retyped_upload", "huge_upload")
ATTACKS = {f.__name__[len("attack_"):]: f for f in (
    attack_missing_upload, attack_non_finite_upload, attack_reshaped_upload, attack_retyped_upload,
    attack_huge_upload,
    attack_huge_class_vector, attack_scaled_parameters, attack_inflated_size, attack_overflowing_counts,
    attack_shifted_counts, attack_twice, attack_other_partition, attack_not_asked, attack_bool_loss,
    attack_malformed_blobs, attack_not_a_mapping, attack_huge_text,
)}


def methods_and_fronts():
    """Every method on the Message API; on the legacy front (the same admission behind another
    transport, a template) a method of each family. Fast: on the Message API parameters only (FedAvg),
    class statistics (FedProto), named uploads (SCAFFOLD), unit-ball prototypes (FedNH); on the legacy
    front FedAvg."""
    fast = {"message": ("fedavg", "fedproto", "scaffold", "fednh"), "legacy": ("fedavg",)}
    run = {"message": sorted(METHODS), "legacy": TEMPLATE_METHODS}
    return [pytest.param(method, front, marks=() if method in fast[front] else pytest.mark.slow)
            for front in fast for method in run[front]]


@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("method, front", methods_and_fronts())
def test_a_hostile_update_is_dropped_and_the_round_ends_as_the_honest_ones_alone(tmp_path, method, front, attack,
                                                                                 caplog):
    """On either front (the Message API's: the same reply in its records, tests/replies.py's
    as_message), against the legacy front's run of the honest replies alone."""
    strategy = make_strategy(method, tmp_path, "attacked", front=front)
    honest = [honest_update(strategy, p) for p in range(N - 1)]
    hostile_reply = honest_update(strategy, HOSTILE)[1]
    if attack in ("huge_class_vector", "overflowing_counts", "shifted_counts") and strategy.options.statistics is None:
        pytest.skip(f"{method} uploads no class statistics")
    if attack in UPLOAD_ATTACKS and not strategy.upload_specs():
        pytest.skip(f"{method} uploads no named arrays")
    if attack == "scaled_parameters" and not strategy.shared_weights():
        pytest.skip(f"{method} shares no parameters")
    if attack == "malformed_blobs" and exchanges_nothing(strategy):
        pytest.skip(f"{method} sends nothing to malform")
    sent = ATTACKS[attack](strategy, hostile_reply)
    parameters, metrics = aggregate_fit(strategy, 1, honest[:2] + sent + honest[2:])  # must not raise

    reference = make_strategy(method, tmp_path, "honest")
    accepted = honest + sent[:1] if attack == "twice" else honest  # the first of two replies counts
    reference_parameters, _ = reference.aggregate_fit(1, accepted, [])
    assert metrics["accepted"] == len(accepted)
    assert_same_state(server_state(strategy, parameters), server_state(reference, reference_parameters))
    for array in strategy.broadcast(2).values():
        assert np.isfinite(array).all()
    record = json.loads((tmp_path / "attacked" / "results.json").read_text())["rounds"][0]
    assert len(record["dropped"]) == len(sent) - (attack == "twice")
    assert all(0 < len(d["reason"]) <= 303 and d["node"] in ("103", "999") for d in record["dropped"])
    assert len(caplog.text) < 10**5


@pytest.mark.parametrize("method", METHODS)
def test_big_endian_arrays_are_read_as_the_same_values(tmp_path, method):
    strategy = make_strategy(method, tmp_path, "big-endian")
    replies = [honest_update(strategy, p) for p in range(N)]
    proxy, res = replies[HOSTILE]
    swapped = {k: encode_array(np.load(io.BytesIO(v)).astype(np.load(io.BytesIO(v)).dtype.newbyteorder(">")))
               for k, v in res.metrics.items() if isinstance(v, bytes)}
    tensors = [encode_array(a.astype(a.dtype.newbyteorder(">"))) for a in parameters_to_ndarrays(res.parameters)]
    replies[HOSTILE] = (proxy, altered(res, parameters=Parameters(tensors, "numpy.ndarray"), **swapped))
    parameters, metrics = strategy.aggregate_fit(1, replies, [])
    reference = make_strategy(method, tmp_path, "native")
    reference_parameters, _ = reference.aggregate_fit(1, [honest_update(reference, p) for p in range(N)], [])
    assert metrics["accepted"] == N
    assert_same_state(server_state(strategy, parameters), server_state(reference, reference_parameters))
    for array in parameters_to_ndarrays(parameters) if parameters.tensors else []:
        assert array.dtype.isnative
    if strategy.has_global_model:  # the crash of the issue: the server's own evaluation of the aggregate
        strategy.global_test = reference.global_test = load_dataset_tensors()
        assert strategy.evaluate(1, parameters) == reference.evaluate(1, reference_parameters)


def load_dataset_tensors():
    import torch

    test = load_dataset("digits").test
    return torch.from_numpy(test.images[:50]), torch.from_numpy(test.labels[:50])


def test_the_screen_compares_class_vectors_among_clients_of_one_architecture(tmp_path):
    """HtFE2: clients 1 and 3 run a ResNet whose features are 12x longer than the CNN's of 0 and 2
    (measured: 25 vs 2.3 on CIFAR). Honest: nobody dropped; a scaled ResNet client still is."""
    strategy = make_strategy("fedsa", tmp_path, "family", model="htfe2")
    replies = [honest_update(strategy, p) for p in range(N)]
    for p in (1, 3):
        proxy, res = replies[p]
        replies[p] = (proxy, altered(res, **{CLASS_MEANS: encode_array(12 * class_means_of(res))}))
    _, metrics = strategy.aggregate_fit(1, replies, [])
    assert metrics["accepted"] == N
    strategy.admission.asked = {str(100 + p): p for p in range(N)}
    proxy, res = replies[3]
    replies[3] = (proxy, altered(res, **{CLASS_MEANS: encode_array(100 * class_means_of(res))}))
    _, metrics = strategy.aggregate_fit(2, replies, [])
    record = json.loads((tmp_path / "family" / "results.json").read_text())["rounds"][1]
    assert metrics["accepted"] == N - 1 and [d["partition"] for d in record["dropped"]] == [3]


@pytest.mark.parametrize("method", [m for m in METHODS if uploads_class_statistics(m)])
def test_a_huge_class_vector_without_the_screen_cannot_make_a_broadcast_non_finite(tmp_path, method):
    """Screen off: the 1e21 row reaches the server rule (FedSKC's GDA weights were 0/0 there); what
    goes out is finite, or the round keeps the previous state."""
    strategy = make_strategy(method, tmp_path, "unscreened", screen_factor=0.0)
    replies = [honest_update(strategy, p) for p in range(N - 1)]
    replies += attack_huge_class_vector(strategy, honest_update(strategy, HOSTILE)[1])
    parameters, _ = strategy.aggregate_fit(1, replies, [])
    for array in list(strategy.broadcast(2).values()) + (parameters_to_ndarrays(parameters) if parameters else []):
        assert np.isfinite(array).all()


@pytest.mark.parametrize("method", METHODS)
def test_a_non_finite_aggregate_keeps_the_previous_global_state(tmp_path, method, monkeypatch):
    strategy = make_strategy(method, tmp_path, "kept")
    if exchanges_nothing(strategy):
        pytest.skip(f"{method} computes nothing on the server")
    first, _ = strategy.aggregate_fit(1, [honest_update(strategy, p) for p in range(N)], [])
    before = server_state(strategy, first)
    rule = type(strategy).aggregate_updates

    def poisoned_rule(self, server_round, updates):
        result = rule(self, server_round, updates)
        for name in self.state_fields:  # the state a method keeps goes non-finite too
            setattr(self, name, _nan(getattr(self, name)))
        return [a * np.nan if a.dtype.kind == "f" else a for a in result] if result is not None else None

    monkeypatch.setattr(type(strategy), "aggregate_updates", poisoned_rule)
    strategy.admission.asked = {str(100 + p): p for p in range(N)}
    parameters, metrics = strategy.aggregate_fit(2, [honest_update(strategy, p, 2) for p in range(N)], [])
    if strategy.shared_weights():
        assert parameters is None  # Flower keeps the previous parameters
        parameters = first
    assert_same_state(server_state(strategy, parameters), before)
    record = json.loads((tmp_path / "kept" / "results.json").read_text())["rounds"][1]
    assert "not finite" in record["kept_previous"]


def _nan(value):
    if isinstance(value, np.ndarray):
        return value * np.nan if value.dtype.kind == "f" else value
    if isinstance(value, ClassVectors):
        return ClassVectors(value.vectors * np.nan, value.mask)
    if isinstance(value, dict):
        return {k: _nan(v) for k, v in value.items()}
    return [_nan(v) for v in value] if isinstance(value, list) else value


def test_a_failing_server_rule_keeps_the_state_and_the_run(tmp_path, monkeypatch):
    strategy = make_strategy("fedskc", tmp_path, "failing")
    strategy.aggregate_fit(1, [honest_update(strategy, p) for p in range(N)], [])
    knowledge = strategy.knowledge

    def failing(self, server_round, updates):
        self.knowledge = None  # half-way through, then it raises
        raise FloatingPointError("boom")

    monkeypatch.setattr(type(strategy), "aggregate_updates", failing)
    parameters, _ = strategy.aggregate_fit(2, [honest_update(strategy, p, 2) for p in range(N)], [])
    assert parameters is None
    np.testing.assert_array_equal(strategy.knowledge.vectors, knowledge.vectors)
    record = json.loads((tmp_path / "failing" / "results.json").read_text())["rounds"][1]
    assert record["kept_previous"] == "the server rule failed: FloatingPointError: boom"


# --- evaluation results ------------------------------------------------------------------------


def evaluation(strategy, pid, correct, **extra):
    num_test = strategy.discovery.registry.sizes(pid).num_test
    metrics = {"correct": correct, "partition-id": pid, **extra}
    return FakeProxy(str(100 + pid)), EvaluateRes(OK, 0.5, num_test, metrics)


@pytest.mark.parametrize("attack", ["inflated", "bool", "missing-correct", "negative-loss", "twice", "other-size",
                                    "invented-predictors"])
def test_a_hostile_evaluation_is_dropped_and_the_round_keeps_its_pm(tmp_path, attack):
    strategy = make_strategy("fedproto", tmp_path, "evaluated")
    honest = [evaluation(strategy, p, strategy.discovery.registry.sizes(p).num_test // 2) for p in range(N - 1)]
    proxy, res = evaluation(strategy, HOSTILE, 1)
    sent = {
        "inflated": [(proxy, EvaluateRes(OK, 0.0, 10**12, {"correct": 10**12}))],
        "bool": [(proxy, EvaluateRes(OK, 0.1, res.num_examples, {"correct": True}))],
        "missing-correct": [(proxy, EvaluateRes(OK, 0.1, res.num_examples, {"pm-l": 0.5}))],
        "negative-loss": [(proxy, EvaluateRes(OK, -1e9, res.num_examples, {"correct": 1}))],
        "twice": [(proxy, res), (proxy, EvaluateRes(OK, 0.0, res.num_examples, {"correct": res.num_examples}))],
        "other-size": [(proxy, EvaluateRes(OK, 0.0, res.num_examples - 1, {"correct": res.num_examples - 1}))],
        "invented-predictors": [(proxy, EvaluateRes(OK, 0.1, res.num_examples, {"correct": 1} | {
            f"correct-x{i}": 0 for i in range(1000)}))],  # each would be a column of results.json
    }[attack]
    _, metrics = strategy.aggregate_evaluate(1, honest + sent, [])
    kept = honest + sent[:1] if attack == "twice" else honest
    correct = sum(r.metrics["correct"] for _, r in kept)
    assert metrics["personalized_accuracy"] == pytest.approx(correct / sum(r.num_examples for _, r in kept))
    record = json.loads((tmp_path / "evaluated" / "results.json").read_text())["rounds"][0]
    assert [d["stage"] for d in record["dropped"]] == ["evaluate"]
    assert not [key for key in record if key.startswith("personalized_accuracy_x")]  # no column it invented


def test_a_predictor_one_client_leaves_out_is_scored_over_the_others(tmp_path):
    strategy = make_strategy("fedproto", tmp_path, "predictors")
    results = [evaluation(strategy, p, 1, **{"correct-head": 2}) for p in range(N - 1)]
    results.append(evaluation(strategy, HOSTILE, 1))  # no correct-head
    _, metrics = strategy.aggregate_evaluate(1, results, [])
    tested = [strategy.discovery.registry.sizes(p).num_test for p in range(N)]
    assert metrics["personalized_accuracy"] == pytest.approx(N / sum(tested))
    assert metrics["personalized_accuracy_head"] == pytest.approx(2 * (N - 1) / sum(tested[: N - 1]))


# --- whole runs in process: discovery and DP ----------------------------------------------------

RUN = {"num-server-rounds": 2, "local-epochs": 1, "global-test-pm": False, "min-fit-clients": 1, "batch-size": 32}


@pytest.mark.parametrize("front", ["message", pytest.param("legacy", marks=pytest.mark.slow)])
@pytest.mark.parametrize("verify", [True, False])
def test_a_stolen_partition_is_given_to_neither_and_a_flaky_node_is_asked_again(tmp_path, caplog, verify, front):
    """Node 1002 holds partition 2 and claims partition 0 (with its own sizes); node 1003's first
    answer is lost."""
    from inprocess import InProcessProxy, run_in_process

    from protofl.client_app import PrototypeClientApp

    config = RUN | {"method": "fedproto", "verify-partitions": verify, "output-dir": str(tmp_path), "run-name": "run",
                    "flower-api": front}
    answered = []
    if front == "legacy":
        class Thief(InProcessProxy):
            def get_properties(self, ins, timeout, group_id):
                reply = super().get_properties(ins, timeout, group_id)
                reply.properties["partition-id"] = 0
                return reply

        class Flaky(InProcessProxy):
            def get_properties(self, ins, timeout, group_id):
                if not answered:
                    answered.append(1)
                    raise TimeoutError("no answer")
                return super().get_properties(ins, timeout, group_id)

        nodes = {2: Thief, 3: Flaky}
        run_in_process(config, num_nodes=4, node_class=lambda p: nodes.get(p, InProcessProxy))
    else:
        honest = PrototypeClientApp(config)

        def thief(message, context):
            reply = honest(message, context)
            if message.metadata.message_type == "query":
                reply.content.config_records["properties"]["partition-id"] = 0
            return reply

        def flaky(message, context):
            if message.metadata.message_type == "query" and not answered:
                answered.append(1)
                raise TimeoutError("no answer")
            return honest(message, context)

        run_in_process(config, num_nodes=4, node_class=lambda p: {2: thief, 3: flaky}.get(p, honest))
    rounds = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"]
    # the flaky node is asked again before round 1: fewer nodes than partitions had answered
    assert "node 1003 did not report its partition" in caplog.text
    if verify:  # the server's copy of partition 0 exposes the thief's sizes
        assert [r["clients"] for r in rounds] == [[0, 1, 3], [0, 1, 3]]
        assert "node 1002 holds no partition: reports" in caplog.text
    else:  # a claim it cannot check: partition 0 goes to neither
        assert [r["clients"] for r in rounds] == [[1, 3], [1, 3]]
        assert "partition 0 is claimed by nodes 1000, 1002: given to neither" in caplog.text


def test_dp_prototypes_report_the_privacy_spent_each_round(tmp_path):
    from inprocess import run_in_process

    from protofl.task.privacy import prototype_epsilon

    config = RUN | {"method": "fedproto", "dp-noise": 2.0, "dp-clip": 1.0, "output-dir": str(tmp_path),
                    "run-name": "dp"}
    strategy, messages = run_in_process(config, num_nodes=2)
    results = json.loads((tmp_path / "dp" / "results.json").read_text())
    rounds, held = results["rounds"], max(results["privacy"]["held_classes"].values())  # test_privacy.py checks k
    assert [r["dp_epsilon"] for r in rounds] == [prototype_epsilon(2.0, [held] * r, 1e-5) for r in (1, 2)]
    uploads = [reply for kind, _, reply in messages if kind == "fit"]
    norms = np.linalg.norm(np.stack([class_means_of(reply) for reply in uploads]), axis=2)
    assert norms.max() > 1.0  # noise on top of the clipped vectors: not the raw means, not clipped only
    assert strategy.global_prototypes is not None and rounds[-1]["personalized_accuracy"] is not None


def test_fedpacs_feature_variance_is_not_screened_by_magnitude_its_head_upload_is(tmp_path):
    """Honest V_i span orders of magnitude (a client of one class, one of ten: 0.01 to 0.7 measured on
    Fashion-MNIST), and a large V_i only lowers that client's weight in the others' heads: the screen
    leaves it out. The same client's head, 1000 x the others', is still dropped."""
    strategy = make_strategy("fedpac", tmp_path, "variance")
    replies = [honest_update(strategy, p) for p in range(N)]
    proxy, res = replies[HOSTILE]
    replies[HOSTILE] = (proxy, altered(res, **{"feature-variance": encode_array(np.array([500.0], np.float32))}))
    _, metrics = strategy.aggregate_fit(1, replies, [])
    assert metrics["accepted"] == N
    head = np.load(io.BytesIO(res.metrics["head/0"])) * 1000
    replies[HOSTILE] = (proxy, altered(res, **{"head/0": encode_array(head)}))
    _, metrics = strategy.aggregate_fit(2, replies, [])
    assert metrics["accepted"] == N - 1


def _factor_attacks():
    """Factor forms of FedKD's m x n head weight that no honest client sends (its shape: m, n)."""
    def decaying(m, n):  # singular values 1, 1/2, 1/4, ...: T = 0.95 keeps 3 ranks; all min(m, n) sent
        rng = np.random.default_rng(0)
        k = min(m, n)
        left, right = np.linalg.qr(rng.normal(size=(m, k)))[0], np.linalg.qr(rng.normal(size=(n, k)))[0].T
        return np.concatenate([(left * 0.5 ** np.arange(k)).ravel(), right.ravel()])

    return {
        "rank_above_min": lambda m, n: np.ones((m + n) * (min(m, n) + 1)),  # more factors than the matrix has
        "infinite_product": lambda m, n: np.full(m + n, 1e30),  # finite factors, a product beyond float32
        "rank_above_energy": decaying,  # every rank, where the round's energy keeps three
    }


@pytest.mark.parametrize("attack", sorted(_factor_attacks()))
def test_fedkd_factors_no_truncation_makes_are_dropped(tmp_path, attack):
    strategy = make_strategy("fedkd", tmp_path, "factors")
    replies = [honest_update(strategy, p) for p in range(N)]
    proxy, res = replies[HOSTILE]
    sent = parameters_to_ndarrays(res.parameters)
    head = next(i for i, r in enumerate(strategy.shared_weights()) if strategy.compressed(i) and r.ndim == 2)
    sent[head] = _factor_attacks()[attack](*strategy.shared_weights()[head].shape).astype(np.float32)
    replies[HOSTILE] = (proxy, altered(res, parameters=ndarrays_to_parameters(sent)))
    _, metrics = strategy.aggregate_fit(1, replies, [])
    assert metrics["accepted"] == N - 1
    record = json.loads((tmp_path / "factors" / "results.json").read_text())["rounds"][0]
    assert [d["partition"] for d in record["dropped"]] == [HOSTILE]
    assert len(record["mentee_ranks"]["up"]) == N - 1
