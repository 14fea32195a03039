"""Experiment tracking (protofl/tracking.py): the `tracker` key, what a run sends and when, the error
for a missing extra, and runs read back through each tool's own reader (TensorBoard's
EventAccumulator, MLflow's client, W&B's offline run file), fresh and resumed; a deployment's
ServerApp tracks as well (tests/test_deployment.py, on the insecure deployment's run)."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.common.config import parse_config_args
from inprocess import run_in_process

from protofl.report import TIMING_FIELDS, RunRecorder
from protofl.settings import ExperimentSettings
from protofl.tracking import (
    Tracker,
    Tracking,
    build_tracker,
    hyper_parameters,
    round_scalars,
    tracker_names,
)

TESTS = Path(__file__).resolve().parent
RUN = {"dataset": "digits", "local-epochs": 1, "global-test-pm-per-class": 10}


# --- the run-config key -------------------------------------------------------------------------


def test_tracker_is_a_comma_separated_list_of_known_names():
    assert tracker_names("") == ()
    assert tracker_names("tensorboard") == ("tensorboard",)
    assert tracker_names(" MLflow , tensorboard,,mlflow ") == ("mlflow", "tensorboard")
    with pytest.raises(ValueError, match=r"unknown 'tensorbord', 'neptune'; the trackers are tensorboard, mlflow, wandb"):
        tracker_names("tensorbord,mlflow,neptune")


def test_the_run_config_takes_the_form_flwr_run_accepts_and_names_a_bad_tracker():
    parsed = parse_config_args(["tracker='tensorboard,mlflow' mlflow-uri='http://127.0.0.1:5000'"])
    settings = ExperimentSettings.from_run_config(parsed)
    assert (settings.tracker, settings.mlflow_uri) == ("tensorboard,mlflow", "http://127.0.0.1:5000")
    with pytest.raises(ValueError, match="needs to be of type"):  # Flower's run config holds no lists
        parse_config_args(["tracker=['tensorboard','mlflow']"])
    with pytest.raises(ValueError, match="unknown 'wandbb'"):
        ExperimentSettings.from_run_config({"tracker": "wandbb"})
    with pytest.raises(ValueError, match="tracker must be a string"):
        ExperimentSettings.from_run_config({"tracker": ["tensorboard"]})


# --- what is sent -------------------------------------------------------------------------------


def test_a_round_is_sent_as_its_numbers_and_lists_as_their_lengths():
    record = {"round": 3, "global_accuracy": 0.5, "personalized_accuracy": None, "bytes_up": 1200,
              "rejected": 1, "dropped": [{"reason": "a"}, {"reason": "b"}], "clients": [0, 2, 5],
              "kept_previous": "the aggregate is not finite"}
    assert round_scalars(record) == {"global_accuracy": 0.5, "bytes_up": 1200.0, "rejected": 1.0,
                                     "dropped": 2.0, "clients": 3.0}


def test_hyper_parameters_are_the_run_config_by_its_keys():
    settings = ExperimentSettings(method="fedproto", num_server_rounds=5, options={"lambda": 2.0})
    parameters = hyper_parameters(settings.as_dict())
    assert parameters["num-server-rounds"] == 5 and parameters["fedproto.lambda"] == 2.0
    assert parameters["method"] == "fedproto" and parameters["tracker"] == ""
    assert "options" not in parameters and "num_server_rounds" not in parameters


class Recording(Tracker):
    """A tracker that keeps what it is sent."""

    name = "recording"

    def __init__(self, directory, fail_at=None):
        super().__init__(directory)
        self.sent, self.files, self.failed, self.fail_at = [], None, None, fail_at
        self.started = None

    def start(self, run_name, parameters, saved, replay_from):
        self.started = (run_name, saved, replay_from)
        self.state = {"id": "r1"}
        return saved is not None

    def log(self, server_round, scalars):
        if server_round == self.fail_at:
            raise OSError("disk full")
        self.sent.append((server_round, scalars))

    def finish(self, files, failed):
        self.files, self.failed = [f.name for f in files], failed


def test_each_round_goes_out_once_whole_and_in_order_and_a_failing_tracker_does_not_end_the_run(tmp_path, caplog):
    recording, failing = Recording(tmp_path), Recording(tmp_path, fail_at=2)
    failing.name = "failing"
    recorder = RunRecorder(tmp_path / "run", ExperimentSettings().as_dict(), Tracking([recording, failing]))
    recorder.start_tracking()
    assert recording.started == ("run", None, None) and recorder.extra["tracking"] == {
        "recording": {"id": "r1"}, "failing": {"id": "r1"}}
    recorder.update(1, train_loss=1.0)
    recorder.track(1)  # round 1 is not complete before round 2 ends
    assert recording.sent == []
    recorder.update(2, train_loss=0.5)
    recorder.update(1, personalized_accuracy=0.7)  # round 1's scores arrive in round 2's fit message
    recorder.track(2)
    assert recording.sent == [(1, {"train_loss": 1.0, "personalized_accuracy": 0.7})]
    recorder.update(3, train_loss=0.25)
    recorder.track(3)
    assert "tracker failing failed (OSError: disk full); the run goes on without it" in caplog.text
    recorder.write(plot=True)
    recorder.finish_tracking()
    assert [r for r, _ in recording.sent] == [1, 2, 3]
    assert recording.files == ["results.json", "metrics.csv", "accuracy.png"] and recording.failed is False
    assert failing.files is None  # dropped: not asked to finish


def test_a_crash_does_not_send_the_round_it_cut_short(tmp_path):
    recording = Recording(tmp_path)
    recorder = RunRecorder(tmp_path / "run", {}, Tracking([recording]))
    recorder.start_tracking()
    recorder.update(1, train_loss=1.0)
    recorder.update(2, bytes_down=100)  # round 2 had sent its instructions when the process failed
    recorder.finish_tracking(crashed=True)
    assert [r for r, _ in recording.sent] == [1] and recording.failed is True


def test_a_resumed_run_continues_its_trackers_after_the_checkpoints_round(tmp_path):
    """The rounds before the checkpoint's were sent before it was written; from its round on they go
    out again (the tracker drops or skips what it holds). A tracker new to the run gets them all."""
    known, new = Recording(tmp_path), Recording(tmp_path)
    new.name = "new"
    recorder = RunRecorder(tmp_path / "run", {}, Tracking([known, new]))
    saved = {"rounds": [{"round": r, "train_loss": 1.0 / r} for r in (1, 2, 3)], "started": "t",
             "run_config": {}, "tracking": {"recording": {"id": "r1"}}}
    recorder.restore(saved, resumed_after=3)
    recorder.start_tracking()
    assert known.started == ("run", {"id": "r1"}, 3) and new.started == ("run", None, 3)
    recorder.update(4, train_loss=0.1)
    recorder.track(5)
    assert [r for r, _ in known.sent] == [3, 4] and [r for r, _ in new.sent] == [1, 2, 3, 4]


@pytest.mark.parametrize("tracker, module", [
    ("tensorboard", "torch.utils.tensorboard"), ("mlflow", "mlflow"), ("wandb", "wandb"),
])
def test_a_missing_extra_is_named_before_anything_runs(tmp_path, monkeypatch, tracker, module):
    monkeypatch.setitem(sys.modules, module, None)  # as if the package were not installed
    with pytest.raises(ImportError, match=rf"tracker '{tracker}' needs .*: pip install 'protofl\[{tracker}\]'"):
        build_tracker(tracker, tmp_path)
    from protofl.server_app import make_server_fn

    config = {"tracker": f"{tracker}", "output-dir": str(tmp_path), "run-name": "r"}
    with pytest.raises(ImportError, match=rf"protofl\[{tracker}\]"):
        make_server_fn(config)(None)
    assert not (tmp_path / "r").exists()


# --- read back with each tool's reader ----------------------------------------------------------


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's view of a log directory: each tag's (step, value) points."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def mlflow_metrics(results: dict) -> dict[str, list[tuple[int, float]]]:
    """The MLflow run that results.json names: each metric's (step, value) history."""
    from mlflow import MlflowClient

    state = results["tracking"]["mlflow"]
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    run = client.get_run(state["run_id"])
    return {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
            for key in run.data.metrics}


def expected_points(results: dict) -> dict[str, list[tuple[int, float]]]:
    """What a tracker should hold of ``results``: each round's scalars, by key."""
    points: dict[str, list[tuple[int, float]]] = {}
    for record in results["rounds"]:
        for key, value in round_scalars(record).items():
            points.setdefault(key, []).append((record["round"], value))
    return points


def without_timing(points: dict) -> dict:
    return {key: value for key, value in points.items() if key not in TIMING_FIELDS}


def assert_same_points(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert [s for s, _ in got[key]] == [s for s, _ in want[key]], key  # each round once, in order
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in want[key]], rel=1e-6), key


@pytest.mark.slow  # three in-process runs with both trackers writing: ~5 s
def test_tensorboard_and_mlflow_read_back_every_round_and_a_resumed_run_continues_them(tmp_path):
    pytest.importorskip("tensorboard", reason="the test extra installs tensorboard")
    pytest.importorskip("mlflow", reason="the test extra installs mlflow-skinny")
    config = RUN | {"output-dir": str(tmp_path), "run-name": "run", "tracker": "tensorboard,mlflow",
                    "num-server-rounds": 2}
    run_in_process(config, num_nodes=3, plot=True)  # accuracy.png: an image and an artifact, below
    first = json.loads((tmp_path / "run" / "results.json").read_text())
    run_in_process(config | {"num-server-rounds": 3, "resume": True}, num_nodes=3, plot=True)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["tracking"] == first["tracking"]  # the same tracked runs
    want = expected_points(results)
    assert {"global_accuracy", "personalized_accuracy", "train_loss", "bytes_up", "bytes_down", "rejected",
            "seconds"} <= set(want)
    # round 2's checkpoint size and time are recorded after its checkpoint was taken: the resumed
    # results lack them, MLflow keeps what it had
    assert_same_points(without_timing(tensorboard_scalars(tmp_path / "run" / "tensorboard")), without_timing(want))
    assert_same_points(without_timing(mlflow_metrics(results)), without_timing(want))

    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")
    assert "accuracy" in events.Tags()["images"]
    state = results["tracking"]["mlflow"]
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    run = client.get_run(state["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["method"] == "fedavg"
    assert run.data.params["num-server-rounds"] == "2"  # as the run started
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == [
        "accuracy.png", "metrics.csv", "results.json"]
    artifact = Path(client.download_artifacts(run.info.run_id, "results.json", str(tmp_path)))
    assert json.loads(artifact.read_text())["rounds"] == results["rounds"]


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of a W&B run file (``run-<id>.wandb``: a LevelDB-style log of 32 KiB
    blocks, each record a 7-byte header (CRC, length, type) and a piece of a protobuf Record)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    rows, position, pieces = [], 7, b""
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        piece, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind in (1, 2):  # a whole record, or its first piece
            pieces = piece
        elif kind in (3, 4):
            pieces += piece
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.mark.slow
def test_wandb_writes_an_offline_run_that_a_resumed_run_continues(tmp_path):
    """In child processes (the in-process runner, tests/interrupted.py), so that W&B's service ends
    with them."""
    pytest.importorskip("wandb", reason="W&B is not in the test extra: pip install -e '.[wandb]' to run this")
    config = RUN | {"output-dir": str(tmp_path), "run-name": "run", "tracker": "wandb", "num-server-rounds": 2}
    env = os.environ | {"PYTHONPATH": str(TESTS), "WANDB_MODE": "offline"}
    env |= {name: str(tmp_path / "wandb-home" / name) for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
    for run_config in (config, config | {"num-server-rounds": 3, "resume": True}):
        subprocess.run([sys.executable, str(TESTS / "interrupted.py"), json.dumps(run_config), "3"],
                       env=env, check=True, capture_output=True, timeout=600)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    run_id = results["tracking"]["wandb"]["id"]
    files = sorted((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2  # one run id, a directory per start
    rows = [row for path in files for row in wandb_history(path)]
    by_round = {row["round"]: row for row in rows}  # the resumed start sends the checkpoint's round again
    assert sorted(by_round) == [1, 2, 3]
    for record in results["rounds"]:
        for key, value in without_timing(round_scalars(record)).items():
            assert by_round[record["round"]][key] == pytest.approx(value), key


@pytest.mark.slow
def test_a_run_killed_in_round_3_tracks_as_the_uninterrupted_run(tmp_path):
    """SIGKILLed in round 3 (checkpoint-every=2: round 2's checkpoint is the last), then resumed:
    TensorBoard and MLflow hold each round once, with the uninterrupted run's numbers."""
    pytest.importorskip("tensorboard", reason="the test extra installs tensorboard")
    pytest.importorskip("mlflow", reason="the test extra installs mlflow-skinny")
    from test_resume import kill_during_round_3

    config = RUN | {"method": "fedproto", "output-dir": str(tmp_path), "num-server-rounds": 4,
                    "checkpoint-every": 2, "fraction-fit": 1.0, "tracker": "tensorboard,mlflow"}
    run_in_process(config | {"run-name": "whole"}, num_nodes=4)
    killed = config | {"run-name": "killed"}
    command = [sys.executable, str(TESTS / "interrupted.py"), json.dumps(killed), "4", "4"]  # hangs in round 4
    kill_during_round_3(tmp_path / "killed", command, os.environ | {"PYTHONPATH": str(TESTS)}, str(tmp_path))
    run_in_process(killed | {"resume": True}, num_nodes=4)
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())
    resumed = json.loads((tmp_path / "killed" / "results.json").read_text())
    assert resumed["resumed_after"] == [2]
    want = without_timing(expected_points(whole))
    assert_same_points(without_timing(tensorboard_scalars(tmp_path / "killed" / "tensorboard")), want)
    assert_same_points(without_timing(mlflow_metrics(resumed)), want)
