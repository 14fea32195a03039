"""FedSC fixtures from the authors' code: hwang52/FedSC (``main_fedsc.py``, ``utils/``).

    git clone <mirror of hwang52/FedSC> /tmp/ref/FedSC && git -C /tmp/ref/FedSC checkout a04dc8e
    python tests/conformance/make_fixtures.py fedsc --checkout /tmp/ref/FedSC

What each fixture calls (their names; ``G`` = ``main_fedsc.Global``, ``L`` = ``main_fedsc.Local``):

- ``fedsc-client-losses``: RPCL, ``InfoNCE_LCL(0.05).infonce_lcl_loss``, and CPDR,
  ``mse_loss(feas, reg_vector)``, on the keys built as ``L.local_train`` builds them (its lines
  174-191), and the gradient of their sum;
- ``fedsc-server``: ``G.get_re_p``, ``G.get_dis_weights``, ``G.get_co_p``, with every client
  holding every class and with classes missing;
- ``fedsc-local-round``: ``L.local_train`` from a fixed state in round 2 with the relational and
  consistent prototypes of ``fedsc-server``;
- ``fedsc-server-round``: one round of ``FedSC_main``'s server steps (its lines 281-284).

Adapted, not changed: as for FedSKC (``conformance/fedskc.py``), the small model and the identity
transform replace their CIFAR ResNet-10 and crop/flip, with one full batch per epoch. Their code
runs in float64; the class vectors that cross protofl's wire (the clients' prototypes to the
server, the relational and consistent prototypes to the clients) are float32 values, stored so and
handed to their code as float64 tensors: ``fedsc-local-round`` rounds the prototypes their server
steps computed to float32 before their ``Local`` gets them, as protofl's clients receive them.
Nothing on their code path casts to float32 (their ``calculate_infonce``, which does, is never
called).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from conformance.common import Snapshot, save_fixture, seeded
from conformance.fedsc_fedskc_common import (
    FEATURE_DIM,
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

SNAPSHOTS = {"fedsc": Snapshot("hwang52/FedSC", "a04dc8e630706a0c3f12f716c45857ead95a4940")}
NUM_CLASSES = 4
TAU = 0.05
LOCAL_EPOCHS, LOCAL_LR = 3, 0.1


def _argv() -> list[str]:
    return ["--data_name", "cifar10", "--num_classes", str(NUM_CLASSES), "--device", "cpu",
            "--num_epochs_local_training", str(LOCAL_EPOCHS), "--batch_size_local_training", "64",
            "--lr_local_training", str(LOCAL_LR)]


def _client_prototypes(rng, clients: int, held: np.ndarray) -> list[dict[int, torch.Tensor]]:
    """The clients' prototypes as they reach the server: float32 values (post-ReLU: >= 0)."""
    vectors = on_the_wire(np.abs(rng.standard_normal((clients, NUM_CLASSES, FEATURE_DIM))))
    return [{int(c): their_tensor(vectors[k, c]) for c in np.flatnonzero(held[k])} for k in range(clients)]


def _as_arrays(prototypes: list[dict[int, torch.Tensor]]) -> np.ndarray:
    """The clients' prototypes as K x C x d float32 (what they were drawn as, exactly)."""
    out = np.zeros((len(prototypes), NUM_CLASSES, FEATURE_DIM), np.float32)
    for k, by_class in enumerate(prototypes):
        for c, v in by_class.items():
            out[k, c] = v.numpy()
    return out


def _relational_rows(re_p: dict[int, list[torch.Tensor]]) -> tuple[np.ndarray, np.ndarray]:
    """Their relational prototypes (class -> list in participant order) as rows and the rows' classes."""
    rows, labels = [], []
    for c in sorted(re_p):
        for v in re_p[c]:
            rows.append(their_array(v))
            labels.append(c)
    return np.array(rows, np.float64), np.array(labels, np.int64)


def _consistent(co_p: dict[int, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    vectors, mask = np.zeros((NUM_CLASSES, FEATURE_DIM), np.float64), np.zeros(NUM_CLASSES, bool)
    for c, v in co_p.items():
        vectors[c], mask[c] = their_array(v), True
    return vectors, mask


def _received(tensor: torch.Tensor) -> torch.Tensor:
    """A prototype their server computed, as a protofl client receives it: rounded to float32 (the
    wire), then float64 again for their float64 ``Local``."""
    return their_tensor(on_the_wire(their_array(tensor)))


def _held_patterns() -> dict[str, np.ndarray]:
    every = np.ones((3, NUM_CLASSES), bool)
    missing = every.copy()
    missing[0, 1] = missing[2, 3] = missing[1, 3] = False  # class 3: client 0 alone
    return {"every_class": every, "missing_classes": missing}


def server(g, rng) -> tuple[dict, dict]:
    inputs, outputs = {}, {}
    for case, held in _held_patterns().items():
        prototypes = _client_prototypes(rng, 3, held)
        counts = rng.integers(5, 40, (3, NUM_CLASSES)) * held
        sizes = counts.sum(axis=1)
        re_p = g.get_re_p(copy.deepcopy(prototypes))
        relational, labels = _relational_rows(re_p)
        discrepancies = g.get_dis_weights(counts.tolist())
        co_p = g.get_co_p(re_p, discrepancies, sizes.tolist())  # scales re_p in place, as in their loop
        consistent, mask = _consistent(co_p)
        scaled, _ = _relational_rows(re_p)
        inputs |= {f"{case}.prototypes": _as_arrays(prototypes), f"{case}.held": held, f"{case}.counts": counts}
        outputs |= {f"{case}.relational": relational, f"{case}.relational_labels": labels,
                    f"{case}.discrepancies": np.asarray(discrepancies), f"{case}.consistent": consistent,
                    f"{case}.consistent_mask": mask, f"{case}.relational_after_co_p": scaled}
    return inputs, outputs


def _keys(re_p_rows: np.ndarray, re_p_labels: np.ndarray) -> dict[int, list[torch.Tensor]]:
    re_p: dict[int, list[torch.Tensor]] = {}
    for v, c in zip(re_p_rows, re_p_labels):
        re_p.setdefault(int(c), []).append(their_tensor(v))
    return re_p


def client_losses(m, rng) -> tuple[dict, dict]:
    batch = 12
    feas = np.abs(rng.standard_normal((batch, FEATURE_DIM)))  # the client's own features: float64
    labels = rng.integers(0, NUM_CLASSES, batch)
    labels[:2] = 3  # class 3 has no relational prototype
    rows = on_the_wire(np.abs(rng.standard_normal((7, FEATURE_DIM))))  # from the server: float32
    row_labels = np.array([0, 0, 0, 1, 1, 2, 2])
    consistent = on_the_wire(np.abs(rng.standard_normal((NUM_CLASSES, FEATURE_DIM))))
    re_p = _keys(rows, row_labels)
    co_p = {c: their_tensor(consistent[c]) for c in range(3)}
    features = torch.from_numpy(feas).requires_grad_(True)
    labels_g = torch.from_numpy(labels)
    pos_key, neg_keys, reg_vector = [], [], []  # as L.local_train, lines 175-191
    for i in range(len(labels_g)):
        label_id = labels_g[i].item()
        try:
            pos_key.append(torch.mean(re_p[label_id], dim=0))  # a list: raises, as in their code
            reg_vector.append(co_p[label_id])
        except Exception:
            pos_key.append(features[i].detach())
            reg_vector.append(features[i].detach())
        neg = [value for key, value in re_p.items() if key != label_id]
        for each_neg_classes in neg:
            neg_keys.append(each_neg_classes)
    rpcl = m.InfoNCE_LCL(TAU).infonce_lcl_loss(features, pos_key, neg_keys)
    cpdr = torch.nn.functional.mse_loss(features, torch.stack(reg_vector))
    (rpcl + cpdr).backward()
    inputs = {"features": feas, "labels": labels, "relational": rows, "relational_labels": row_labels,
              "consistent": consistent, "consistent_mask": np.arange(NUM_CLASSES) < 3, "temperature": np.float64(TAU)}
    return inputs, {"rpcl": their_array(rpcl), "cpdr": their_array(cpdr), "gradient": their_array(features.grad)}


def local_round(m, g, rng) -> tuple[dict, dict]:
    m.transforms = IDENTITY_TRANSFORMS
    m.resnet10 = lambda nclasses: small_model(NUM_CLASSES)
    x = rng.standard_normal((16, IN_DIM))  # the client's own data: float64
    y = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3])  # class 2 absent; 3 held
    start = state_arrays(small_model(NUM_CLASSES).state_dict())
    held = _held_patterns()["missing_classes"]
    prototypes = _client_prototypes(rng, 3, held)
    counts = rng.integers(5, 40, (3, NUM_CLASSES)) * held
    re_p = g.get_re_p(copy.deepcopy(prototypes))
    co_p = g.get_co_p(re_p, g.get_dis_weights(counts.tolist()), counts.sum(axis=1).tolist())
    # as the clients receive them (scaled by get_co_p): through the float32 wire
    re_p = {c: [_received(v) for v in vectors] for c, vectors in re_p.items()}
    co_p = {c: _received(v) for c, v in co_p.items()}
    relational, labels = _relational_rows(re_p)
    consistent, mask = _consistent(co_p)
    local = m.Local(data_client=TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), class_list=None,
                    re_p=re_p, co_p=co_p)
    state, local_p, class_counts = local.local_train(m.args_parser(), state_from_arrays(start), 2)
    means = np.zeros((NUM_CLASSES, FEATURE_DIM), np.float64)
    for c, v in local_p.items():
        means[c] = their_array(v)
    inputs = {"x": x, "y": y, "relational": on_the_wire(relational), "relational_labels": labels,
              "consistent": on_the_wire(consistent), "consistent_mask": mask, "round": np.int64(2),
              "epochs": np.int64(LOCAL_EPOCHS), "lr": np.float64(LOCAL_LR),
              **{f"start.{n}": v for n, v in start.items()}}
    outputs = {**{f"state.{n}": v for n, v in state_arrays(state).items()}, "prototypes": means,
               "class_counts": np.array(class_counts)}
    return inputs, outputs


def server_round(g, rng) -> tuple[dict, dict]:
    held = _held_patterns()["every_class"]
    prototypes = _client_prototypes(rng, 3, held)
    counts = rng.integers(5, 40, (3, NUM_CLASSES))
    states = perturbed_states(rng, 3, NUM_CLASSES)
    list_nums_local_data = counts.sum(axis=1).tolist()
    # FedSC_main, lines 281-284
    re_p = g.get_re_p(copy.deepcopy(prototypes))
    dis_weights = g.get_dis_weights(counts.tolist())
    co_p = g.get_co_p(re_p, dis_weights, list_nums_local_data)
    global_params = g.average_parameters([state_from_arrays(s) for s in states], list_nums_local_data)
    relational, labels = _relational_rows(re_p)
    consistent, mask = _consistent(co_p)
    averaged = state_arrays(global_params)
    floats = [n for n in states[0] if states[0][n].dtype.kind == "f"]
    inputs = {**stacked_states(states, "client"), "prototypes": _as_arrays(prototypes), "counts": counts}
    outputs = {"relational": relational, "relational_labels": labels, "consistent": consistent,
               "consistent_mask": mask, **{f"global.{n}": averaged[n] for n in floats}}
    return inputs, outputs


def make(checkouts: dict[str, Path], rerun: str) -> list[Path]:
    snapshot, checkout = SNAPSHOTS["fedsc"], checkouts["fedsc"]
    torch.manual_seed(0)
    written = []

    def save(piece: str, call: str, made: tuple[dict, dict]) -> None:
        written.append(save_fixture(f"fedsc-{piece}", snapshot, call, rerun, *made))

    with authors_script(checkout, "main_fedsc", _argv()) as m:
        m.resnet10 = lambda nclasses: small_model(NUM_CLASSES)
        g = m.Global(num_classes=NUM_CLASSES, device="cpu", args=m.args_parser())
        save("client-losses", "utils/infonce_lcl.py InfoNCE_LCL(0.05).infonce_lcl_loss and mse_loss, keys as "
             "Local.local_train builds them", client_losses(m, seeded(11)))
        save("server", "main_fedsc.py Global.get_re_p, Global.get_dis_weights, Global.get_co_p", server(g, seeded(12)))
        save("local-round", "main_fedsc.py Local.local_train in round 2 (small model, identity transforms, one "
             "batch per epoch; the relational and consistent prototypes rounded to float32, as protofl's wire "
             "carries them)", local_round(m, g, seeded(13)))
        save("server-round", "main_fedsc.py FedSC_main lines 281-284: get_re_p, get_dis_weights, get_co_p, "
             "average_parameters", server_round(g, seeded(14)))
    return written
