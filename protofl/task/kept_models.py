"""Models a thread keeps for its next messages (no Flower): building a model anew for every message
costs more than setting a kept one back to its initial values (tv-resnet18: a few hundred
milliseconds of CPU). The ClientApp (:func:`protofl.client_app.worker_model`) and the training
worker take their models from here, and free them when a message ends."""

from __future__ import annotations

import collections
import threading
from typing import Callable, Hashable

import torch

from protofl.task.weights import all_tensors, copy_tensors, tensor_copies

KEPT_MODELS = 4  # kinds of model a thread keeps


class _KeptModel:
    """A model a thread keeps for its next messages, with its values as built (copied where the
    model went after: the client moves it to its device, and a reset then copies on the device)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.in_use = model, True
        self.initial = tensor_copies(model)

    def reset(self) -> torch.nn.Module:
        tensors = all_tensors(self.model)
        if any(self.initial[name].device != tensor.device for name, tensor in tensors.items()):
            self.initial = {name: self.initial[name].to(tensor.device) for name, tensor in tensors.items()}
        copy_tensors(tensors, self.initial)
        for parameter in self.model.parameters():
            parameter.grad = None
        self.in_use = True
        return self.model


_models = threading.local()  # per thread: key -> _KeptModel, the most recently used last


def kept_model(key: Hashable, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The model of kind ``key`` (its architecture, shapes, settings): this thread's kept one, set back
    to its initial values, once the message that used it has ended (:func:`release_thread_models`);
    else ``build()``'s, kept for later when the thread keeps none of that kind. A model still in use
    (a client outside a message) is not shared."""
    models = _models.__dict__.setdefault("models", collections.OrderedDict())
    kept = models.get(key)
    if kept is not None and not kept.in_use:
        models.move_to_end(key)
        return kept.reset()
    model = build()
    if kept is None:
        models[key] = _KeptModel(model)
        while len(models) > KEPT_MODELS:
            models.popitem(last=False)
    return model


def release_thread_models() -> None:
    """This thread's models are free for its next message."""
    for kept in getattr(_models, "models", {}).values():
        kept.in_use = False
