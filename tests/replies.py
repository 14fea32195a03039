"""Fit replies for strategy tests: a strategy after discovery (four nodes holding the four partitions
of digits), an honest reply of each method, and ways to alter one."""

import io

import numpy as np
from fakes import OK, FakeProxy
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import FitRes, Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from inprocess import as_serverapp

from protofl.federation.message_front import message_strategy
from protofl.federation.message_records import NUMPY
from protofl.federation.partitions import PartitionClaim
from protofl.federation.wire import CLASS_MEANS, ClassStatistics, encode_array, indexed
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model, get_method, method_rule
from protofl.strategies.fedgen import LABEL_COUNTS
from protofl.strategies.fedkd import factor_form
from protofl.strategies.scaffold import step_multipliers
from protofl.task.data import load_dataset, partition_sizes
from protofl.task.train import steps_per_epoch

N = 4
EXTRA_METRICS = {  # what each method's clients report besides the template's keys
    "fedcosr": {"la-tau": 0.5, "contrastive-loss": 0.3, "ce-loss": 0.7},
    "fedsa": {"regularization-loss": 0.1, "margin-contrastive-loss": 0.2, "calibration-loss": 0.3},
    "fedsc": {"rpcl-loss": 0.4, "cpdr-loss": 0.1},
    "fedskc": {"lcl-loss": 0.5},
    "fedprox": {"proximal-loss": 0.01},
    "moon": {"contrastive-loss": 0.6},
    "fedntd": {"ntd-loss": 0.2},
    "fedrcl": {"contrastive-loss": 1.2, "penalty-loss": 0.05},
}


# CReFF's server trains for 400 epochs a round by default: 2 of each exercise the same code
QUICK_OPTIONS = {"creff": {"match-epochs": 2, "retrain-epochs": 2}, "fedgen": {"server-epochs": 2},
                 "fedtgp": {"server-epochs": 2}}


def settings_for(method, tmp_path, name, **overrides):
    overrides = {"model": "fednh-cnn" if method == "fednh" else "cnn",
                 "options": QUICK_OPTIONS.get(method, {})} | overrides
    return ExperimentSettings(method=method, output_dir=str(tmp_path), run_name=name, min_fit_clients=2, **overrides)


def make_strategy(method, tmp_path, name="run", front="legacy", **overrides):
    """A strategy after discovery: nodes 100..103 claim partitions 0..3 with their real sizes; on
    the legacy front or (``front="message"``) the Message API's."""
    settings = settings_for(method, tmp_path, name, **overrides)
    dataset = load_dataset("digits")
    strategy_class = message_strategy(method_rule(method)) if front == "message" else get_method(method)[0]

    def sizes(n, pid):
        return partition_sizes("digits", "", settings.partition_spec(n), pid)

    strategy = strategy_class(settings, build_method_model(settings, dataset), 10, partition_sizes=sizes)
    for p in range(N):
        expected = sizes(N, p)
        claim = PartitionClaim(p, N, int(expected.train_counts.sum()), expected.num_test)
        strategy.discovery.registry.claims[str(100 + p)] = claim
    strategy.discovery.registry.freeze()
    holders = strategy.discovery.registry.holders(strategy.discovery.registry.claims)
    strategy.discovery.nodes = {p: FakeProxy(node) for p, node in holders.items()}
    strategy.sampled = list(range(N))
    strategy.admission.asked = {str(100 + p): p for p in range(N)}
    return strategy


def exchanges_nothing(strategy):
    """Whether the method's clients send no parameters, class statistics or named arrays (Local)."""
    return not strategy.shared_weights() and strategy.options.statistics is None and not strategy.upload_specs()


def honest_update(strategy, pid, round_=1):
    """A plausible fit reply of partition ``pid``: small parameter changes, unit-scale class vectors,
    and what the method's own math makes of them (SCAFFOLD's control delta, FedKD's factors)."""
    rng = np.random.default_rng(10 * round_ + pid)
    parameters = [(w + rng.normal(0, 0.01, w.shape)).astype(w.dtype) if w.dtype.kind == "f" else w.copy()
                  for w in strategy.shared_weights()]
    method = strategy.settings.method
    if method == "fedkd":  # Eq. 7-8: the mentee goes up compressed with the round's energy
        parameters = [factor_form(a, strategy.options.energy(round_)) if trained else a
                      for a, trained in zip(parameters, strategy.trained_entries)]
    counts = strategy.discovery.registry.sizes(pid).train_counts
    dim = strategy.options.statistics_dim(10, strategy.feature_dim)
    metrics = {"partition-id": pid, "train-loss": 1.0, **EXTRA_METRICS.get(method, {})}
    for name, spec in strategy.upload_specs().items():  # the method's named uploads (SCAFFOLD's, FedGen's counts)
        honest = counts if name == LABEL_COUNTS else rng.normal(0, 0.01, spec.shape)
        honest = np.abs(honest) if spec.nonnegative else honest  # (FedPAC's feature variance)
        metrics[name] = encode_array(honest.astype(spec.dtypes[0]))
    if method == "scaffold":
        metrics |= encode_all(indexed("control-delta", honest_control_delta(strategy, parameters, int(counts.sum()),
                                                                          round_)))
    if strategy.options.statistics is not None:
        means = np.zeros((10, dim), np.float32)
        rows = rng.normal(1.0, 0.2, (10, dim)) / np.sqrt(dim)  # norm about 1, within FedNH's unit ball
        means[counts > 0] = (rows / np.maximum(1.0, np.linalg.norm(rows, axis=1, keepdims=True)))[counts > 0]
        metrics |= ClassStatistics(means, counts).to_metrics()
    return FakeProxy(str(100 + pid)), FitRes(OK, ndarrays_to_parameters(parameters), int(counts.sum()), metrics)


def honest_control_delta(strategy, parameters, num_examples, round_):
    """SCAFFOLD's Delta c = c_i+ - c_i = (x - y) / (K eta) - c (Algorithm 1, lines 12-13, option II):
    what the parameters ``y`` trained from ``x`` in K steps of lr eta make it, whatever c_i was."""
    s = strategy.settings
    steps = step_multipliers(s.local_epochs * steps_per_epoch(num_examples, s.batch_size, s.partial_batch), s.momentum)
    trained = [(x, y) for x, y, t in zip(strategy.admission.sent_parameters, parameters, strategy.trained_entries) if t]
    return [((x.astype(np.float64) - y) / (steps * s.round_lr(round_)) - c).astype(c.dtype)
            for (x, y), c in zip(trained, strategy.control)]


def encode_all(arrays):
    return {k: encode_array(v) for k, v in arrays.items()}


def class_means_of(res):
    return np.load(io.BytesIO(res.metrics[CLASS_MEANS]))


def altered(res, parameters=None, num_examples=None, **metrics):
    return FitRes(OK, parameters if parameters is not None else res.parameters,
                  res.num_examples if num_examples is None else num_examples, res.metrics | metrics)


def scaled_parameters(strategy, res, factor):
    arrays = parameters_to_ndarrays(res.parameters)
    return ndarrays_to_parameters([
        (s + factor * (a - s)).astype(a.dtype) if a.dtype.kind == "f" else a
        for a, s in zip(arrays, strategy.shared_weights())
    ])


def server_state(strategy, parameters):
    arrays = parameters_to_ndarrays(parameters) if parameters is not None and parameters.tensors else []
    return arrays, strategy.broadcast(2)


def assert_same_state(a, b):
    (arrays_a, sent_a), (arrays_b, sent_b) = a, b
    assert len(arrays_a) == len(arrays_b) and set(sent_a) == set(sent_b)
    for x, y in zip(arrays_a, arrays_b):
        np.testing.assert_array_equal(x, y)
    for key in sent_a:
        np.testing.assert_array_equal(sent_a[key], sent_b[key])


def as_message(strategy, proxy, res):
    """A legacy fit reply as a client sends it on the Message API: its blobs as arrays (under the
    server's names of the shared entries) and uploads, its numbers in the metrics, its strings and
    flags in the config; what no record can hold (metrics that are no mapping, an entry that is no
    bytes) as near as a client can get (no records; an entry of another serialization)."""
    as_serverapp()
    instruction = Message(RecordDict(), int(proxy.cid), "train")
    if not isinstance(res.metrics, dict):
        return Message(RecordDict(), reply_to=instruction)
    entries = [Array("float32", (), NUMPY, t) if isinstance(t, bytes) else Array("", (), "unknown", b"")
               for t in res.parameters.tensors]
    names = strategy.shared_names + [f"extra-{i}" for i in range(len(entries) - len(strategy.shared_names))]
    numbers, others, uploads = {"num-examples": res.num_examples}, {}, {}
    for key, value in res.metrics.items():
        if isinstance(value, bytes):
            uploads[key] = Array("float32", (), NUMPY, value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers[key] = value
        else:
            others[key] = value
    if not isinstance(res.num_examples, int) or isinstance(res.num_examples, bool):
        others["num-examples"] = numbers.pop("num-examples")
    records = {"arrays": ArrayRecord(dict(zip(names, entries))), "metrics": MetricRecord(numbers),
               "config": ConfigRecord(others)} | ({"uploads": ArrayRecord(uploads)} if uploads else {})
    return Message(RecordDict(records), reply_to=instruction)


def aggregate_fit(strategy, server_round, results):
    """The strategy's aggregate of ``results`` (legacy fit replies) on its front: (the new shared
    entries as legacy ``Parameters``, or None; the round's metrics)."""
    if not hasattr(strategy, "aggregate_train"):
        return strategy.aggregate_fit(server_round, results, [])
    arrays, metrics = strategy.aggregate_train(server_round, [as_message(strategy, *pair) for pair in results])
    if arrays is None:
        return None, dict(metrics)
    return Parameters([array.data for array in arrays.values()], "numpy.ndarray"), dict(metrics)
