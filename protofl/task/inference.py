"""Eval-mode forward passes and the rules that turn their outputs into predictions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from protofl.task.capture import CudaGraphs
from protofl.task.precision import Amp, ChannelsLast, autocast_for, to_channels_last

def features_and_logits(
    model: nn.Module, x: torch.Tensor, batch_size: int = 1024, *, amp: Amp = "off",
    channels_last: ChannelsLast = False, cuda_graphs: CudaGraphs = "off",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode forward pass over ``x`` in chunks under ``torch.inference_mode`` (``amp``,
    ``channels_last`` and the training step they go with, ``cuda_graphs``, as in :func:`train`).
    The outputs are in the weights' dtype (float32; bfloat16 autocast's outputs are cast back), need
    no grad, and are ordinary tensors (joined outside inference mode), so later autograd may use
    them as constants."""
    dtype = next(model.parameters()).dtype
    autocast = autocast_for(amp, x.device, cuda_graphs)
    # outside inference mode: the weights stay trainable
    channels_last = to_channels_last(model, x, channels_last, cuda_graphs)
    model.eval()
    features, logits = [], []
    with torch.inference_mode():
        for i in range(0, len(x), batch_size):
            chunk = x[i : i + batch_size]
            with autocast:
                f, logit = model(chunk.contiguous(memory_format=torch.channels_last) if channels_last else chunk)
            features.append(f.to(dtype))
            logits.append(logit.to(dtype))
    return torch.cat(features), torch.cat(logits)


def nearest_prototype(
    features: torch.Tensor, prototypes: torch.Tensor, available: torch.Tensor
) -> torch.Tensor:
    """Predicted class = the nearest available prototype (Euclidean)."""
    distances = torch.cdist(features, prototypes.to(features.dtype))
    distances[:, ~available] = float("inf")
    return distances.argmin(dim=1)


def head_prediction(features: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Predicted class = the classifier head's argmax."""
    return logits.argmax(dim=1)


def head_loss_and_correct(logits: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    """Mean cross-entropy and number of correct head predictions."""
    loss = F.cross_entropy(logits, y).item() if len(y) else 0.0
    return loss, int((logits.argmax(dim=1) == y).sum())
