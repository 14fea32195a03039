"""The client template's exchanges: the shared model entries in and out, the arrays the server
broadcasts (decoded and checked), and the models a client keeps on its node across rounds (its
personal model in ``local_state``) or beside its own for one fit (frozen reference copies).

:class:`ModelExchange` is the half of :class:`~protofl.federation.client.PrototypeClient` whose
helpers a method's ``receive`` and ``batch_loss`` call.
"""

from __future__ import annotations

import copy
from typing import Mapping, Sequence

import numpy as np
import torch

from protofl.federation.client_round import ClientRound
from protofl.federation.wire import (
    GLOBAL_PROTOTYPES,
    ArraySpec,
    ClassVectors,
    decode_array,
    decode_class_vectors,
    indexed_entries,
)
from protofl.task.models import SplitModel, host_dropouts
from protofl.task.precision import to_channels_last
from protofl.task.weights import all_tensors, load_all_tensors

MODEL_PREFIX = "model/"  # local_state names of the personal model's entries


class ModelExchange:
    """Model and broadcast helpers for a client (mixed into
    :class:`~protofl.federation.client.PrototypeClient`, whose ``model``, ``data``, ``state``,
    ``shared_names`` and ``max_payload_bytes`` it uses)."""

    model: SplitModel
    exchanged: SplitModel  # the model whose shared entries travel (PrototypeClient.exchanged_model)

    @property
    def local_state(self) -> dict[str, np.ndarray]:
        """Named arrays kept for this partition across rounds (a personal model, FedSA's margin): as
        its last fit before this round saved them; saved again after this fit. Never sent."""
        return self.state.arrays

    # --- the shared model entries -------------------------------------------------------

    def shared_arrays(self) -> list[np.ndarray]:
        """The entries of the exchanged model that this method shares, in ``state_dict`` order: all the
        server may see."""
        state = self.exchanged.state_dict()
        return [state[name].detach().cpu().numpy() for name in self.shared_names]

    def load_shared(self, arrays: list[np.ndarray]) -> None:
        """Load the shared entries (the others keep their values)."""
        if len(arrays) != len(self.shared_names):
            raise ValueError(f"got {len(arrays)} arrays, this method shares {len(self.shared_names)} model entries")
        state = self.exchanged.state_dict()
        loaded = {name: torch.as_tensor(np.asarray(a), dtype=state[name].dtype)
                  for name, a in zip(self.shared_names, arrays)}
        self.exchanged.load_state_dict(loaded, strict=False)

    # --- what the server broadcasts -----------------------------------------------------

    def received(self, this_round: ClientRound, key: str, spec: ArraySpec) -> np.ndarray | None:
        """A broadcast array of the round, validated; None when not sent."""
        if key not in this_round.broadcasts:
            return None
        return decode_array(this_round.broadcasts[key], spec, self.max_payload_bytes)

    def received_like(self, this_round: ClientRound, name: str,
                      like: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """Arrays broadcast under ``name`` as one per tensor of ``like`` (:func:`~protofl.federation.wire.indexed`),
        each checked against its tensor's shape and dtype, as tensors on its device; None when not
        sent (SCAFFOLD's server control variate, one per parameter)."""
        if f"{name}/0" not in this_round.broadcasts:
            return None
        specs = [ArraySpec(tuple(t.shape), (str(t.dtype).removeprefix("torch."),)) for t in like]
        arrays = indexed_entries(this_round.broadcasts, name, specs, self.max_payload_bytes)
        return [torch.from_numpy(a).to(t.device) for a, t in zip(arrays, like)]

    def received_class_vectors(self, this_round: ClientRound, name: str) -> np.ndarray | None:
        """A C x d broadcast array (anchors, prototypes); None when not sent."""
        return decode_class_vectors(this_round.broadcasts, name, self.data.num_classes, self.model.feature_dim,
                                    self.max_payload_bytes)

    def received_masked_vectors(
        self, this_round: ClientRound, name: str, dim: int | None = None
    ) -> ClassVectors | None:
        """Class vectors (``dim``: the feature size unless given) and their mask; None when not sent."""
        dim = dim or self.model.feature_dim
        return ClassVectors.from_config(this_round.broadcasts, name, self.data.num_classes, dim, self.max_payload_bytes)

    def global_prototypes(self, this_round: ClientRound) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The server's (C x d prototypes, C mask of classes that have one) on this client's
        device; None before the server has any."""
        received = self.received_masked_vectors(this_round, GLOBAL_PROTOTYPES)
        if received is None:
            return None
        return torch.from_numpy(received.vectors).to(self.device), torch.from_numpy(received.mask).to(self.device)

    # --- kept and reference models ------------------------------------------------------

    def stored_model(self, prefix: str = MODEL_PREFIX) -> dict[str, np.ndarray]:
        """The model kept in :attr:`local_state` under ``prefix``, by entry name; empty before there is one."""
        return {k[len(prefix):]: v for k, v in self.local_state.items() if k.startswith(prefix)}

    def restore_personal_model(self, model: torch.nn.Module | None = None, prefix: str = MODEL_PREFIX) -> bool:
        """Load the model kept in :attr:`local_state` (under ``prefix``) into ``model`` (default: the
        client's); False before there is one."""
        stored = self.stored_model(prefix)
        if stored:
            load_all_tensors(self.model if model is None else model, stored)
        return bool(stored)

    def store_personal_model(self, model: torch.nn.Module | None = None, prefix: str = MODEL_PREFIX) -> None:
        """Keep ``model`` (default: the client's; parameters and every buffer) in :attr:`local_state`."""
        tensors = all_tensors(self.model if model is None else model)
        self.local_state.update({prefix + k: v.detach().to("cpu", copy=True).numpy() for k, v in tensors.items()})

    def frozen_copy(self, stored: Mapping[str, np.ndarray] | None = None) -> SplitModel:
        """A copy of the model as it is now (the global model just received, the initial one before
        ``receive``), with the entries of ``stored`` (:meth:`stored_model`) loaded when given and not
        empty, no gradients, no dropout (its masks would come from a copy of the client's generators,
        whatever the copy's thread last drew), in the training step's memory format: a reference model
        for ``batch_loss`` (MOON's, FedNTD's)."""
        reference = copy.deepcopy(self.model)
        if stored:
            load_all_tensors(reference, dict(stored))
        reference.requires_grad_(False)
        for layer in host_dropouts(reference):
            layer.p = 0.0
        # in the memory format the training step runs the batches in, whatever an earlier pass left
        # the model in: a convolution's float sums depend on it
        to_channels_last(reference, self.data.train_x, self.precision["channels_last"], self.precision["cuda_graphs"])
        return reference
