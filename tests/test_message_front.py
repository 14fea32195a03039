"""The Message-API front (``flower-api = "message"``): the same round records as the legacy front,
what Flower's own FedAvg makes of the same replies, and records no honest client sends dropped
with their reason while the round goes on."""

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from inprocess import as_serverapp, run_message_in_process
from round_records import RUN, cases, round_records
from test_round_records import EXPECTED, differences

from protofl.client_app import PrototypeClientApp
from protofl.federation.message_records import NUMPY, read_reply
from protofl.federation.wire import encode_array

CASES = cases()


# class vectors, the scores carried in the fit message (FedProto); tests/test_round_records.py (slow)
# runs every case on both fronts
@pytest.mark.parametrize("name", ["fedproto"])
def test_the_message_front_gives_the_legacy_fronts_round_records(name, tmp_path):
    found = differences(round_records(CASES[name] | {"flower-api": "message"}, tmp_path), EXPECTED["cases"][name])
    assert found == [], f"{name} on the Message API: {found[:5]}"


def test_fedavg_aggregates_as_flowers_own_fedavg_on_the_same_replies(tmp_path):
    config = RUN | {"method": "fedavg", "num-server-rounds": 2, "output-dir": str(tmp_path), "run-name": "run"}
    _, messages = run_message_in_process(config)
    trains = [(instruction.message, reply.message) for kind, instruction, reply in messages if kind == "fit"]
    replies = [reply for _, reply in trains[:3]]  # round 1's
    ours = trains[3][0].content["arrays"]  # what round 2 sends: round 1's aggregate

    theirs, metrics = FedAvg().aggregate_train(1, replies)
    assert theirs is not None, "Flower's FedAvg found the replies inconsistent"
    assert list(theirs) == list(ours)
    sent = [reply.content["arrays"] for reply in replies]
    for name in ours:
        # three float32 terms, summed in float32 (Flower) or rounded once (protofl): a few ulps apart
        largest = max(np.abs(record[name].numpy()).max() for record in sent)
        np.testing.assert_allclose(ours[name].numpy(), theirs[name].numpy(), rtol=0,
                                   atol=4 * np.finfo(np.float32).eps * largest, err_msg=name)
    recorded = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"][0]
    assert metrics["train-loss"] == pytest.approx(recorded["train_loss"], rel=1e-6)


def hostile_records(honest):
    """Records an honest client never sends, each made from an honest fit reply's content."""
    arrays, metrics = honest["arrays"], honest["metrics"]
    first = next(iter(arrays))

    def replaced(**records):
        return RecordDict({"arrays": arrays, "metrics": metrics} | records)

    return {
        "no records": RecordDict(),
        "an entry the server did not send": replaced(arrays=ArrayRecord(
            {**{k: arrays[k] for k in arrays}, "extra": Array(np.zeros(1, np.float32))})),
        "an entry missing": replaced(arrays=ArrayRecord({k: arrays[k] for k in list(arrays)[1:]})),
        "a torch-serialized entry": replaced(arrays=ArrayRecord(
            {k: Array(arrays[k].dtype, arrays[k].shape, "torch.Tensor", arrays[k].data) for k in arrays})),
        "a pickled entry": replaced(arrays=ArrayRecord(
            {k: Array("object", (1,), NUMPY, b"\x80\x04]\x94.") if k == first else arrays[k] for k in arrays})),
        "a key sent twice": replaced(config=ConfigRecord({"train-loss": 0.5})),
        "a list for a size": replaced(metrics=MetricRecord(dict(metrics) | {"num-examples": [1, 2]})),
        "a float for a size": replaced(metrics=MetricRecord(dict(metrics) | {"num-examples": 1e12})),
        "the wrong shape under an entry's name": replaced(arrays=ArrayRecord(
            {k: Array(np.zeros(3, np.float32)) if k == first else arrays[k] for k in arrays})),
    }


# what the reason of a drop names, where the records alone say what is wrong
REASONS = {"an entry the server did not send": "holds ['extra']", "an entry missing": "and lacks [",
           "a torch-serialized entry": "is not a numpy array", "a key sent twice": "sent twice (in config)"}
HOSTILE_RECORDS = sorted(hostile_records(RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(1))}),
                                                      "metrics": MetricRecord({"num-examples": 1})})))


@pytest.mark.parametrize("attack", HOSTILE_RECORDS)
def test_records_no_honest_client_sends_are_dropped_and_the_round_goes_on(tmp_path, attack):
    config = RUN | {"method": "fedavg", "num-server-rounds": 1, "output-dir": str(tmp_path), "run-name": "run",
                    "min-fit-clients": 2, "flower-api": "message"}
    honest_app = PrototypeClientApp(config)

    def node_app(partition_id):
        if partition_id != 2:
            return honest_app

        def hostile(message, context):
            reply = honest_app(message, context)
            if message.metadata.message_type != "train":
                return reply
            return Message(hostile_records(reply.content)[attack], reply_to=message)

        return hostile

    run_message_in_process(config, node_app=node_app)
    rounds = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [1]
    for record in rounds:
        dropped = [d for d in record["dropped"] if d["stage"] == "fit"]
        assert [(d["node"], d["partition"]) for d in dropped] == [("1002", 2)], record["dropped"]
        assert 0 < len(dropped[0]["reason"]) <= 303
        assert REASONS.get(attack, "") in dropped[0]["reason"]


def test_a_reply_is_read_without_raising_whatever_it_holds():
    as_serverapp()
    instruction = Message(RecordDict(), 7, "train")
    content = RecordDict({"metrics": MetricRecord({"num-examples": 3, "train-loss": 0.5}),
                          "config": ConfigRecord({"compute": "{}", "flag": True}),
                          "uploads": ArrayRecord({"class-counts": Array(np.arange(2))}),
                          "arrays": ArrayRecord({"b": Array(np.ones(2, np.float32)), "a": Array(np.zeros(1))})})
    reply = read_reply(Message(content, reply_to=instruction), ["a", "b"])
    assert reply.problem is None and reply.num_examples == 3
    assert reply.metrics == {"train-loss": 0.5, "compute": "{}", "flag": True,
                             "class-counts": encode_array(np.arange(2))}
    assert reply.parameters.tensors == [encode_array(np.zeros(1)), encode_array(np.ones(2, np.float32))]
    assert "lacks ['c']" in read_reply(Message(content, reply_to=instruction), ["a", "b", "c"]).problem
