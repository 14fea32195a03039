"""What the FedSC and FedSKC fixture modules share (the two papers come from one group, their code
from one code base): importing an authors' script from its checkout, and the small model both
whole-round fixtures train (the tests build it too).

The two repositories ship top-level packages of the same names (``utils``, ``model``), so each
import of their code happens inside :func:`authors_script`, which takes them out of
``sys.modules`` again afterwards.

Dtypes: their code runs in float64 (``make_fixtures.py`` sets torch's default dtype), so the model
and the clients' states are float64. What crosses protofl's wire as class vectors (the clients'
class means, the server's prototypes and knowledge) is float32 there: the fixtures draw those
values in float32 (:func:`on_the_wire`, stored so) and hand them to their code as float64 tensors
(:func:`their_tensor`), so that both sides start from the same numbers.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Iterator

import numpy as np
import torch
from torch import nn

from protofl.task.models import SplitModel

# the small model of the whole-round fixtures: Linear -> BatchNorm -> ReLU (the feature), Linear (the
# logits); BatchNorm so that the running statistics are part of what is compared
IN_DIM, FEATURE_DIM = 6, 8


def small_model(num_classes: int) -> SplitModel:
    """The whole-round fixtures' model (its weights come from the fixture, not from this init)."""
    body = nn.Sequential(nn.Linear(IN_DIM, FEATURE_DIM), nn.BatchNorm1d(FEATURE_DIM), nn.ReLU())
    return SplitModel(body, nn.Linear(FEATURE_DIM, num_classes), FEATURE_DIM)


def their_array(tensor: torch.Tensor) -> np.ndarray:
    """A tensor their code returned (or our model's, in the fixtures) as an array; a floating one
    must be float64: anything else is a cast to float32 on the way."""
    if tensor.is_floating_point() and tensor.dtype != torch.float64:
        raise TypeError(f"a {tensor.dtype} tensor where the fixtures compute in float64")
    return tensor.detach().cpu().numpy().copy()


def state_arrays(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A state_dict as named float64 arrays (``num_batches_tracked`` as it is: an integer)."""
    return {name: their_array(value) for name, value in state.items()}


def state_from_arrays(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.array(value)) for name, value in arrays.items()}


def on_the_wire(values: np.ndarray) -> np.ndarray:
    """``values`` as protofl's wire carries class vectors: float32."""
    return np.asarray(values, dtype=np.float32)


def their_tensor(values: np.ndarray) -> torch.Tensor:
    """``values`` as their code is given them: a float64 tensor (a float32 array exactly)."""
    return torch.from_numpy(np.array(values, dtype=np.float64))


def perturbed_states(rng: np.random.Generator, clients: int, num_classes: int) -> list[dict[str, np.ndarray]]:
    """``clients`` states of :func:`small_model`, as clients might return them: the weights moved
    by noise, running variances in [1, 2), integers as they are, each in the model's dtype (float64
    under the fixtures' default dtype: parameters go over the wire in their own dtype)."""
    base = state_arrays(small_model(num_classes).state_dict())
    states = []
    for _ in range(clients):
        state = {}
        for name, value in base.items():
            if value.dtype.kind != "f":
                state[name] = value
            elif name.endswith("running_var"):
                state[name] = (1.0 + rng.random(value.shape)).astype(value.dtype)
            else:
                state[name] = (value + 0.3 * rng.standard_normal(value.shape)).astype(value.dtype)
        states.append(state)
    return states


def stacked_states(states: list[dict[str, np.ndarray]], prefix: str) -> dict[str, np.ndarray]:
    """K state dicts as one array per entry, K first: ``<prefix>.<name>``."""
    return {f"{prefix}.{name}": np.stack([s[name] for s in states]) for name in states[0]}


# Their local_train applies RandomCrop(32, padding=4) and a flip to each CIFAR batch: with the
# small model's vectors there is nothing to crop, so the fixtures replace torchvision's transforms
# in their module by the identity (our training runs with augment="none").
IDENTITY_TRANSFORMS = SimpleNamespace(
    Compose=lambda steps: (lambda x: x), RandomCrop=lambda *a, **k: None, RandomHorizontalFlip=lambda *a, **k: None
)


@contextlib.contextmanager
def authors_script(checkout: Path, module: str, argv: list[str]) -> Iterator[ModuleType]:
    """``import <module>`` from ``checkout`` (their script, e.g. ``main_fedskc``) with ``sys.argv``
    set to ``argv`` (their ``args_parser()`` reads it in every ``Local``), undone afterwards."""
    saved_path, saved_argv = list(sys.path), list(sys.argv)
    sys.path.insert(0, str(checkout))
    sys.argv = [f"{module}.py", *argv]
    try:
        yield importlib.import_module(module)
    finally:
        sys.path[:] = saved_path
        sys.argv = saved_argv
        for name in list(sys.modules):
            if name.split(".")[0] in ("utils", "model", module):
                del sys.modules[name]
