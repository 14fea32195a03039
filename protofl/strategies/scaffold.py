"""SCAFFOLD (Karimireddy et al., ICML 2020): stochastic controlled averaging.

Server and clients keep control variates, one array per trainable parameter: the server's c,
broadcast every round, and each client's c_i, kept on its node (zero before its first training).

Client (Algorithm 1): each local step is y <- y - eta (g(y) + c - c_i) (line 10: the offset
c - c_i added to every step's gradient); after its K steps (K = epochs x steps per epoch, eta the
round's learning rate) c_i+ = c_i - c + (x - y) / (K eta) (line 12, option II); it uploads y
(its parameters) and Delta c = c_i+ - c_i (line 13) as the named arrays ``control-delta/<i>``.
c_i+ replaces c_i only once the server has applied that Delta c: the server sends each client the
last round whose update of its it applied, and a client whose reply was lost (a timeout, a rejected
update or round) keeps its c_i, so that c stays the mean of the c_i (line 17's invariant).

The paper's local steps are plain SGD. With the run's ``momentum`` beta, the K steps move the model
by eta times each corrected gradient times sum_(k=1..K) (1 - beta^k) / (1 - beta) in all, not K:
that sum stands for K in line 12, so that c_i still estimates the mean corrected gradient (with K,
c_i overestimates it 1 / (1 - beta)-fold and the control variates grow without bound: at beta 0.9,
|c_i| reached 5e9 in 200 rounds of a quadratic toy). Without momentum the sum is K (PFLlib's, which
has none).

Server (lines 16-17): x <- x + eta_g * mean over the round's clients of (y_i - x), uniform (the
paper's and PFLlib's), on the trainable parameters (a BatchNorm's statistics take the mean), and
c <- c + (|S| / N) * mean over the round's clients S of their Delta c, N the federation's clients
(the paper's sum / N); both means under the run's ``aggregation`` rule. ``server-lr`` (eta_g) is 1
by default (the paper's experiments and PFLlib's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from protofl.federation.admission import ClientUpdate
from protofl.federation.client import PrototypeClient
from protofl.federation.server_rule import ServerRule
from protofl.federation.wire import ArraySpec, PayloadError, indexed
from protofl.settings import MethodOptions
from protofl.task.train import steps_per_epoch

CONTROL, CONTROL_DELTA = "control", "control-delta"  # c (broadcast), Delta c (uploaded), per parameter
APPLIED = "control-applied"  # to each client: the last round whose update of its the server applied
CLIENT_CONTROL = "control/"  # local_state names of c_i's arrays
PENDING_CONTROL, PENDING_ROUND = "control-pending/", "control-pending-round"  # c_i+ until applied, its round


@dataclass(frozen=True)
class SCAFFOLDOptions(MethodOptions):
    statistics: ClassVar[None] = None  # parameters and control variates
    keeps_client_state: ClassVar[bool] = True  # c_i
    server_lr: float = 1.0  # eta_g

    capturable: ClassVar[bool] = True  # a constant offset per gradient

    def check(self) -> None:
        if self.server_lr <= 0:
            raise ValueError(f"scaffold.server-lr must be > 0, got {self.server_lr}")


def step_multipliers(steps: int, momentum: float) -> float:
    """How many times the K = ``steps`` steps apply a gradient in all, each carried to the round's end by
    the momentum beta: sum_(k=1..K) (1 - beta^k) / (1 - beta); K without momentum."""
    if momentum == 0:
        return float(steps)
    return sum((1.0 - momentum**k) / (1.0 - momentum) for k in range(1, steps + 1))


def client_control_update(client_control: list[np.ndarray], control: list[np.ndarray], start: list[np.ndarray],
                          trained: list[np.ndarray], steps: float, lr: float) -> list[np.ndarray]:
    """c_i+ = c_i - c + (x - y) / (K eta) (Algorithm 1, line 12, option II; ``steps``: K, or
    :func:`step_multipliers`), in float64, each in its dtype."""
    return [(ci.astype(np.float64) - c + (x.astype(np.float64) - y) / (steps * lr)).astype(ci.dtype)
            for ci, c, x, y in zip(client_control, control, start, trained)]


def control_delta(control: list[np.ndarray], start: list[np.ndarray], trained: list[np.ndarray], steps: float,
                  lr: float) -> list[np.ndarray]:
    """Delta c = c_i+ - c_i = (x - y) / (K eta) - c (lines 12-13): whatever c_i was, it follows from the
    parameters y trained from x, the steps and the lr; in float64, each in c's dtype. The client
    sends it, the server computes it again from the same values (:meth:`SCAFFOLDStrategy.check_update`)."""
    return [((x.astype(np.float64) - y) / (steps * lr) - c).astype(c.dtype) for c, x, y in zip(control, start, trained)]


class SCAFFOLDStrategy(ServerRule):
    options_class = SCAFFOLDOptions
    state_fields = ("control", "applied")
    broadcast_to_evaluate = False  # evaluation scores the global model

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.control = [np.zeros(tuple(p.shape), p.detach().cpu().numpy().dtype) for p in parameters]  # c
        self.applied: dict[int, int] = {}  # partition -> the last round whose Delta c went into c

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return indexed(CONTROL, self.control)

    def broadcast_to(self, server_round: int, partition_id: int) -> dict[str, np.ndarray]:
        return {APPLIED: np.array([self.applied.get(partition_id, 0)], np.int64)}

    def upload_specs(self) -> dict[str, ArraySpec]:
        # its scale varies 100-fold between honest clients (a client of few steps reports its gradient,
        # one of many the mean of a trajectory): it is checked against the parameters instead
        return {name: ArraySpec.like(c, scale="checked") for name, c in indexed(CONTROL_DELTA, self.control).items()}

    def check_update(self, update: ClientUpdate) -> None:
        """Delta c must be what the update's parameters make it (:func:`control_delta`), to the
        rounding of its dtype: a client can send no other control variate than its parameters'."""
        s = self.settings
        steps = step_multipliers(s.local_epochs * steps_per_epoch(update.num_examples, s.batch_size, s.partial_batch),
                                 s.momentum)  # K, as the client counts its steps
        sent, trained = zip(*[(x, y) for x, y, t in zip(self.admission.sent_parameters, update.parameters,
                                                        self.trained_entries) if t])
        expected = control_delta(self.control, sent, trained, steps, s.round_lr(self.admission.server_round))
        for i, (name, want) in enumerate(zip(indexed(CONTROL_DELTA, self.control), expected)):
            got = update.uploads[name]
            if not (np.abs(got.astype(np.float64) - want) <= np.spacing(np.abs(want))).all():
                raise PayloadError(f"{name!r} is not the control delta its parameters make: (x - y) / (K lr) - c")

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        uniform = [1.0] * len(updates)
        mean = self.average_parameters(updates, uniform)  # x + mean(y_i - x)
        eta = self.options.server_lr
        parameters = self.stepped_entries(self.admission.sent_parameters, mean,
                                          lambda i, x, m: x + eta * (m - x))  # line 16
        names = list(indexed(CONTROL_DELTA, self.control))
        deltas = self.average_arrays([[u.uploads[name] for name in names] for u in updates], uniform)
        share = len(updates) / self.num_clients
        self.control = [(c + share * d.astype(np.float64)).astype(c.dtype)
                        for c, d in zip(self.control, deltas)]  # line 17
        self.applied = self.applied | {u.partition_id: server_round for u in updates}
        return parameters


class SCAFFOLDClient(PrototypeClient):
    options_class = SCAFFOLDOptions

    def receive(self, parameters, this_round):
        self.load_shared(parameters)
        self.trained = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.start = [p.detach().cpu().numpy().copy() for _, p in self.trained]  # x
        control = self.received_like(this_round, CONTROL, [p for _, p in self.trained])
        applied = self.received(this_round, APPLIED, ArraySpec((1,), ("int64",)))
        if control is None or applied is None:
            raise ValueError("SCAFFOLD: the server sent no control variate or no applied round")
        self.control = control  # c
        self.settle_control(int(applied[0]))
        self.client_control = [self.local_state.get(CLIENT_CONTROL + n, np.zeros_like(x))
                               for (n, _), x in zip(self.trained, self.start)]  # c_i
        self.round = this_round.number
        self.lr = self.settings.round_lr(self.round)  # eta

    def settle_control(self, applied_round: int) -> None:
        """c_i+ of the last fit becomes c_i if the server applied that fit's Delta c; else it is dropped."""
        pending_round = self.local_state.pop(PENDING_ROUND, None)
        pending = {k.removeprefix(PENDING_CONTROL): self.local_state.pop(k)
                   for k in list(self.local_state) if k.startswith(PENDING_CONTROL)}
        if pending_round is not None and int(pending_round[0]) == applied_round:
            self.local_state.update({CLIENT_CONTROL + n: c for n, c in pending.items()})

    def prepare_evaluation(self, parameters, this_round):
        self.load_shared(parameters)  # the global model, as FedAvg's; c_i stays as the last fit left it

    def gradient_offsets(self):
        return {name: c - c.new_tensor(ci) for (name, _), c, ci in zip(self.trained, self.control, self.client_control)}

    def after_fit(self, statistics):
        """c_i+ (line 12), kept until the server applies it; Delta c = c_i+ - c_i for the upload (line 13)."""
        steps = step_multipliers(self.settings.local_epochs * self.steps_per_epoch(), self.settings.momentum)  # K
        control = [c.cpu().numpy() for c in self.control]
        trained = [p.detach().cpu().numpy() for _, p in self.trained]
        updated = client_control_update(self.client_control, control, self.start, trained, steps, self.lr)
        self.control_delta = control_delta(control, self.start, trained, steps, self.lr)
        self.local_state.update({PENDING_CONTROL + n: c for (n, _), c in zip(self.trained, updated)})
        self.local_state[PENDING_ROUND] = np.array([self.round], np.int64)
        return {}

    def uploads(self):
        return indexed(CONTROL_DELTA, self.control_delta)


STRATEGY, CLIENT = SCAFFOLDStrategy, SCAFFOLDClient
