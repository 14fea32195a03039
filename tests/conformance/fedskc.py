"""FedSKC fixtures from the authors' code: hwang52/FedSKC (``main_fedskc.py``, ``utils/``).

    git clone <mirror of hwang52/FedSKC> /tmp/ref/FedSKC && git -C /tmp/ref/FedSKC checkout 002e436
    python tests/conformance/make_fixtures.py fedskc --checkout /tmp/ref/FedSKC

What each fixture calls (their names; ``G`` = ``main_fedskc.Global``, ``L`` = ``main_fedskc.Local``):

- ``fedskc-lcl``: ``InfoNCE_LCL(tau=0.08).infonce_lcl_loss`` on the positive and negative keys
  built as ``L.local_train`` builds them (its lines 171-178), and the loss's gradient;
- ``fedskc-knowledge``: ``utils.util_func.average_kns`` (the per-class mean logits);
- ``fedskc-global-knowledge``: ``G.get_global_kn`` and ``G.get_dis_weights`` (GDA) at raw and
  at small sample counts;
- ``fedskc-aggregation``: ``G.discrepancy_aggregation`` and ``G.average_parameters``;
- ``fedskc-gpr``: ``G.period_review`` (beta 0.99, every state entry), with the same classes in
  both rounds and with a class gone;
- ``fedskc-local-round``: ``L.local_train`` from a fixed state (round 40: LCL weight 0.4);
- ``fedskc-server-round``: one round of ``FedSKC_main``'s server steps (its lines 261-271);
- ``fedskc-partition``: ``utils.sample_dirichlet.clients_indices`` (the partitioner FedSC shares).

Adapted, not changed: their ``Local`` and ``Global`` build a CIFAR ResNet and crop/flip each batch;
the fixtures swap in :func:`~conformance.fedsc_fedskc_common.small_model` (Linear, BatchNorm, ReLU,
Linear) and the identity transform, and train on one full batch per epoch, so their DataLoader's
shuffle only reorders sums. Their ``args_parser()`` reads ``sys.argv``, which ``make`` sets.

Dtypes: their code runs in float64, and nothing on its path casts to float32. The class vectors
that cross protofl's wire (the clients' knowledge to the server, the global knowledge back) are
float32 values, stored so and handed to their code as float64 tensors. The clients' knowledge is
moreover on a grid of 2^-12 (:func:`_on_a_grid`): their pairwise means (the neighbour merge) and
sums are then float32 numbers too, so protofl's server, which merges and sums in float32, rounds
only where it divides by the number of holders.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from conformance.common import Snapshot, save_fixture, seeded
from conformance.fedsc_fedskc_common import (
    IDENTITY_TRANSFORMS,
    IN_DIM,
    authors_script,
    on_the_wire,
    perturbed_states,
    small_model,
    stacked_states,
    state_arrays,
    state_from_arrays,
    their_array,
    their_tensor,
)

SNAPSHOTS = {"fedskc": Snapshot("hwang52/FedSKC", "002e4361e994274b769be09902f404290b9145c0")}
NUM_CLASSES = 5
TAU = 0.08
LOCAL_ROUND = 40  # their LCL weight min(round / 100, 1) = 0.4
LOCAL_EPOCHS, LOCAL_LR = 3, 0.1
GRID = 2.0**-12  # the clients' knowledge: multiples of it, |x| < 2^4 (16 bits of float32's 24)


def _argv(batch_size: int = 64) -> list[str]:
    return ["--data_name", "cifar10", "--num_classes", str(NUM_CLASSES), "--device", "cpu",
            "--num_epochs_local_training", str(LOCAL_EPOCHS), "--batch_size_local_training", str(batch_size),
            "--lr_local_training", str(LOCAL_LR)]


def _knowledge_dict(vectors: np.ndarray, mask: np.ndarray) -> dict[int, torch.Tensor]:
    return {int(c): their_tensor(vectors[c]) for c in np.flatnonzero(mask)}


def _from_dict(knowledge: dict[int, torch.Tensor], dim: int) -> tuple[np.ndarray, np.ndarray]:
    vectors, mask = np.zeros((NUM_CLASSES, dim), np.float64), np.zeros(NUM_CLASSES, bool)
    for c, v in knowledge.items():
        vectors[c], mask[c] = their_array(v), True
    return vectors, mask


def _on_a_grid(values: np.ndarray) -> np.ndarray:
    """``values`` (|x| < 2^4) rounded to multiples of :data:`GRID`, as float32: exact, and so are the
    means of two and the sums of up to 2^7 of them (at most 16 + 1 + 7 bits)."""
    assert np.abs(values).max() < 16
    return on_the_wire(np.round(values / GRID) * GRID)


def lcl(m, rng) -> tuple[dict, dict]:
    batch = 16
    logits = 3 * rng.standard_normal((batch, NUM_CLASSES))  # the client's own logits: float64
    labels = rng.integers(0, NUM_CLASSES, batch)
    labels[:3] = NUM_CLASSES - 1  # class 4 has no global knowledge: their fallback positive
    knowledge = on_the_wire(rng.standard_normal((NUM_CLASSES, NUM_CLASSES)))  # from the server: float32
    mask = np.arange(NUM_CLASSES) != NUM_CLASSES - 1
    global_kn = _knowledge_dict(knowledge, mask)
    outputs = torch.from_numpy(logits).requires_grad_(True)
    labels_g = torch.from_numpy(labels)
    pos_key, neg_keys = [], []  # as L.local_train, lines 171-178
    for i in range(len(labels_g)):
        label_id = labels_g[i].item()
        try:
            pos_key.append(global_kn[label_id])
        except KeyError:
            pos_key.append(outputs[i].detach())
        neg_keys.append(torch.stack(list(global_kn.values())))
    loss = m.InfoNCE_LCL(tau=TAU).infonce_lcl_loss(outputs, torch.stack(pos_key), torch.stack(neg_keys))
    loss.backward()
    inputs = {"logits": logits, "labels": labels, "knowledge": knowledge, "mask": mask, "temperature": np.float64(TAU)}
    return inputs, {"loss": their_array(loss), "gradient": their_array(outputs.grad)}


def knowledge(util_func, rng) -> tuple[dict, dict]:
    vectors = rng.standard_normal((20, NUM_CLASSES))  # the client's logits: float64
    labels = rng.integers(0, NUM_CLASSES - 1, 20)  # class 4 absent
    labels[0] = 2
    by_label: dict[int, list[torch.Tensor]] = {}
    for v, y in zip(vectors, labels):
        by_label.setdefault(int(y), []).append(their_tensor(v))
    means, mask = _from_dict(util_func.average_kns(by_label), NUM_CLASSES)
    return {"vectors": vectors, "labels": labels}, {"means": means, "mask": mask}


def _client_knowledge(rng, clients: int) -> tuple[np.ndarray, np.ndarray]:
    """K x C x C knowledge (as it reaches the server: float32, on the grid) and K x C held: class 3
    held by client 1 alone, class 4 by nobody."""
    vectors = _on_a_grid(2 * rng.standard_normal((clients, NUM_CLASSES, NUM_CLASSES)))
    held = np.ones((clients, NUM_CLASSES), bool)
    held[:, 3] = False
    held[1, 3] = True
    held[:, 4] = False
    held[0, 1] = held[3, 2] = False
    return vectors * held[..., None], held


def global_knowledge_and_gda(server, rng) -> tuple[dict, dict]:
    clients = 5
    vectors, held = _client_knowledge(rng, clients)
    local_kns = [_knowledge_dict(vectors[k], held[k]) for k in range(clients)]
    global_kn = server.get_global_kn(copy.deepcopy(local_kns))
    merged, mask = _from_dict(global_kn, NUM_CLASSES)
    sizes = np.array([120, 45, 300, 80, 10])
    small_sizes = np.array([1, 2, 3, 2, 1])
    weights = server.get_dis_weights(sizes.tolist(), local_kns, global_kn)
    small = server.get_dis_weights(small_sizes.tolist(), local_kns, global_kn)
    inputs = {"knowledge": vectors, "held": held, "sizes": sizes, "small_sizes": small_sizes}
    outputs = {"global_knowledge": merged, "mask": mask, "gda_weights": np.asarray(weights),
               "gda_weights_small_sizes": np.asarray(small)}
    return inputs, outputs


def aggregation(server, rng) -> tuple[dict, dict]:
    states = perturbed_states(rng, 3, NUM_CLASSES)
    weights = [0.5, 0.3, 0.2]
    sizes = [30, 12, 58]
    torch_states = [state_from_arrays(s) for s in states]
    gda = state_arrays(server.discrepancy_aggregation(copy.deepcopy(torch_states), weights))
    fedavg = state_arrays(server.average_parameters(copy.deepcopy(torch_states), sizes))
    floats = [name for name in states[0] if states[0][name].dtype.kind == "f"]
    inputs = {**stacked_states(states, "client"), "weights": np.array(weights), "sizes": np.array(sizes)}
    outputs = {**{f"gda.{n}": gda[n] for n in floats}, **{f"fedavg.{n}": fedavg[n] for n in floats}}
    return inputs, outputs


def gpr(server, rng) -> tuple[dict, dict]:
    current, previous = perturbed_states(rng, 2, NUM_CLASSES)
    floats = [name for name in current if current[name].dtype.kind == "f"]
    knowledge_now = on_the_wire(rng.standard_normal((NUM_CLASSES, NUM_CLASSES)))  # the server's: float32
    knowledge_before = on_the_wire(0.8 * rng.standard_normal((NUM_CLASSES, NUM_CLASSES)))
    everything = np.ones(NUM_CLASSES, bool)
    class_gone = np.arange(NUM_CLASSES) != 2  # class 2 held by nobody this round
    outputs = {}
    for case, mask_now in (("same_classes", everything), ("class_gone", class_gone)):
        reviewed = server.period_review(
            state_from_arrays({n: current[n] for n in floats}), state_from_arrays({n: previous[n] for n in floats}),
            _knowledge_dict(knowledge_now, mask_now), _knowledge_dict(knowledge_before, everything),
        )
        outputs |= {f"{case}.{n}": v for n, v in state_arrays(reviewed).items()}
    inputs = {**{f"current.{n}": current[n] for n in floats}, **{f"previous.{n}": previous[n] for n in floats},
              "knowledge_now": knowledge_now, "knowledge_before": knowledge_before,
              "mask_before": everything, "mask_now_class_gone": class_gone}
    return inputs, outputs


def _local_data(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((n, IN_DIM))  # the client's own data: float64
    y = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 4, 4, 4, 4, 4][:n])  # class 3 absent, 4 without knowledge
    return x, y


def local_round(m, rng) -> tuple[dict, dict]:
    m.transforms = IDENTITY_TRANSFORMS
    m.ResNet_cifar = lambda **kwargs: small_model(NUM_CLASSES)
    x, y = _local_data(rng, 18)
    start = state_arrays(small_model(NUM_CLASSES).state_dict())
    knowledge = on_the_wire(2 * rng.standard_normal((NUM_CLASSES, NUM_CLASSES)))  # from the server: float32
    mask = np.array([True, True, True, True, False])
    args = m.args_parser()
    assert args.batch_size_local_training >= len(y), "one full batch per epoch"
    local = m.Local(data_client=TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), class_list=None,
                    global_kn=_knowledge_dict(knowledge, mask))
    state, local_kn = local.local_train(args, state_from_arrays(start), LOCAL_ROUND)
    means, held = _from_dict(local_kn, NUM_CLASSES)
    inputs = {"x": x, "y": y, "knowledge": knowledge, "mask": mask, "round": np.int64(LOCAL_ROUND),
              "epochs": np.int64(LOCAL_EPOCHS), "lr": np.float64(LOCAL_LR),
              **{f"start.{n}": v for n, v in start.items()}}
    return inputs, {**{f"state.{n}": v for n, v in state_arrays(state).items()},
                    "knowledge": means, "knowledge_mask": held}


def server_round(server, rng) -> tuple[dict, dict]:
    clients = 4
    states = perturbed_states(rng, clients, NUM_CLASSES)
    previous = perturbed_states(rng, 1, NUM_CLASSES)[0]
    vectors, held = _client_knowledge(rng, clients)
    previous_knowledge = on_the_wire(rng.standard_normal((NUM_CLASSES, NUM_CLASSES)))  # the server's: float32
    previous_mask = np.ones(NUM_CLASSES, bool)  # class 4 held last round, by nobody now
    sizes = [30, 55, 12, 80]
    # FedSKC_main, lines 261-271 (round_id = 2)
    list_dicts_local_params = [state_from_arrays(s) for s in states]
    list_local_kns = [_knowledge_dict(vectors[k], held[k]) for k in range(clients)]
    pre_global_params = state_from_arrays(previous)
    pre_global_kn = _knowledge_dict(previous_knowledge, previous_mask)
    global_kn = server.get_global_kn(list_local_kns)
    list_discrepancy_weights = server.get_dis_weights(sizes, list_local_kns, global_kn)
    global_params = server.discrepancy_aggregation(list_dicts_local_params, list_discrepancy_weights)
    global_params = server.average_parameters(list_dicts_local_params, sizes)
    global_params = server.period_review(global_params, pre_global_params, global_kn, pre_global_kn)
    merged, mask = _from_dict(global_kn, NUM_CLASSES)
    floats = [name for name in previous if previous[name].dtype.kind == "f"]
    reviewed = state_arrays(global_params)
    inputs = {**stacked_states(states, "client"), **{f"previous.{n}": v for n, v in previous.items()},
              "knowledge": vectors, "held": held, "sizes": np.array(sizes),
              "previous_knowledge": previous_knowledge, "previous_mask": previous_mask}
    outputs = {"global_knowledge": merged, "mask": mask, "gda_weights": np.asarray(list_discrepancy_weights),
               **{f"global.{n}": reviewed[n] for n in floats}}
    return inputs, outputs


def partition(sample_dirichlet, rng) -> tuple[dict, dict]:
    per_class = np.array([70, 50, 90, 40, 60])
    labels = np.repeat(np.arange(NUM_CLASSES), per_class)  # sorted by class: their pair list is the data set's order
    label2indices = [list(np.flatnonzero(labels == c)) for c in range(NUM_CLASSES)]
    clients, alpha, seed = 20, 0.2, 66
    parts = sample_dirichlet.clients_indices(label2indices, NUM_CLASSES, clients, alpha, seed)
    owner = np.full(len(labels), -1)
    for k, part in enumerate(parts):
        owner[np.asarray(part, dtype=np.int64)] = k
    inputs = {"labels": labels, "num_clients": np.int64(clients), "alpha": np.float64(alpha), "seed": np.int64(seed)}
    return inputs, {"client_of_sample": owner}


def make(checkouts: dict[str, Path], rerun: str) -> list[Path]:
    snapshot, checkout = SNAPSHOTS["fedskc"], checkouts["fedskc"]
    torch.manual_seed(0)  # their DataLoader's shuffle (reorders sums only: one batch per epoch)
    written = []

    def save(piece: str, call: str, made: tuple[dict, dict]) -> None:
        written.append(save_fixture(f"fedskc-{piece}", snapshot, call, rerun, *made))

    with authors_script(checkout, "main_fedskc", _argv(batch_size=64)) as m:
        import utils.sample_dirichlet as sample_dirichlet  # their utils, on the path inside the block
        import utils.util_func as util_func

        m.ResNet_cifar = lambda **kwargs: small_model(NUM_CLASSES)
        server = m.Global(num_classes=NUM_CLASSES, device="cpu", args=m.args_parser())
        save("lcl", "utils/infonce_lcl.py InfoNCE_LCL(tau=0.08).infonce_lcl_loss, keys as Local.local_train "
             "builds them", lcl(m, seeded(1)))
        save("knowledge", "utils/util_func.py average_kns", knowledge(util_func, seeded(2)))
        save("global-knowledge", "main_fedskc.py Global.get_global_kn, Global.get_dis_weights",
             global_knowledge_and_gda(server, seeded(3)))
        save("aggregation", "main_fedskc.py Global.discrepancy_aggregation, Global.average_parameters",
             aggregation(server, seeded(4)))
        save("gpr", "main_fedskc.py Global.period_review", gpr(server, seeded(5)))
        save("local-round", "main_fedskc.py Local.local_train (small model, identity transforms, one batch per "
             "epoch)", local_round(m, seeded(6)))
        save("server-round", "main_fedskc.py FedSKC_main lines 261-271: get_global_kn, get_dis_weights, "
             "discrepancy_aggregation, average_parameters, period_review", server_round(server, seeded(7)))
        save("partition", "utils/sample_dirichlet.py clients_indices", partition(sample_dirichlet, seeded(8)))
    return written
