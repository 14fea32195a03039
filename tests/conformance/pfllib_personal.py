"""pFedMe's, Per-FedAvg's and FedAMP's fixtures, from PFLlib's code (TsingZ0/PFLlib, ``system/flcore``):
the personalised baselines, as PFLlib runs them.

Their code computes in float64 (``make_fixtures.py`` sets torch's default dtype; nothing on the
paths called here casts back to float32): every float output is float64.

The federation, the data, the model and the adaptations are pfllib_baselines.py's (its docstring):
``NUM_CLIENTS`` = 4 clients of seeded 1 x 16 x 16 images of 4 classes (``SIZES`` 9, 11, 10, 7), two
rounds, round 1 training clients 0, 1, 2 and round 2 clients 1, 2, 3 (``ROUNDS``; their
``select_clients``, unseeded, not called); one local epoch, lr 0.05 (``input.lr``, their
``local_learning_rate``), batch 4 (pFedMe, FedAMP) or B = 2 (Per-FedAvg: ``input.batch_size``, their
``batch_size``); our model (``build_model("cnn", 1, 4, 16, seed=0)``) as their ``BaseHeadSplit(body,
head)``; each server built by its constructor (``serverpFedMe.pFedMe``, ``serverperavg.PerAvg``,
``serveramp.FedAMP``, which build the clients), ``read_client_data`` returning our images, ``h5py`` a
stand-in, ``load_train_data`` their loader (``drop_last=True``, the batch size their code asks for) over
the client's images in our client's order of the round (``input.round<r>.client<p>.seed`` /
``.order``) instead of shuffled, ``receive_models`` after ``random.seed(0)`` (it only orders the
uploads); ``self.loss`` wrapped to record each call (pfllib_baselines' ``_Recorded``). Their
``receive_models`` keeps the clients' model objects, not copies; their ``aggregate_parameters`` is
the average weighted by the uploaded clients' training sizes. ``evaluate`` is not called.

pfedme (``clients/clientpFedMe.py: clientpFedMe.train``, ``optimizers/fedoptimizer.py:
pFedMeOptimizer``, ``servers/serverpFedMe.py: pFedMe``). ``send_models`` (serverbase's: to every
client) sets both the model (theta) and ``local_params`` (w) to the global x. For each batch, K times:
the CE at theta (``.ce``), its gradient g, theta <- theta - p_lr (g + lamda (theta - w) + mu theta)
(their step: CE's gradient only; the proximal and the mu terms are in the step, mu = 0.001 their
optimiser's default, an L2 pull of theta to 0); then w <- w - lamda lr (w - theta) (lr their
``local_learning_rate``, not p_lr). Theta is not reset to w between batches: it carries on from the
previous batch's (from x at the round's start). After the epoch ``update_parameters`` copies w into
the model, which goes up. The server: ``previous_global_model`` (x), ``aggregate_parameters`` (the
weighted average of the w), ``beta_aggregate_parameters``: x <- (1 - beta) x + beta average.
Quirks: their ``personalized_params`` is what the optimiser's step returns, the model's own
parameters (checked), so ``update_parameters`` overwrites it with w: their "personalised"
evaluation (``test_metrics_personalized``, run after ``send_models``) evaluates the just-received
global model, not theta (before a client first trains it is a copy of the initial model); their
``train_metrics_personalized`` adds 0.5 lamda ||w - theta|| (a norm, not squared). Their args:
``input.their.lamda`` 15, ``.K`` 3, ``.p_learning_rate`` 0.03, ``.beta`` 0.5 (``.mu`` 0.001, the
optimiser's default, checked). p_lr (0.03) differs from lr (0.05), so the two step sizes cannot be swapped.

perfedavg (``clients/clientperavg.py: clientPerAvg.train, train_one_step``, ``PerAvgOptimizer``,
``servers/serverperavg.py: PerAvg``). ``send_models`` (to every client) sets the model to x. Their
loader takes 2B a step (``load_train_data(2B)``, drop_last: 2, 2, 2, 1 steps for 9, 11, 10, 7 samples,
checked). Each step: the parameters kept; the CE on the batch's first B (``.inner_ce``), an SGD step
with lr alpha (their optimiser's lr = ``local_learning_rate``); the CE at those adapted weights on the
second B (``.outer_ce``) and its gradient; the parameters put back; w <- w - beta grad (first-order
MAML: the adapted weights' gradient, no Hessian term). Quirks: their client sets ``self.beta =
self.learning_rate`` (``args.beta`` is commented out), so in PFLlib beta = alpha always; here each
client's ``beta`` is set to 0.03 after construction (``input.their.beta``; ``input.their.alpha`` =
0.05, checked equal to their optimiser's lr); ``PerAvgOptimizer.step(beta)`` uses the lr when beta
is 0. Their server calls ``client.train()`` TWICE per round for each selected client; here it is
called ONCE (protofl runs one local training per round): these rounds are not their server's.
Their evaluation (``evaluate_one_step``, at the start of each round after ``send_models``): on every
client (not only the selected), the model kept, ``train_one_step``: one SGD step (lr alpha) on the
first batch of ``load_train_data(B)`` (theirs shuffled; here the order of ``input.eval.client<p>.seed``
= ``order_seed(3, p)``, the next round's, ``.order``), then evaluated, and put back (``clone_model``).
Run here after round 2's aggregate: ``send_models`` (to all four clients, checked), then each
client's ``train_one_step`` (``eval.client<p>.adapted``, ``.ce``), its model put back. (Their
``train_metrics``, not called here, steps the optimiser on each batch before measuring, on a
model ``evaluate_one_step`` puts back afterwards.)

fedamp (``clients/clientamp.py: clientAMP.train, set_parameters``, ``servers/serveramp.py: FedAMP
.send_models, e``). The server's ``send_models`` (its own: only to the selected clients, and only
once something was uploaded; round 1 sends nothing, so ``client_u`` is the client's initial copy)
gives each client c, for each uploaded model j (``uploaded_ids``' order), coef[j] = alphaK e(||w_c -
w_j||^2), e(x) = exp(-x / sigma) / sigma, and coef[j] = 0 where uploaded_ids[j] is c itself;
coef_self = 1 - sum(coef) (coef has ``num_join_clients`` = 3 entries); then ``set_parameters``:
client_u = sum_j coef[j] w_j + coef_self w_c. w_c is ``c.model``: for a client that uploaded, its own
trained model, the very object in ``uploaded_models`` (checked; its slot's coef is 0); for client 3
in round 2, which never trained, the initial copy its constructor made (checked): its three coef are
all > 0. The client then trains its own model (``send_models`` does not change ``c.model``), plain
SGD (lr) from where it was, on CE + 0.5 lamda / alphaK ||w - u||, the norm not squared and computed on
``.data``: no gradient. So u never changes the weights (checked: the trained weights are the same
to the bit with lamda 1 and 1000): their FedAMP trains each client as local training, the term is
in the reported loss only. The server never aggregates: its ``global_model`` stays the initial
one (checked), a template of zeros for each u. Their args: ``input.their.alphaK`` 0.005,
``.lamda`` 1, ``.sigma`` 0.01, chosen from the round-1 trained models' squared distances (0.0055
to 0.017: sigma of their order, so that e's exponential varies, 0.18 to 0.58) so that round 2's
coef are 0.089 to 0.29 and coef_self 0.23 to 0.70.

Outputs, with ``<name>`` our state_dict names, each model entry as a :func:`fingerprint`; losses one
per step (pFedMe's, one per inner step, K a batch, in order), float64:

- every fixture: ``initial.<name>`` (their global model at construction);
- pfedme: ``round<r>.client<p>.personal.<name>`` (theta at the end of the epoch, read before
  ``update_parameters`` copies w into the model), ``.trained.<name>`` (w: their ``local_params``
  after ``train``, what goes up), ``.ce``; ``round<r>.average.<name>`` (after
  ``aggregate_parameters``) and ``round<r>.aggregate.<name>`` (after the beta mixing: the next
  round's x);
- perfedavg: ``round<r>.client<p>.trained.<name>``, ``.inner_ce``, ``.outer_ce`` (one each per 2B
  step); ``round<r>.aggregate.<name>``; ``eval.client<p>.adapted.<name>`` (after round 2's
  aggregate: that model after one step on the first B of the order of ``input.eval.client<p>.seed``)
  and ``eval.client<p>.ce`` (that step's CE, one);
- fedamp: ``round<r>.client<p>.u.<name>`` (``client_u`` after ``send_models``: round 1 the initial
  model), ``.trained.<name>`` (``c.model``, what goes up), ``.ce`` and ``.loss`` (their total, CE +
  0.5 lamda / alphaK ||w - u||); round 2's ``round2.client<p>.coef`` (3, in round 1's uploaded
  order), ``.coef_self`` and ``.sq_distance`` (the ||w_c - w_j||^2 they computed; 0 in c's own slot,
  which they skip); ``round<r>.uploaded_ids`` (int64, their ``receive_models`` order: round 1's
  orders round 2's coef).
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from conformance.common import Snapshot, save_fixture
from conformance.pfllib_baselines import (
    LR, ROUNDS, SIZES, _fingerprints, _Recorded, batch_order, client_inputs, order_seed, their_server,
)

SNAPSHOTS = {"pfllib": Snapshot("TsingZ0/PFLlib", "d832e76f6a23b833038949ec1e4fdefe63a4d350")}

PFEDME = {"lamda": 15.0, "K": 3, "p_learning_rate": 0.03, "beta": 0.5}  # their args
PERAVG_BATCH, PERAVG_BETA = 2, 0.03  # B (their loader takes 2B a step), the outer step size set on their clients
EVAL_ROUND = len(ROUNDS) + 1  # Per-FedAvg's evaluation: their next round's evaluate_one_step
FEDAMP = {"alphaK": 0.005, "lamda": 1.0, "sigma": 0.01}  # their args (see the docstring for the choice)


def _select(server, clients) -> None:
    server.selected_clients = [server.clients[p] for p in clients]  # select_clients, without its draw
    server.current_num_join_clients = len(clients)


def _feed(client, x: torch.Tensor, y: torch.Tensor, order: np.ndarray) -> None:
    """Their ``load_train_data(batch_size=None)`` (the client's batch size unless asked for another),
    drop_last as theirs, over the images in ``order`` instead of shuffled."""
    order = torch.from_numpy(order)
    batches = TensorDataset(x[order], y[order])

    def load_train_data(batch_size=None):
        return DataLoader(batches, client.batch_size if batch_size is None else batch_size, shuffle=False,
                          drop_last=True)

    client.load_train_data = load_train_data


def _receive(server) -> None:
    random.seed(0)  # receive_models' random.sample: only the order of the uploads
    server.receive_models()


def _pfedme(checkout: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    server, x, y, our_names = their_server(checkout, "serverpFedMe", "pFedMe", inputs, PFEDME)
    assert all(c.optimizer.param_groups[0]["mu"] == inputs["their.mu"] for c in server.clients)
    outputs = _fingerprints(server.global_model.parameters(), our_names, "initial")
    for r, clients in ROUNDS.items():
        _select(server, clients)
        server.send_models()
        recorders, personal = {}, {}
        for p in clients:
            client = server.clients[p]
            _feed(client, x[p], y[p], inputs[f"round{r}.client{p}.order"])
            recorders[p] = client.loss = _Recorded(client)
            personal[p] = []

            def update_parameters(model, new_params, client=client, taken=personal[p]):
                taken.append([q.detach().clone() for q in model.parameters()])  # theta, before w is copied in
                type(client).update_parameters(client, model, new_params)

            client.update_parameters = update_parameters
        for client in server.selected_clients:
            client.train()
        for p in clients:
            client, prefix = server.clients[p], f"round{r}.client{p}"
            del client.update_parameters
            assert len(personal[p]) == 1
            # their personalized_params are the model's own parameters (what the optimiser's step returns)
            assert all(a is b for a, b in zip(client.personalized_params, client.model.parameters()))
            outputs |= _fingerprints(personal[p][0], our_names, f"{prefix}.personal")
            outputs |= _fingerprints(client.local_params, our_names, f"{prefix}.trained")
            assert all(torch.equal(a, b) for a, b in zip(client.local_params, client.model.parameters()))
            outputs[f"{prefix}.ce"] = np.array(recorders[p].ce)
            assert len(recorders[p].ce) == PFEDME["K"] * (SIZES[p] // int(inputs["batch_size"]))
        server.previous_global_model = copy.deepcopy(list(server.global_model.parameters()))
        _receive(server)
        server.aggregate_parameters()
        outputs |= _fingerprints(server.global_model.parameters(), our_names, f"round{r}.average")
        server.beta_aggregate_parameters()
        outputs |= _fingerprints(server.global_model.parameters(), our_names, f"round{r}.aggregate")
    return outputs


def _perfedavg(checkout: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    server, x, y, our_names = their_server(checkout, "serverperavg", "PerAvg", inputs, {})
    for client in server.clients:
        assert client.beta == client.learning_rate == inputs["their.alpha"]  # their default: beta = alpha
        assert client.optimizer.param_groups[0]["lr"] == inputs["their.alpha"]
        client.beta = float(inputs["their.beta"])
    outputs = _fingerprints(server.global_model.parameters(), our_names, "initial")
    for r, clients in ROUNDS.items():
        _select(server, clients)
        server.send_models()
        recorders = {}
        for p in clients:
            client = server.clients[p]
            _feed(client, x[p], y[p], inputs[f"round{r}.client{p}.order"])
            recorders[p] = client.loss = _Recorded(client)
        for client in server.selected_clients:
            client.train()  # once (their server trains each selected client twice a round)
        for p in clients:
            client, ce, prefix = server.clients[p], recorders[p].ce, f"round{r}.client{p}"
            assert len(ce) == 2 * (SIZES[p] // (2 * PERAVG_BATCH)) == 2 * {0: 2, 1: 2, 2: 2, 3: 1}[p]
            outputs |= _fingerprints(client.model.parameters(), our_names, f"{prefix}.trained")
            outputs[f"{prefix}.inner_ce"] = np.array(ce[0::2])
            outputs[f"{prefix}.outer_ce"] = np.array(ce[1::2])
        _receive(server)
        server.aggregate_parameters()
        outputs |= _fingerprints(server.global_model.parameters(), our_names, f"round{r}.aggregate")
    # their evaluate_one_step, at the start of the next round: send_models (to every client), then on
    # each client one SGD step (lr alpha) on its loader's first batch of B, the model put back after
    server.send_models()
    for p, client in enumerate(server.clients):
        assert all(torch.equal(a, b) for a, b in zip(client.model.parameters(), server.global_model.parameters()))
        _feed(client, x[p], y[p], inputs[f"eval.client{p}.order"])
        recorder = client.loss = _Recorded(client)
        kept = copy.deepcopy(client.model)
        client.train_one_step()
        outputs |= _fingerprints(client.model.parameters(), our_names, f"eval.client{p}.adapted")
        outputs[f"eval.client{p}.ce"] = np.array(recorder.ce)
        client.clone_model(kept, client.model)
    return outputs


def _fedamp(checkout: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    their_args = {name: float(inputs[f"their.{name}"]) for name in FEDAMP}
    server, x, y, our_names = their_server(checkout, "serveramp", "FedAMP", inputs, their_args)
    outputs = _fingerprints(server.global_model.parameters(), our_names, "initial")
    initial = copy.deepcopy(server.global_model)  # their server's global model: never aggregated, stays so
    calls: list[tuple[float, float]] = []  # their e(x): (x, e(x)), since the last client's set_parameters

    def e(value):
        calls.append((float(value), type(server).e(server, value)))
        return calls[-1][1]

    server.e = e
    for r, clients in ROUNDS.items():
        _select(server, clients)
        sent = {}

        def set_parameters(model, coef_self, client):
            """Their coef, rebuilt from the e(x) calls of this client's pass in their order."""
            others = iter(calls)
            coef, distance = torch.zeros(server.num_join_clients), torch.zeros(server.num_join_clients)
            for j, uploaded in enumerate(server.uploaded_ids):
                if uploaded == client.id:  # their c.model: the uploaded model itself (the same object)
                    assert server.uploaded_models[j] is client.model
                else:
                    distance[j], value = next(others)
                    coef[j] = server.alphaK * value
            assert next(others, None) is None and calls
            if client.id not in server.uploaded_ids:  # client 3, which never trained: its initial copy
                assert all(torch.equal(a, b) for a, b in zip(client.model.parameters(), initial.parameters()))
            assert torch.equal(coef_self, 1 - torch.sum(coef))  # their formula, to the bit
            sent[client.id] = coef.numpy(), coef_self.item(), distance.numpy()
            calls.clear()
            type(client).set_parameters(client, model, coef_self)

        for p in clients:
            server.clients[p].set_parameters = lambda model, coef_self, client=server.clients[p]: set_parameters(
                model, coef_self, client)
        server.send_models()
        assert sorted(sent) == ([] if r == 1 else list(clients))  # round 1: nothing uploaded yet, nothing sent
        recorders = {}
        for p in clients:
            client, prefix = server.clients[p], f"round{r}.client{p}"
            del client.set_parameters
            outputs |= _fingerprints(client.client_u.parameters(), our_names, f"{prefix}.u")
            if p in sent:
                outputs[f"{prefix}.coef"], outputs[f"{prefix}.coef_self"], outputs[f"{prefix}.sq_distance"] = (
                    np.asarray(v, dtype=np.float64) for v in sent[p])
            _feed(client, x[p], y[p], inputs[f"round{r}.client{p}.order"])
            recorders[p] = client.loss = _Recorded(client)
        for client in server.selected_clients:
            client.train()
        for p in clients:
            client, recorded, prefix = server.clients[p], recorders[p], f"round{r}.client{p}"
            outputs |= _fingerprints(client.model.parameters(), our_names, f"{prefix}.trained")
            outputs[f"{prefix}.ce"] = np.array(recorded.ce)
            outputs[f"{prefix}.loss"] = np.array([t.item() for t in recorded.totals])
            assert len(recorded.ce) == SIZES[p] // int(inputs["batch_size"])
        _receive(server)
        outputs[f"round{r}.uploaded_ids"] = np.array(server.uploaded_ids, dtype=np.int64)
    assert all(torch.equal(a, b) for a, b in zip(server.global_model.parameters(), initial.parameters()))
    return outputs


def _check(method: str, outputs: dict[str, np.ndarray]) -> None:
    """What makes a fixture worth comparing with: finite numbers, a second round unlike the first."""
    for key, value in outputs.items():
        assert np.isfinite(value).all(), f"{method}: {key} not finite"
        if key.startswith("round2.") and "round1." + key[len("round2."):] in outputs:
            assert not np.array_equal(value, outputs["round1." + key[len("round2."):]]), f"{method}: {key} as round 1"
    if method == "pfedme":
        for key in (k for k in outputs if ".average." in k):
            assert not np.array_equal(outputs[key], outputs[key.replace(".average.", ".aggregate.")]), key
    if method == "fedamp":
        for p in ROUNDS[2]:
            coef, coef_self = outputs[f"round2.client{p}.coef"], outputs[f"round2.client{p}.coef_self"]
            assert ((coef == 0) | ((coef > 0.02) & (coef < 0.4))).all() and 0.1 < coef_self < 0.9, (p, coef)


def _inputs(method: str) -> dict[str, np.ndarray]:
    inputs = client_inputs()
    if method == "pfedme":
        return inputs | {f"their.{k}": np.float64(v) for k, v in PFEDME.items() if k != "K"} | {
            "their.K": np.int64(PFEDME["K"]), "their.mu": np.float64(0.001)}  # their pFedMeOptimizer's default
    if method == "perfedavg":
        inputs |= {"batch_size": np.int64(PERAVG_BATCH), "their.alpha": np.float64(LR),
                   "their.beta": np.float64(PERAVG_BETA)}
        for p, n in enumerate(SIZES):
            seed = order_seed(EVAL_ROUND, p)
            inputs |= {f"eval.client{p}.seed": np.int64(seed), f"eval.client{p}.order": batch_order(n, seed)}
        return inputs
    return inputs | {f"their.{k}": np.float64(v) for k, v in FEDAMP.items()}


RUNS = {"pfedme": _pfedme, "perfedavg": _perfedavg, "fedamp": _fedamp}
CALLS = {
    "pfedme": "servers/serverpFedMe.py: pFedMe (clients/clientpFedMe.py: clientpFedMe.train, optimizers/"
              "fedoptimizer.py: pFedMeOptimizer): send_models, train, previous_global_model, receive_models, "
              "aggregate_parameters, beta_aggregate_parameters; update_parameters wrapped to read theta first",
    "perfedavg": "servers/serverperavg.py: PerAvg (clients/clientperavg.py: clientPerAvg.train, train_one_step; "
                 "PerAvgOptimizer), each client's beta set to 0.03: send_models, train ONCE per selected client "
                 "(theirs: twice), receive_models, aggregate_parameters; then evaluate_one_step's send_models, "
                 "train_one_step and clone_model on every client",
    "fedamp": "servers/serveramp.py: FedAMP (send_models, e; clients/clientamp.py: clientAMP.train, set_parameters): "
              "send_models, train, receive_models; e and set_parameters wrapped to record coef and coef_self",
}


def make(checkouts: dict[str, Path], rerun: str) -> list[Path]:
    paths = []
    for method, run in RUNS.items():
        inputs = _inputs(method)
        outputs = run(checkouts["pfllib"], inputs)
        _check(method, outputs)
        if method == "fedamp":  # their term has no gradient: another lamda trains the same weights, to the bit
            other = run(checkouts["pfllib"], inputs | {"their.lamda": np.float64(1000.0)})
            assert all(np.array_equal(v, other[k]) for k, v in outputs.items() if ".loss" not in k)
            assert not np.array_equal(outputs["round2.client1.loss"], other["round2.client1.loss"])
        call = (f"system/flcore/{CALLS[method]}; their server built by its constructor, two rounds, the selection "
                "set (rounds 1: clients 0-2, 2: clients 1-3), receive_models after random.seed(0); read_client_data "
                "returns seeded 1x16x16 images, load_train_data a DataLoader(shuffle=False, drop_last=True) in our "
                "client's order, h5py a stand-in; the model BaseHeadSplit(body, head) of protofl's build_model('cnn', "
                "1, 4, 16, seed=0); self.loss wrapped to record each call; in float64")
        paths.append(save_fixture(f"{method}-pfllib-rounds", SNAPSHOTS["pfllib"], call, rerun, inputs, outputs))
    return paths
