"""A model's arrays as numpy lists, and their weighted average (no Flower)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch


def get_weights(model: torch.nn.Module) -> list[np.ndarray]:
    """Every ``state_dict`` entry, in order, as a numpy array."""
    return [v.detach().cpu().numpy() for v in model.state_dict().values()]


def set_weights(model: torch.nn.Module, weights: Sequence[np.ndarray]) -> None:
    """Load a full list of ``state_dict`` arrays, in order (each cast to its entry's dtype)."""
    state = model.state_dict()
    if len(weights) != len(state):
        raise ValueError(f"got {len(weights)} arrays for a model with {len(state)} tensors")
    model.load_state_dict(
        {k: torch.as_tensor(np.asarray(w), dtype=v.dtype) for (k, v), w in zip(state.items(), weights)},
        strict=True,
    )


def all_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model (also those not in ``state_dict``), by name."""
    return dict(model.named_buffers()) | model.state_dict(keep_vars=True)


def tensor_copies(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of each of :func:`all_tensors`, to put back with :func:`copy_tensors`."""
    return {name: tensor.detach().clone() for name, tensor in all_tensors(model).items()}


@torch.no_grad()
def copy_tensors(targets: Mapping[str, torch.Tensor], sources: Mapping[str, torch.Tensor]) -> None:
    """Each tensor of ``targets`` takes, in place, the values of the tensor of its name in ``sources``."""
    for name, tensor in targets.items():
        tensor.copy_(sources[name])


def load_all_tensors(model: torch.nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Load :func:`all_tensors`' arrays back: the ``state_dict`` entries and every buffer."""
    model.load_state_dict({k: torch.from_numpy(arrays[k]) for k in model.state_dict()})
    with torch.no_grad():
        for name, buffer in model.named_buffers():  # also those not in state_dict (a frozen head)
            buffer.copy_(torch.from_numpy(arrays[name]))


def weighted_average(
    arrays_per_client: Sequence[Sequence[np.ndarray]], weights: Sequence[float]
) -> list[np.ndarray]:
    """Layer-wise weighted mean; each result keeps its layer's dtype."""
    w = np.asarray(weights, dtype=np.float64)
    if len(arrays_per_client) == 0 or w.sum() <= 0:
        raise ValueError("nothing to average")
    w = w / w.sum()
    return [
        np.tensordot(w, np.stack([client[i] for client in arrays_per_client]).astype(np.float64), axes=1)
        .astype(arrays_per_client[0][i].dtype)
        for i in range(len(arrays_per_client[0]))
    ]
