"""A federation in one process, without Ray: protofl's ServerApp and ClientApp factories, a fresh
client per message (its model a thread's own, as the ClientApp's mod frees it after each message)
and a persistent ``context.state`` per node, as Flower runs them; every
message is kept for inspection. The run's accuracy plot (accuracy.png, 0.3-0.5 s of matplotlib a
run) is drawn only when asked for (``plot=True``): the Ray simulations, `flwr run`, the deployments
and the tracking tests draw it."""

import concurrent.futures
import contextlib
from unittest import mock

import pytest
import torch
from flwr.app import Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity
from flwr.common import Context
from flwr.compat.common import parameter as flower_parameter
from flwr.server.client_proxy import ClientProxy

from protofl.client_app import PrototypeClientApp, make_client_fn, release_worker_models
from protofl.federation import client_state
from protofl.federation.message_records import read_instruction, read_reply
from protofl.federation.wire import Blobs
from protofl.server_app import build_strategy, make_server_fn
from protofl.settings import ExperimentSettings
from protofl.strategies import METHODS
from protofl.task.storage import NUMPY_HEADER_LOCK


# A method of each family (protofl/strategies/families: averaging, model parts, second model, class
# vectors) and two with state of their own (SCAFFOLD's controls, FedNH's 0-d scale): what a test of a
# template, such as a Flower front or the training worker, runs; a test of a method's math runs them all
TEMPLATE_METHODS = ("fedavg", "fedper", "fml", "fedproto", "scaffold", "fednh")
# The methods' options in the short runs that test a template, or record a method's rounds: CReFF's
# server work at its paper's size (100 features a class, 100 + 300 epochs a round) took 90 % of a
# three-round run on digits in float64 (21 of 23 s), these runs take a tenth of it; FedCDA aggregates
# as FedAvg for its first 50 rounds, these runs select from round 2
SHORT_RUN_OPTIONS = {"creff.features-per-class": 10, "creff.match-epochs": 10, "creff.retrain-epochs": 30,
                     "creff.gradient-repeats": 2, "fedcda.warmup-rounds": 1}


def methods_fast_for(*fast):
    """Every method as a pytest parameter, those not in ``fast`` in the slow suite: the fast suite
    keeps a representative few of a per-method federation test, CI runs them all."""
    return [m if m in fast else pytest.param(m, marks=pytest.mark.slow) for m in sorted(METHODS)]


class InProcessProxy(ClientProxy):
    def __init__(self, cid, client_fn, context, messages):
        super().__init__(cid)
        self.client_fn, self.context, self.messages = client_fn, context, messages

    def _call(self, kind, ins):
        # as the ClientApp's mod ends each message: this thread's model is free for its next one
        reply = release_worker_models(None, self.context,
                                      lambda _, context: getattr(self.client_fn(context), kind)(ins))
        self.messages.append((kind, ins, reply))
        return reply

    def get_properties(self, ins, timeout, group_id):
        return self._call("get_properties", ins)

    def get_parameters(self, ins, timeout, group_id):
        return self._call("get_parameters", ins)

    def fit(self, ins, timeout, group_id):
        return self._call("fit", ins)

    def evaluate(self, ins, timeout, group_id):
        return self._call("evaluate", ins)

    def reconnect(self, ins, timeout, group_id):
        return None


def run_in_process(run_config, num_nodes=3, node_class=None, plot=False, one_at_a_time=None):
    """On the run config's Flower front (``flower-api``, the Message API's unless it says ``"legacy"``):
    (the strategy after the run, [(kind, instruction, reply), ...] of every message: on the legacy
    front Flower's ``FitIns``/``FitRes`` and the like, on the Message API its messages).
    ``node_class(partition_id)``, when given, is that node's proxy class on the legacy front, its app
    on the Message API (e.g. a hostile client);
    ``plot``: draw accuracy.png at the end, as every real run does (otherwise it is not written);
    ``one_at_a_time``: the clients one after the other on one thread, as on a GPU (None: only there)."""
    threads = torch.get_num_threads()
    client_state.KEPT_STATES.clear()  # new nodes: what earlier runs' processes kept is not theirs
    # one torch thread per client, as a Ray simulation gives each (client-resources-num-cpus=1): the
    # clients train at once on Flower's thread pool, and each calling thread with more than one
    # runs its own OpenMP team; on 2 cores three clients x 2 threads ran 1.7-1.8x slower
    torch.set_num_threads(1)
    try:
        with (contextlib.nullcontext() if plot else mock.patch("protofl.report.plot_curves", _not_drawn),
              mock.patch.object(flower_parameter, "bytes_to_ndarray", _bytes_to_ndarray_under_lock)):
            if ExperimentSettings.from_run_config(run_config).flower_api == "message":
                return _run_messages(run_config, num_nodes, node_class, one_at_a_time)
            return _run(run_config, num_nodes, node_class, one_at_a_time)
    finally:
        torch.set_num_threads(threads)


def run_message_in_process(run_config, num_nodes=3, node_app=None, plot=False, one_at_a_time=None):
    """:func:`run_in_process` on the Message-API front: ``node_app(partition_id)``, when given, is the
    app of that node (``app(message, context) -> reply``, e.g. a hostile client); the messages are
    (message type, instruction, reply)."""
    return run_in_process(run_config | {"flower-api": "message"}, num_nodes, node_app, plot, one_at_a_time)


def _not_drawn(runs, path):
    pass


_flower_bytes_to_ndarray = flower_parameter.bytes_to_ndarray


def _bytes_to_ndarray_under_lock(tensor):
    """Flower's decoding of one parameter array, under protofl's lock for numpy's header parse: the
    clients here decode on threads of one process (CPython 3.11's AST constructor is not
    thread-safe: protofl/task/storage.py), where Ray actors and SuperNodes decode in one each."""
    with NUMPY_HEADER_LOCK:
        return _flower_bytes_to_ndarray(tensor)


def _run(run_config, num_nodes, node_class, one_at_a_time):
    empty = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    components = make_server_fn(run_config)(empty)
    server, messages = components.server, []  # clients on Flower's thread pool, as in a real run
    client_fn = make_client_fn(run_config)
    for p in range(num_nodes):
        node_config = {"partition-id": p, "num-partitions": num_nodes}
        context = Context(run_id=1, node_id=100 + p, node_config=node_config, state=RecordDict(), run_config={})
        proxy = (node_class(p) if node_class else InProcessProxy)(str(1000 + p), client_fn, context, messages)
        server.client_manager().register(proxy)
    if one_at_a_time or one_at_a_time is None and torch.cuda.is_available():
        # one client at a time on a GPU, as a Ray actor or a SuperNode runs them: CUDA work on other
        # threads while one captures its training step broke the capture (cuDNN internal errors)
        server.set_max_workers(1)
    server.fit(components.config.num_rounds, None)
    return server.strategy, messages


CALLS = {"train": "fit", "evaluate": "evaluate", "query": "get_properties"}  # message type -> the legacy call


class Seen:
    """A message of the Message API as the harness records it, read as the legacy front's would be:
    an instruction's ``config`` (its scalars and broadcast blobs), a reply's ``metrics``,
    ``properties``, ``num_examples`` and ``loss``, either's ``parameters.tensors`` (the shared
    entries' blobs; protofl.federation.message_records); ``message``: the message itself."""

    def __init__(self, message, instruction=False):
        self.message = message
        if message is None or message.has_error():
            return
        content = message.content
        if instruction:
            self.config = dict(content.config_records["config"])
            if "broadcasts" in content.array_records:
                self.config = read_instruction(content)[1]
                self.parameters = Blobs([array.data for array in content.array_records["arrays"].values()])
        else:
            reply = read_reply(message, list(content.array_records.get("arrays", {})))
            self.metrics, self.properties, self.parameters = reply.metrics, reply.properties, reply.parameters
            self.num_examples, self.loss = reply.num_examples, reply.loss


class InProcessGrid(Grid):
    """A grid whose nodes' apps run in this process: each message on Flower's side of a thread pool
    (one thread with ``one_at_a_time``), an app that raises answered by an error reply, as Flower's
    runtime does."""

    def __init__(self, apps, contexts, messages, one_at_a_time):
        self.apps, self.contexts, self.messages, self.one_at_a_time = apps, contexts, messages, one_at_a_time

    def set_run(self, run):
        self._run = run

    @property
    def run(self):
        return getattr(self, "_run", None)

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        raise NotImplementedError("send_and_receive only")

    def pull_messages(self, message_ids):
        raise NotImplementedError("send_and_receive only")

    def answer(self, message):
        """The reply of ``message``'s node's app (an error reply when the app raises)."""
        node = message.metadata.dst_node_id
        try:
            return self.apps[node](message, self.contexts[node])
        except Exception as err:
            return Message(Error(code=2, reason=f"{type(err).__name__}: {err}"), reply_to=message)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)

        def deliver(message):
            reply = self.answer(message)
            self.messages.append((CALLS[message.metadata.message_type], Seen(message, instruction=True), Seen(reply)))
            return reply

        if not messages:
            return []
        workers = 1 if self.one_at_a_time else len(messages)
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            return [reply for reply in pool.map(deliver, messages) if reply is not None]


def as_serverapp():
    """What Flower's runtime sets before it runs a ServerApp (flwr/superlink/runtime/run_serverapp.py):
    every Message a ServerApp makes names this run and this node."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1


def _run_messages(run_config, num_nodes, node_app, one_at_a_time):
    as_serverapp()
    strategy, _ = build_strategy(ExperimentSettings.from_run_config(run_config))
    app, apps, contexts, messages = PrototypeClientApp(run_config), {}, {}, []
    for p in range(num_nodes):
        node_config = {"partition-id": p, "num-partitions": num_nodes}
        contexts[1000 + p] = Context(run_id=1, node_id=1000 + p, node_config=node_config, state=RecordDict(),
                                     run_config={})
        apps[1000 + p] = node_app(p) if node_app else app
    one_at_a_time = one_at_a_time or one_at_a_time is None and torch.cuda.is_available()
    strategy.start(InProcessGrid(apps, contexts, messages, one_at_a_time))
    return strategy, messages
