"""What a server rule keeps between rounds: the attributes a strategy's ``state_fields`` names.

Their values may be anything a checkpoint holds (arrays, :class:`~protofl.federation.wire.ClassVectors`,
scalars, lists and dicts of them, torch tensors) and also torch modules (a server-side model: FedGH's
head, FedGen's generator) and torch optimizers (their moments and steps): :class:`MethodState`
takes a snapshot of them before each round's rule (and puts it back when the rule's output is
rejected), gives their checkpoint form, and restores them from a checkpoint. A module or optimizer
is restored in place (``load_state_dict``), so that an optimizer still steps the module's own
parameters; every other value is replaced.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import numpy as np
import torch


class MethodState:
    """The ``names`` attributes of ``owner`` (a strategy), as one unit."""

    def __init__(self, owner: Any, names: Sequence[str]) -> None:
        self.owner, self.names = owner, tuple(names)

    def snapshot(self) -> dict[str, Any]:
        """A copy of every value, independent of the live objects (tensors cloned)."""
        return {name: _copy(getattr(self.owner, name)) for name in self.names}

    def checkpointed(self) -> dict[str, Any]:
        """Every value in a checkpoint's form (a module or optimizer as its ``state_dict``)."""
        return {name: _plain(getattr(self.owner, name)) for name in self.names}

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Put back a :meth:`snapshot` or a :meth:`checkpointed` form read from a checkpoint."""
        for name in self.names:
            current, value = getattr(self.owner, name), saved[name]
            if isinstance(current, (torch.nn.Module, torch.optim.Optimizer)):
                current.load_state_dict(_as_tensors(value, like=current.state_dict()))
            else:
                setattr(self.owner, name, value)


def _plain(value: Any) -> Any:
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
        return value.state_dict()
    return value


def _copy(value: Any) -> Any:
    plain = _plain(value)
    if isinstance(value, torch.nn.Module):  # state_dict's tensors are the module's own
        return {k: v.detach().clone() for k, v in plain.items()}
    return _copied(plain)


def _copied(value: Any) -> Any:
    """A deep copy that shares each read-only numpy array: nothing changes one in place, so a rule
    that keeps many models and marks them read-only (FedAMP: 233 MB at 100 clients) is not copied
    each round."""
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        return value
    if type(value) is dict:
        return {k: _copied(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_copied(v) for v in value)
    return copy.deepcopy(value)


def _as_tensors(value: Any, like: Any) -> Any:
    """``value`` (a checkpoint's tree: arrays, lists, string keys) in the types of ``like`` (a live
    ``state_dict``: tensors, tuples, integer keys), so that ``load_state_dict`` takes it."""
    if isinstance(like, torch.Tensor):
        return torch.as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value,
                               dtype=like.dtype, device=like.device).clone()
    if isinstance(like, Mapping) and isinstance(value, Mapping):
        keys = {str(k): k for k in like}  # a checkpoint's keys are strings, a state_dict's may be integers
        pairs = ((keys.get(str(k), k), v) for k, v in value.items())
        return type(like)((k, _as_tensors(v, like.get(k))) for k, v in pairs)
    if isinstance(like, (list, tuple)) and isinstance(value, (list, tuple)) and len(like) == len(value):
        return type(like)(_as_tensors(v, w) for v, w in zip(value, like))
    return value
