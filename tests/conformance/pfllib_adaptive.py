"""FedALA's and FedPAC's fixtures, from PFLlib's code (TsingZ0/PFLlib, ``system/flcore`` and
``system/utils/ALA.py``): two rounds of each method's real server and clients, in the federation of
:mod:`conformance.pfllib_baselines` (whose helpers this module reuses).

Their code computes in float64 (``make_fixtures.py`` sets torch's default dtype; nothing on the paths
called here casts back to float32): every float output is float64. Same shape as the baselines: 4
clients, round 1 trains clients 0, 1, 2, round 2 clients 1, 2, 3 (``ROUNDS``; their ``select_clients``
is not called, the selection is set), one local epoch, lr 0.05, batch 4, plain SGD, the mean
cross-entropy; the model is ours, ``protofl.task.models.build_model("cnn", 1, 4, 16, seed=0)``, as
their ``BaseHeadSplit(body, head)`` (parameters: the body's conv / fc weights and biases, then
``head.weight``, ``head.bias``; ``<name>`` below is our state_dict name). Their servers are built by
their constructors (which build the clients), ``read_client_data`` returns the seeded images (in
their original order), ``h5py`` is a stand-in; each client's ``load_train_data`` returns a
``DataLoader(shuffle=False, drop_last=True)`` over its images in our client's order of the round,
``batch_order(n, order_seed(r, p))`` (``input.round<r>.client<p>.seed`` / ``.order``; every pass
over the loader in a round takes that same order, where theirs would reshuffle). Model entries are
stored as ``fingerprint`` s, losses as float64 arrays (one entry per optimiser step, in order);
``initial.<name>`` is the initial model. ``evaluate`` is not called.

fedala-pfllib-rounds
--------------------
``servers/serverala.py: FedALA``, ``clients/clientala.py: clientALA``, ``utils/ALA.py: ALA``, with
``eta`` 1.0, ``rand_percent`` 80, ``layer_idx`` 2 (``input.their.*``): the last 2 parameters
(``head.weight``, ``head.bias``) are blended, the others overwritten by the global model. The
clients' images are :func:`conformance.pfllib_baselines.client_inputs` (9, 11, 10, 7 samples).
Per round: ``send_models`` (FedALA's: ``local_initialization`` = ``ALA.adaptive_local_aggregation``
of the global model, for ALL four clients), each selected client's ``train``, ``receive_models``
(``random.seed(0)``: it only orders the sum) and ``aggregate_parameters`` (serverbase: weighted by
the training sizes).

- ALA's slice: their ``random.randint(0, n - num)`` (``num = int(rand_percent / 100 * n)``, ``n`` the
  client's training size: 7, 8, 8, 5 of 9, 11, 10, 7) is replaced by our rule (:func:`ala_start`,
  the ``random`` that ALA.py imported is a stand-in): ``start = torch.randint(0, n - num + 1, (1,),
  generator=torch.Generator().manual_seed(seed))`` with the client's seed of the round,
  ``order_seed(r, p)`` (also for the clients that are not selected). The slice is
  ``train_data[start:start + num]`` of the client's samples in their ORIGINAL order (what
  ``read_client_data`` returned at construction), batched by ``DataLoader(batch_size=4,
  drop_last=False)`` unshuffled: 2 batches for every client here (4 + 3, 4 + 4, 4 + 4, 4 + 1).
- ``round<r>.client<p>.ala_start``: that start (selected clients only).
- ``round<r>.client<p>.initialised.<name>``: the client's model after ``local_initialization``,
  before training. Round 1: the initial model (ALA is skipped: ``sum(global[0] - local[0]) == 0``, it
  returns after the draw, before creating its weights). Round 2: the body entries = the round-1
  aggregate; ``head.* = local + (global - local) * W`` with ALA's learned W.
- ``round<r>.client<p>.weights.<i>`` (round 2 only; i = 0: ``head.weight``'s, 1: ``head.bias``'s):
  W after ``local_initialization``. W starts at ones (global head) and per batch of the slice goes
  ``W <- clamp(W - eta * grad_t * (global - local), 0, 1)`` with ``grad_t`` the gradient of the
  cross-entropy at the temporary model's blended head, which is then re-blended.
- ``round<r>.client<p>.ala_losses``: the cross-entropy of every batch ALA's weight learning ran
  (their ``self.loss`` wrapped), in order (empty in round 1); ``.ala_epochs``: their ``cnt``, the
  epochs over the slice (0 in round 1). The first ALA that runs is the "start phase": it repeats
  epochs until more than 10 were run and the std (numpy's, ddof 0) of the last 10 epochs' LAST-batch
  losses (their ``losses``) is < 0.1 (bounded here: more than 1000 epochs raise); afterwards
  ``start_phase`` is False for good and ALA runs one epoch (never reached here: each client's start
  phase is its round-2 ALA, round 1 having been skipped). Here every start phase stops at the first
  chance, 11 epochs (22 batches): the losses move by about 1e-5 an epoch. W stays close to 1 (the
  mean of 1 - W: 7e-5 to 3e-4 for ``head.weight``, 0.005 to 0.03 for ``head.bias``).
- ``round<r>.client<p>.trained.<name>``, ``.ce`` (per step): after ``clientALA.train`` (plain SGD
  on the full model, their ``self.loss`` wrapped).
- ``round<r>.aggregate.<name>``: their global model after ``aggregate_parameters``.

Quirks (theirs): ``send_models`` runs ALA for every client, selected or not (client 0 runs its
start phase in round 2 without training; nothing of it is recorded); the random draw happens even
when ALA is skipped; the skip test looks at the sum of the first parameter's difference only; the
convergence test reads only the last batch's loss of each epoch (here a batch of 3, 4, 4 or 1
samples); W persists across rounds; their ``send_models`` does not count send time, so their
``receive_models`` takes its ``ZeroDivisionError`` path (time 0, every client uploads).

fedpac-pfllib-rounds
--------------------
``servers/serverpac.py: FedPAC``, ``clients/clientpac.py: clientPAC``, ``lamda`` 1.0. Its own
clients (``PAC_SIZES`` = 8, 12, 8, 4 samples: multiples of the batch, so that their
``drop_last=True`` loaders, which their statistics and prototypes also iterate, take every sample),
``client<p>.pixels`` from ``pixels(280 + p)`` and ``client<p>.labels`` from ``seeded(290 + p)``,
clients 0-2 drawing classes 0-2 and client 3 classes 0-3 (``PAC_LABEL_CLASSES``). The draw gave
counts per class 0-3: client 0 (4, 4, 0, 0), client 1 (7, 3, 2, 0), client 2 (2, 0, 6, 0), client 3
(1, 0, 2, 1): in round 1 class 3 is on no client, class 2 missing on client 0, class 1 on client 2;
round 1's global prototypes have classes 0-2 only, so in round 2 client 3's class-3 sample has no
global prototype (and client 3 lacks class 1). Per round, their ``FedPAC.train`` order:
``send_models`` (serverbase's: ``set_parameters`` of every client, which also computes ``V, h =
statistics_extraction()``), ``Vars``/``Hs`` of the selected clients, each selected client's
``train``, ``receive_protos``, ``proto_aggregation``, ``send_protos``, ``receive_models``,
``aggregate_parameters``, ``aggregate_and_send_heads``.

- ``round<r>.client<p>.V`` (scalar) and ``.h`` (C x d = 4 x 512, exact): ``statistics_extraction``
  of the received model on the client's data: with ``p_k`` the class frequencies, ``mu_k`` the mean
  and ``F_k`` the features of class k, ``h[k] = p_k mu_k`` (0 for an absent class) and ``V = sum_k
  (p_k tr(F_k^T F_k) / n_k - p_k^2 ||mu_k||^2) / n`` (the division by the training size ``n`` is
  theirs, on top of the p_k weighting).
- ``round<r>.client<p>.trained.<name>``: after ``clientPAC.train``: one pass over the loader
  training the head only (body ``requires_grad`` off), then ``local_epochs`` epochs training the
  body only (head off) on ``CE + lamda * MSE(rep, target)``, ``target`` = ``rep.detach()`` with the
  rows of the samples whose class has a global prototype replaced by it (MSE's mean is over all
  B x d entries, the rows left as ``rep`` counting 0). No MSE while ``global_protos`` is None
  (round 1). Both passes take the same order (the round's).
- ``.head_ce`` (the head pass's steps), ``.body_ce``, ``.body_loss`` (CE + lamda MSE) and, round 2
  only, ``.body_mse`` (the body steps): their ``self.loss`` and ``self.loss_mse`` wrapped.
- ``.protos`` (C x d, NaN rows for the client's absent classes) and ``.proto_classes`` (sorted):
  ``collect_protos`` after training, eval mode, the mean feature per class (``agg_func``).
- The clients' prototypes and the global prototypes are rounded to float32 as protofl's wire
  carries them (:func:`over_our_wire`, the one change to their inputs besides the two below), so
  that round 2 trains with the global prototypes our clients receive.
- ``round<r>.global_protos`` (C x d, NaN rows for classes no uploaded client has):
  ``proto_aggregation``, the unweighted mean of the uploaders' prototypes of the class.
- ``round<r>.aggregate.<name>`` for the body entries: ``aggregate_parameters`` of the uploaded
  ``client.model.base`` (weighted by the training sizes): their global model becomes the body only,
  so from round 2 on ``set_parameters`` (a ``zip``) overwrites the body and keeps the personal head.
- ``round<r>.uploaded_ids``: the order ``receive_models`` uploaded in (= the selection, see below).
- ``round<r>.head_weights`` (3 x 3): ``solve_quadratic``'s return value (its rows in uploaded
  order, after their zeroing of the weights <= 1e-3, ``w * (w > eps)``, which turns a negative one
  into -0.0); row i, for client ``uploaded_ids[i]``, weighs the uploaded (trained) heads.
- ``round<r>.client<p>.qp_matrix`` (3 x 3): the P that the client's QP minimised ``alpha^T P alpha``
  with (subject to ``sum(alpha) = 1, alpha >= 0``): ``diag(V) + D``, ``D[j1, j2] = sum_k <h_ref[k] -
  h_j1[k], h_ref[k] - h_j2[k]>``, ``h_ref`` the client's own ``h`` (recorded from ``cvx.quad_form``'s
  argument; their eigenvalue clean-up only replaces a P with a negative eigenvalue, none here).
- ``round<r>.client<p>.new_head.<name>``: the head ``set_head`` received (``add_heads``: row i's
  weights times the uploaded heads, summed), applied to the clients once all are computed
  (``PAC_HEADS_AFTER_LOOP``, see the quirks).

The QP is solved by cvxpy 1.9.3 (in a venv of its own: protofl's has no cvxpy): ``prob.solve()``
chose OSQP 1.1.3 for all six QPs (status optimal; cvxpy's OSQP settings, with its solution
polishing). The polished weights equal the exact minimiser (found by enumerating the supports of
the 3-weight QP) to 1e-16 here; an unpolished OSQP solution would be off by about its 1e-5
tolerance. Where zeroed, the exact minimiser's weight is 0 too (an active ``alpha >= 0``).

Quirks (theirs), two of which the harness sidesteps so that the fixture is FedPAC's intended math:

- ``aggregate_and_send_heads`` calls ``set_head`` inside its loop, and ``uploaded_heads`` are the
  clients' live ``model.head`` modules: once client ``uploaded_ids[0]`` got its new head, the next
  clients' ``add_heads`` mix that new head in place of its trained one (and so on down the list;
  the result depends on the upload order). Here the ``set_head`` calls are held until the loop
  ends (``PAC_HEADS_AFTER_LOOP``; False gives their in-loop behaviour, whose round-1 heads of
  clients 1 and 2 then differ by about 1e-2 in their fingerprints' projections).
- ``receive_models`` draws the upload order with ``random.sample``, but ``solve_quadratic``
  computes row i and column j from ``Vars``/``Hs`` in SELECTED order, and ``aggregate_and_send_heads``
  gives row i to ``uploaded_ids[i]`` and weighs ``uploaded_heads`` (upload order): the weights meet
  the wrong clients' heads unless the two orders agree. ``random.seed(0)`` orders 3 clients (1, 2,
  0), so here ``random.seed(4)`` (``PAC_RECEIVE_SEED``, the first seed whose 3-sample keeps the
  order) is set before ``receive_models``: their code's result when the orders agree.

Not sidestepped, not reached: when a QP has no solution (``alpha`` None), their code takes
``self.uploaded_heads[cid]``, a client id used as an upload position (a wrong head, or an
IndexError). Reached: in round 2 the clients' ``global_protos`` are a ``defaultdict(list)``: the
lookup of an absent class inserts ``[]`` into the client's copy (``type(...) != list`` skips it);
``Vars``/``Hs`` are the statistics of the received body before training, the mixed heads the
trained ones; ``statistics_extraction``'s V is divided by ``n`` once more after the ``p_k``
weighting; the head pass is one pass whatever ``local_epochs``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import random
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from conformance.common import Snapshot, pixels, save_fixture, seeded
from conformance.pfllib_baselines import (
    BATCH_SIZE,
    EPOCHS,
    IMAGE_SIZE,
    INIT_SEED,
    LR,
    NUM_CLASSES,
    ROUNDS,
    SIZES,
    _fingerprints,
    _Recorded,
    batch_order,
    client_inputs,
    order_seed,
    their_server,
)

SNAPSHOTS = {"pfllib": Snapshot("TsingZ0/PFLlib", "d832e76f6a23b833038949ec1e4fdefe63a4d350")}

ALA_OPTIONS = {"eta": 1.0, "rand_percent": 80, "layer_idx": 2}  # their args
MAX_ALA_EPOCHS = 1000  # the start phase's bound here (theirs has none)
ALA_RECEIVE_SEED = 0  # random.seed before receive_models: it only orders the sum

PAC_OPTIONS = {"lamda": 1.0}
PAC_SIZES = (8, 12, 8, 4)  # multiples of BATCH_SIZE: their drop_last loaders take every sample
PAC_LABEL_CLASSES = (3, 3, 3, 4)  # client p's labels are drawn from classes 0 .. this - 1
PAC_PIXEL_SEED, PAC_LABEL_SEED = 280, 290  # + p
PAC_RECEIVE_SEED = 4  # the first seed whose random.sample of 3 clients keeps their order (see the docstring)
PAC_HEADS_AFTER_LOOP = True  # set_head once every new head is computed (False: in their loop, see the docstring)
FEATURE_DIM = 512


def ala_start(n: int, seed: int, rand_percent: int = ALA_OPTIONS["rand_percent"]) -> tuple[int, int]:
    """(start, num) of ALA's slice of a client's ``n`` training samples: their ``num = int(rand_percent
    / 100 * n)``, and our draw of the start in ``[0, n - num]`` for the client's seed of the round."""
    num = int(rand_percent / 100 * n)
    start = int(torch.randint(0, n - num + 1, (1,), generator=torch.Generator().manual_seed(seed)).item())
    return start, num


def pac_inputs() -> dict[str, np.ndarray]:
    """FedPAC's clients (as :func:`conformance.pfllib_baselines.client_inputs`, with ``PAC_SIZES``)."""
    inputs: dict[str, np.ndarray] = {}
    for p, (n, classes) in enumerate(zip(PAC_SIZES, PAC_LABEL_CLASSES)):
        inputs[f"client{p}.pixels"] = pixels(PAC_PIXEL_SEED + p, n, (1, IMAGE_SIZE, IMAGE_SIZE))
        inputs[f"client{p}.labels"] = seeded(PAC_LABEL_SEED + p).integers(0, classes, n)
    for r, clients in ROUNDS.items():
        for p in clients:
            inputs[f"round{r}.client{p}.seed"] = np.int64(order_seed(r, p))
            inputs[f"round{r}.client{p}.order"] = batch_order(PAC_SIZES[p], order_seed(r, p))
    return inputs | {"init_seed": np.int64(INIT_SEED), "lr": np.float64(LR), "epochs": np.int64(EPOCHS),
                     "batch_size": np.int64(BATCH_SIZE), "num_clients": np.int64(len(PAC_SIZES))}


def _loader(x: torch.Tensor, y: torch.Tensor, order: np.ndarray):
    """A client's ``load_train_data``: its images in ``order``, unshuffled, the partial batch dropped."""
    batches = torch.utils.data.TensorDataset(x[torch.from_numpy(order)], y[torch.from_numpy(order)])
    return lambda batch_size=None: torch.utils.data.DataLoader(batches, BATCH_SIZE, shuffle=False, drop_last=True)


def _check_finite(outputs: dict[str, np.ndarray], suffixes: tuple[str, ...]) -> None:
    for key, value in outputs.items():
        if key.endswith(suffixes):
            assert np.isfinite(value).all(), f"{key}: not finite"


# ---------------------------------------------------------------------------------------------- FedALA


class _SliceDraw:
    """Stands in for the ``random`` module that ALA.py imported, whose one call is the start of the
    slice, ``random.randint(0, n - num)``: drawn by :func:`ala_start` for the seed set for the
    client about to run."""

    def __init__(self) -> None:
        self.n: int | None = None
        self.seed: int | None = None
        self.start: int | None = None

    def randint(self, low: int, high: int) -> int:
        assert low == 0 and self.seed is not None, "ALA's draw outside a recorded local_initialization"
        self.start, num = ala_start(self.n, self.seed)
        assert high == self.n - num, f"their slice of {self.n} is not num = {num}"
        self.seed = None
        return self.start


class _AlaRun:
    """One client's ``local_initialization``, recording ALA's slice start and the loss of each of its
    weight-learning batches (their ``ALA.loss`` wrapped), with the epochs bounded."""

    def __init__(self, client, draw: _SliceDraw) -> None:
        self.client, self.draw, self.inner = client, draw, client.local_initialization
        self.ala = client.ALA
        self.loss = self.ala.loss
        self.ala.loss = self._loss
        n = len(self.ala.train_data)
        num = int(self.ala.rand_percent / 100 * n)
        self.batches_per_epoch = -(-num // self.ala.batch_size)
        self.seed: int | None = None  # the client's seed of the round
        self.start: int | None = None
        self.losses: list[float] = []
        self.printed = ""
        client.local_initialization = self

    def _loss(self, output, y):
        if len(self.losses) >= MAX_ALA_EPOCHS * self.batches_per_epoch:
            raise RuntimeError(f"client {self.client.id}: ALA's start phase ran over {MAX_ALA_EPOCHS} epochs")
        value = self.loss(output, y)
        self.losses.append(value.item())
        return value

    def __call__(self, global_model) -> None:
        self.draw.n, self.draw.seed, self.draw.start = len(self.ala.train_data), self.seed, None
        self.losses = []
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            self.inner(global_model)
        self.printed, self.start = printed.getvalue(), self.draw.start
        assert self.start is not None, "ALA did not draw its slice"

    @property
    def epochs(self) -> int:
        assert len(self.losses) % self.batches_per_epoch == 0
        epochs = len(self.losses) // self.batches_per_epoch
        if self.printed:  # the start phase prints its cnt
            assert self.printed.split("ALA epochs:")[1].split()[0] == str(epochs), self.printed
        return epochs


def _run_fedala(checkout: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    server, x, y, our_names = their_server(checkout, "serverala", "FedALA", inputs, ALA_OPTIONS)
    ala_module = sys.modules["utils.ALA"]
    draw, their_random = _SliceDraw(), ala_module.random
    ala_module.random = draw
    runs = {client.id: _AlaRun(client, draw) for client in server.clients}
    losses = {client.id: client.loss for client in server.clients}
    outputs = _fingerprints(server.global_model.parameters(), our_names, "initial")
    try:
        for r, clients in ROUNDS.items():
            server.selected_clients = [server.clients[p] for p in clients]  # select_clients, without its draw
            server.current_num_join_clients = len(clients)
            for p, run in runs.items():
                run.seed = order_seed(r, p)
            server.send_models()  # local_initialization of every client
            recorders = {}
            for p in clients:
                client, run, prefix = server.clients[p], runs[p], f"round{r}.client{p}"
                outputs[f"{prefix}.ala_start"] = np.int64(run.start)
                outputs |= _fingerprints(client.model.parameters(), our_names, f"{prefix}.initialised")
                outputs[f"{prefix}.ala_losses"] = np.array(run.losses, dtype=np.float64)
                outputs[f"{prefix}.ala_epochs"] = np.int64(run.epochs)
                if r == 1:
                    assert client.ALA.weights is None and not run.losses  # skipped: global == local
                else:
                    assert run.epochs > client.ALA.num_pre_loss and not client.ALA.start_phase  # the start phase
                    weights = client.ALA.weights
                    outputs |= _fingerprints(weights, [str(i) for i in range(len(weights))], f"{prefix}.weights")
                order = inputs[f"round{r}.client{p}.order"]
                client.load_train_data = _loader(x[p], y[p], order)
                client.loss = losses[p]
                recorders[p] = client.loss = _Recorded(client)
            if r == 2:  # client 0 runs its start phase, unselected
                assert runs[0].epochs > runs[0].ala.num_pre_loss and not runs[0].ala.start_phase
            for client in server.selected_clients:
                client.train()
            for p in clients:
                client, prefix = server.clients[p], f"round{r}.client{p}"
                outputs |= _fingerprints(client.model.parameters(), our_names, f"{prefix}.trained")
                outputs[f"{prefix}.ce"] = np.array(recorders[p].ce)
                assert len(recorders[p].ce) == SIZES[p] // BATCH_SIZE * EPOCHS
            random.seed(ALA_RECEIVE_SEED)  # receive_models' random.sample: only the order of the sum
            server.receive_models()
            server.aggregate_parameters()
            outputs |= _fingerprints(server.global_model.parameters(), our_names, f"round{r}.aggregate")
    finally:
        ala_module.random = their_random
    _check_finite(outputs, (".ce", ".ala_losses"))
    return outputs


# ---------------------------------------------------------------------------------------------- FedPAC


class _Mse:
    """Their ``self.loss_mse``, recording each value."""

    def __init__(self, inner) -> None:
        self.inner, self.values = inner, []

    def __call__(self, target, rep):
        value = self.inner(target, rep)
        self.values.append(value.item())
        return value


class _Cvx:
    """Stands in for the ``cvx`` (cvxpy) that serverpac.py imported: the real one, recording the matrix
    of each ``quad_form`` and the solver, status and solution of each solve."""

    def __init__(self, cvx) -> None:
        self.cvx = cvx
        self.matrices: list[np.ndarray] = []
        self.solves: list[tuple[str, str]] = []
        self.Variable, self.Minimize, self.sum = cvx.Variable, cvx.Minimize, cvx.sum
        recorder = self

        class Problem(cvx.Problem):
            def solve(self, *args, **kwargs):
                value = super().solve(*args, **kwargs)
                recorder.solves.append((self.solver_stats.solver_name, self.status))
                return value

        self.Problem = Problem

    def quad_form(self, x, p_matrix):
        self.matrices.append(np.array(p_matrix, dtype=np.float64))
        return self.cvx.quad_form(x, p_matrix)


def _class_rows(vectors: dict, d: int) -> np.ndarray:
    """{class: vector} as C x d, NaN rows for the classes without one."""
    rows = np.full((NUM_CLASSES, d), np.nan)
    for k, v in vectors.items():
        rows[k] = v.detach().numpy()
    return rows


def over_our_wire(protos: dict) -> dict:
    """Class prototypes as protofl's wire carries them (class statistics up, global prototypes down):
    rounded to float32, so that their clients train with the global prototypes ours receive."""
    rounded = {k: v.float().double() for k, v in protos.items()}
    return defaultdict(list, rounded) if isinstance(protos, defaultdict) else rounded


def _run_fedpac(checkout: Path, inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], str]:
    """The outputs, and the cvxpy version and the solvers its ``prob.solve()`` chose."""
    server, x, y, our_names = their_server(checkout, "serverpac", "FedPAC", inputs, PAC_OPTIONS)
    body_names, head_names = our_names[:-2], our_names[-2:]
    pac = sys.modules["flcore.servers.serverpac"]
    their_cvx, their_solve = pac.cvx, pac.solve_quadratic
    cvx = pac.cvx = _Cvx(their_cvx)
    solved: list = []

    def solve_quadratic(num_users, Vars, Hs):
        solved.append(their_solve(num_users, Vars, Hs))
        return solved[-1]

    pac.solve_quadratic = solve_quadratic
    new_heads: dict[int, list[torch.Tensor]] = {}
    pending: list = []  # (their set_head, the new head), applied after the loop (see the docstring)
    for client in server.clients:
        def set_head(head, client=client, inner=client.set_head):
            new_heads[client.id] = [t.detach().clone() for t in head.parameters()]
            if PAC_HEADS_AFTER_LOOP:
                pending.append((inner, head))
            else:
                inner(head)

        client.set_head = set_head
    losses = {client.id: client.loss for client in server.clients}
    mse = {client.id: client.loss_mse for client in server.clients}
    outputs = _fingerprints(server.global_model.parameters(), our_names, "initial")
    try:
        for r, clients in ROUNDS.items():
            server.selected_clients = [server.clients[p] for p in clients]  # select_clients, without its draw
            server.current_num_join_clients = len(clients)
            for p, client in enumerate(server.clients):  # statistics_extraction reads every client's loader
                client.load_train_data = _loader(x[p], y[p], batch_order(PAC_SIZES[p], order_seed(r, p)))
            server.send_models()  # set_parameters: V, h
            server.Vars = [client.V for client in server.selected_clients]
            server.Hs = [client.h for client in server.selected_clients]
            recorders, mses = {}, {}
            for p in clients:
                client, prefix = server.clients[p], f"round{r}.client{p}"
                outputs[f"{prefix}.V"] = np.float64(client.V)
                outputs[f"{prefix}.h"] = client.h.detach().numpy().copy()
                client.loss, client.loss_mse = losses[p], mse[p]
                recorders[p] = client.loss = _Recorded(client)
                mses[p] = client.loss_mse = _Mse(mse[p])
            for client in server.selected_clients:
                client.train()
            for p in clients:
                client, prefix = server.clients[p], f"round{r}.client{p}"
                steps = PAC_SIZES[p] // BATCH_SIZE
                ce, totals = recorders[p].ce, [t.item() for t in recorders[p].totals]
                assert len(ce) == steps * (1 + EPOCHS)
                outputs |= _fingerprints(client.model.parameters(), our_names, f"{prefix}.trained")
                outputs[f"{prefix}.head_ce"] = np.array(ce[:steps])
                outputs[f"{prefix}.body_ce"] = np.array(ce[steps:])
                outputs[f"{prefix}.body_loss"] = np.array(totals[steps:])
                assert totals[:steps] == ce[:steps]
                if r == 1:
                    assert not mses[p].values and totals == ce
                else:  # round 2 trains with global prototypes
                    assert len(mses[p].values) == steps * EPOCHS and all(v > 0 for v in mses[p].values)
                    outputs[f"{prefix}.body_mse"] = np.array(mses[p].values)
                outputs[f"{prefix}.protos"] = _class_rows(client.protos, FEATURE_DIM)
                outputs[f"{prefix}.proto_classes"] = np.array(sorted(client.protos), dtype=np.int64)
            server.receive_protos()
            server.uploaded_protos = [over_our_wire(protos) for protos in server.uploaded_protos]
            server.global_protos = over_our_wire(pac.proto_aggregation(server.uploaded_protos))
            outputs[f"round{r}.global_protos"] = _class_rows(server.global_protos, FEATURE_DIM)
            server.send_protos()
            random.seed(PAC_RECEIVE_SEED)  # the upload order = the selection's (see the docstring)
            server.receive_models()
            assert server.uploaded_ids == list(clients), server.uploaded_ids
            outputs[f"round{r}.uploaded_ids"] = np.array(server.uploaded_ids, dtype=np.int64)
            server.aggregate_parameters()
            outputs |= _fingerprints(server.global_model.parameters(), body_names, f"round{r}.aggregate")
            cvx.matrices.clear()
            new_heads.clear()
            with contextlib.redirect_stdout(io.StringIO()):  # it prints each client's weights
                server.aggregate_and_send_heads()
            for set_head, head in pending:
                set_head(head)
            pending.clear()
            weights = solved[-1]
            assert all(w is not None for w in weights) and len(cvx.matrices) == len(clients)
            assert all(status == "optimal" for _, status in cvx.solves)
            outputs[f"round{r}.head_weights"] = np.array(weights, dtype=np.float64)
            for p, matrix in zip(server.uploaded_ids, cvx.matrices):
                outputs[f"round{r}.client{p}.qp_matrix"] = matrix
                outputs |= _fingerprints(new_heads[p], head_names, f"round{r}.client{p}.new_head")
    finally:
        pac.cvx, pac.solve_quadratic = their_cvx, their_solve
    _check_pac(outputs, inputs)
    return outputs, f"cvxpy {their_cvx.__version__}, {'/'.join(sorted({s for s, _ in cvx.solves}))}"


def _check_pac(outputs: dict[str, np.ndarray], inputs: dict[str, np.ndarray]) -> None:
    """What the fixture is meant to exercise: finite losses, QP weights on the simplex (less their
    zeroed ones), each new head their weights' mix of the trained heads (a fingerprint's sum and
    projections are linear), classes absent on clients and from the global prototypes."""
    _check_finite(outputs, ("_ce", "_loss", "_mse", ".V", ".h", "head_weights", "qp_matrix"))
    for r, clients in ROUNDS.items():
        weights = outputs[f"round{r}.head_weights"]
        assert (weights >= 0).all() and np.allclose(weights.sum(axis=1), 1, atol=len(clients) * 1e-3), weights
        for i, p in enumerate(clients):
            for name in ("head.weight", "head.bias"):
                new = outputs[f"round{r}.client{p}.new_head.{name}"]
                mix = sum(w * outputs[f"round{r}.client{q}.trained.{name}"] for w, q in zip(weights[i], clients))
                linear = np.r_[0, 2:len(new)]
                assert np.allclose(new[linear], mix[linear], rtol=0, atol=1e-12 * new[1]) or not PAC_HEADS_AFTER_LOOP
        for p in clients:
            labels = inputs[f"client{p}.labels"]
            present = np.unique(labels)
            assert np.array_equal(outputs[f"round{r}.client{p}.proto_classes"], present)
            assert np.isnan(outputs[f"round{r}.client{p}.protos"]).any(axis=1).sum() == NUM_CLASSES - len(present)
            absent = np.setdiff1d(np.arange(NUM_CLASSES), present)
            assert (outputs[f"round{r}.client{p}.h"][absent] == 0).all()
    assert any(len(np.unique(inputs[f"client{p}.labels"])) < NUM_CLASSES for p in ROUNDS[1])
    no_global = np.isnan(outputs["round1.global_protos"]).all(axis=1)
    assert any(np.isin(inputs[f"client{p}.labels"], np.flatnonzero(no_global)).any() for p in ROUNDS[2])


# ---------------------------------------------------------------------------------------------- fixtures


def make(checkouts: dict[str, Path], rerun: str) -> list[Path]:
    if importlib.util.find_spec("cvxpy") is None:  # serverpac imports it; protofl's venv must not have it
        raise SystemExit("FedPAC's server needs cvxpy: run with a separate venv that sees this one's packages "
                         "and has cvxpy (see /work/scratch/fixtures59_adaptive.md)")
    checkout = checkouts["pfllib"]
    common = ("the constructor builds the clients; read_client_data returns seeded 1x16x16 images, load_train_data "
              "a DataLoader(shuffle=False, drop_last=True) in our client's order of the round, h5py a stand-in; the "
              "selection set (rounds 1: clients 0-2, 2: clients 1-3); the model BaseHeadSplit(body, head) of "
              "protofl's build_model('cnn', 1, 4, 16, seed=0); in float64")
    paths = []
    inputs = client_inputs() | {f"their.{k}": np.float64(v) for k, v in ALA_OPTIONS.items()}
    outputs = _run_fedala(checkout, inputs)
    call = ("system/flcore/servers/serverala.py: FedALA (clients/clientala.py: clientALA.train, local_initialization; "
            "utils/ALA.py: ALA.adaptive_local_aggregation, its random.randint replaced by our seeded start, its loss "
            "wrapped): two rounds of send_models (ALA for every client), train, receive_models (random.seed(0)), "
            f"aggregate_parameters; {common}")
    paths.append(save_fixture("fedala-pfllib-rounds", SNAPSHOTS["pfllib"], call, rerun, inputs, outputs))
    inputs = pac_inputs() | {f"their.{k}": np.float64(v) for k, v in PAC_OPTIONS.items()}
    outputs, solver = _run_fedpac(checkout, inputs)
    call = ("system/flcore/servers/serverpac.py: FedPAC (clients/clientpac.py: clientPAC.set_parameters "
            "(statistics_extraction), train, collect_protos, set_head; serverpac: proto_aggregation, "
            f"solve_quadratic ({solver}), add_heads): two rounds in FedPAC.train's order, "
            "receive_models after random.seed(4) (the upload order = the selection's); their loss, loss_mse, "
            f"solve_quadratic, cvx.quad_form and set_head wrapped to record; {common}")
    paths.append(save_fixture("fedpac-pfllib-rounds", SNAPSHOTS["pfllib"], call, rerun, inputs, outputs))
    return paths
