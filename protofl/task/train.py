"""Local training and evaluation on ready tensors (no DataLoader, no per-sample Python)."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from protofl.task.augment import Augment, drawn_to
from protofl.task.capture import (
    CAPTURE_WARMUP_STEPS,
    CapturedStep,
    CudaGraphs,
    KeptStep,
    StepState,
    keep_step,
    kept_step,
    resolve_cuda_graphs,
)
from protofl.task.models import fed_masks, host_dropouts, next_masks, seed_dropout
from protofl.task.precision import Amp, ChannelsLast, autocast_for, resolve_amp, to_channels_last
from protofl.task.weights import all_tensors

# loss(inputs, features, logits, labels) -> the scalar loss of one mini-batch (None: cross-entropy)
BatchLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# BatchNorm statistics after local training: recomputed on the training split when the running
# averages are still mostly those from before training ("auto"), always, or never (the running
# averages, PyTorch's default and the papers' code)
BatchNormStats = Literal["auto", "recompute", "running"]
# the batch left over when the batch size does not divide the training split: dropped each epoch
# (PFLlib's and HtFLlib's drop_last), or trained on (a one-sample batch is always skipped)
PartialBatch = Literal["drop", "keep"]


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    max_grad_norm: float = 0.0,
    clip_groups: Sequence[Sequence[torch.Tensor]] | None = None,
    loss: BatchLoss | None = None,
    gradient_offsets: Sequence[torch.Tensor | None] | None = None,
    partial_batch: PartialBatch = "drop",
    augment: Augment | None = None,
    amp: Amp = "off",
    channels_last: ChannelsLast = False,
    cuda_graphs: CudaGraphs = "off",
    step_state: StepState | None = None,
) -> float:
    """SGD over shuffled mini-batches; returns the mean training loss.

    The batch order comes from ``seed``. The trailing partial batch of an epoch is dropped, or
    with ``partial_batch="keep"`` trained on unless it holds one sample; a split smaller than one
    batch is always one batch. A BatchNorm layer trained on a batch of two or three takes a step
    that can wreck the model (see docs/results/batchnorm.md). ``loss`` computes each batch's loss from
    its inputs and the model's outputs (default: the cross-entropy of the logits).
    ``max_grad_norm > 0`` clips the total gradient norm, or with ``clip_groups`` each group's (FML's
    two models, each clipped on its own). Only parameters with ``requires_grad`` are
    optimised (buffers, e.g. a frozen head, never are); ``gradient_offsets``, one per such parameter
    (None: none), are added to their gradients at every step, after clipping (SCAFFOLD's correction).
    ``augment`` transforms each batch's images (its draws from the same seeded generator).
    ``amp="bf16"`` runs the forward pass and the loss under bfloat16 autocast (the weights, their
    gradients and the optimiser stay float32); ``channels_last`` keeps the model and 4-D batches in
    ``torch.channels_last`` memory format (``"auto"``: where the backbone trains faster so,
    :func:`uses_channels_last`). ``cuda_graphs``: full batches through a :class:`CapturedStep`
    (:func:`resolve_cuda_graphs`); ``loss`` must then be capturable (see there). The
    captured step is kept for the next ``train`` of this thread whose model, data and arguments
    have the same shapes and values (:class:`KeptStep`): with ``loss`` or ``gradient_offsets``, only
    when ``step_state`` says what it reads and writes. The loss is summed on the device and read once,
    at the end.
    """
    autocast = autocast_for(amp, x.device, cuda_graphs)
    channels_last = to_channels_last(model, x, channels_last, cuda_graphs)
    model.train()
    generator = torch.Generator().manual_seed(seed)
    n = len(y)
    seed_dropout(model, generator)
    kind = resolve_cuda_graphs(cuda_graphs, x.device)
    full_batches = epochs * (n // batch_size)
    if step_state is None and loss is None and gradient_offsets is None:
        step_state = StepState()
    key = kept = None
    if kind != "off" and step_state is not None:
        tensors = all_tensors(model)
        structure = tuple((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in tensors.items())
        key = (type(model), structure, tuple(x.shape[1:]), x.dtype, y.dtype, str(x.device), batch_size, lr,
               momentum, weight_decay, max_grad_norm, resolve_amp(amp, x.device, cuda_graphs), channels_last, kind,
               loss is None, gradient_offsets is None, clip_groups is None, step_state.key())
        kept = kept_step(key)
    if kept is not None:  # a step captured for an earlier client: this one's tensors go through it
        kept.load(tensors, step_state)
        step, captured, total = kept.step, kept.captured, kept.total
    else:
        step, optimizer, total = _training_step(model, autocast, lr, momentum, weight_decay, max_grad_norm, loss,
                                                gradient_offsets, clip_groups)
        captured = (CapturedStep(step, static=kind == "static")
                    if kind != "off" and full_batches > CAPTURE_WARMUP_STEPS else None)
    dropouts = host_dropouts(model)  # this client's, seeded for it
    fed = host_dropouts(kept.model) if kept is not None else dropouts  # the step's, which know the shapes
    steps = 0
    for inputs, labels in batches(x, y, epochs=epochs, batch_size=batch_size, generator=generator,
                                  partial_batch=partial_batch, augment=augment, channels_last=channels_last):
        masks = next_masks(dropouts, fed, len(labels), x.device)  # inputs of the step: it cannot draw
        (captured if captured is not None and len(labels) == batch_size else step)(inputs, labels, *masks)
        steps += 1
    mean_loss = float(total) / max(steps, 1)
    if kept is not None:
        kept.unload(tensors, step_state)
    elif captured is not None:
        optimizer.zero_grad()  # the gradients live in the graph's memory: none outlive it
        if key is not None and (captured.graph is not None or captured.static):
            keep_step(key, KeptStep(model, tensors, optimizer.velocity, total, step, captured, step_state))
        else:
            captured.release()
    return mean_loss


def _training_step(model: nn.Module, autocast: contextlib.AbstractContextManager, lr: float, momentum: float,
                   weight_decay: float, max_grad_norm: float, batch_loss: BatchLoss | None,
                   gradient_offsets: Sequence[torch.Tensor | None] | None,
                   clip_groups: Sequence[Sequence[torch.Tensor]] | None = None):
    """(step, its optimizer, its summed loss): ``step(inputs, labels, *masks)`` trains ``model`` on one
    batch: forward, the loss, backward, clipping, the SGD step, the loss added to the sum; ``masks``:
    one per drawing dropout layer (:func:`host_dropouts`), or none (the layers draw)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = SGD(parameters, lr=lr, momentum=momentum, weight_decay=weight_decay, offsets=gradient_offsets)
    total = torch.zeros((), device=next(model.parameters()).device)  # on the device: no sync per step
    dropouts = host_dropouts(model)

    def step(inputs: torch.Tensor, labels: torch.Tensor, *masks: torch.Tensor) -> None:
        with fed_masks(dropouts, masks), autocast:
            features, logits = model(inputs)
            if batch_loss is None:
                loss = F.cross_entropy(logits, labels)
            else:
                loss = batch_loss(inputs, features, logits, labels)
        optimizer.zero_grad()
        loss.backward()
        if max_grad_norm > 0:
            for group in clip_groups or [parameters]:
                torch.nn.utils.clip_grad_norm_(group, max_grad_norm)
        optimizer.step()
        total.add_(loss.detach())

    return step, optimizer, total


class SGD:
    """``torch.optim.SGD``'s update without dampening or Nesterov momentum, the same floats step for
    step, but not through ``torch.optim``: creating a torch optimizer imports ``torch._dynamo``,
    1.1-1.4 s of every fresh ClientApp process (a deployment starts one per message)."""

    def __init__(self, parameters: list[torch.Tensor], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, offsets: Sequence[torch.Tensor | None] | None = None) -> None:
        self.parameters, self.lr, self.momentum, self.weight_decay = parameters, lr, momentum, weight_decay
        self.offsets = list(offsets) if offsets is not None else None  # added to the gradients
        if self.offsets is not None and len(self.offsets) != len(parameters):
            raise ValueError(f"{len(self.offsets)} gradient offsets for {len(parameters)} parameters")
        self.velocity: list[torch.Tensor | None] = [None] * len(parameters)  # momentum buffers, from a first step

    def zero_grad(self) -> None:
        for p in self.parameters:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        stepped = [i for i, p in enumerate(self.parameters) if p.grad is not None]
        params = [self.parameters[i] for i in stepped]
        grads = [p.grad for p in params]
        if self.offsets is not None:
            grads = [g if self.offsets[i] is None else g + self.offsets[i] for g, i in zip(grads, stepped)]
        if self.weight_decay:
            grads = torch._foreach_add(grads, params, alpha=self.weight_decay)
        if self.momentum:
            known = [k for k, i in enumerate(stepped) if self.velocity[i] is not None]
            if known:
                velocity = [self.velocity[stepped[k]] for k in known]
                torch._foreach_mul_(velocity, self.momentum)
                torch._foreach_add_(velocity, [grads[k] for k in known])
            for k, i in enumerate(stepped):
                if self.velocity[i] is None:
                    self.velocity[i] = grads[k].detach().clone()
            grads = [self.velocity[i] for i in stepped]
        if params:
            torch._foreach_add_(params, grads, alpha=-self.lr)


def batches(x: torch.Tensor, y: torch.Tensor, *, epochs: int, batch_size: int, generator: torch.Generator,
            partial_batch: PartialBatch = "drop", augment: Augment | None = None,
            channels_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The (inputs, labels) of each training mini-batch, in the order :func:`train` takes them: per
    epoch a permutation drawn from ``generator``, the trailing partial batch as ``partial_batch``
    says, ``augment``'s draws from the same generator. A method whose step is its own (pFedMe's inner
    loop, Per-FedAvg's two half-batches) iterates these."""
    n = len(y)
    for _ in range(epochs):
        order = drawn_to(torch.randperm(n, generator=generator), x.device)
        for start in range(0, n, batch_size):
            batch = order[start : start + batch_size]
            if _skipped(len(batch), n, batch_size, partial_batch):
                continue
            inputs = x[batch] if augment is None else augment(x[batch], generator)
            if channels_last:
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            yield inputs, y[batch]


def _skipped(batch: int, n: int, batch_size: int, partial_batch: PartialBatch) -> bool:
    if batch == n or batch == batch_size:
        return False
    return partial_batch == "drop" or batch == 1


def steps_per_epoch(n: int, batch_size: int, partial_batch: PartialBatch = "drop") -> int:
    """Optimiser steps :func:`train` takes per epoch over ``n`` samples."""
    starts = range(0, n, batch_size)
    return sum(not _skipped(min(batch_size, n - start), n, batch_size, partial_batch) for start in starts)


def _batchnorms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


def stale_batchnorm(model: nn.Module, steps: int, tolerance: float = 0.01) -> bool:
    """Whether, after ``steps`` training steps, the running statistics of some BatchNorm layer
    still hold more than ``tolerance`` of what they were before: (1 - momentum)^steps, e.g. fewer
    than 44 steps at PyTorch's momentum 0.1 (a cumulative average, momentum None, always is)."""
    return any(m.momentum is None or (1.0 - m.momentum) ** steps > tolerance for m in _batchnorms(model))


@torch.no_grad()
def recompute_batchnorm_stats(model: nn.Module, x: torch.Tensor, seed: int = 0, chunk_size: int = 1024, *,
                              amp: Amp = "off", channels_last: ChannelsLast = False,
                              cuda_graphs: CudaGraphs = "off") -> None:
    """Replace the running mean and variance of every BatchNorm layer by those of ``x`` under the
    model's current weights: one no-grad pass with only the BatchNorm layers in training mode,
    over a seeded shuffle of ``x`` in chunks of near-equal size (each chunk counts equally), in the
    precision and memory format of the eval pass (``amp``, ``channels_last``, ``cuda_graphs`` as in :func:`train`).

    The running averages of training lag the weights: after a few steps they are still mostly the
    initial ones, and an eval-mode pass through a deep network can be off by orders of magnitude.
    """
    norms = _batchnorms(model)
    if not norms or len(x) < 2:
        return
    autocast = autocast_for(amp, x.device, cuda_graphs)
    channels_last = to_channels_last(model, x, channels_last, cuda_graphs)
    was_training = model.training
    kept = [(m.momentum, m.num_batches_tracked.clone()) for m in norms]
    model.eval()
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the chunks
        m.train()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed)).to(x.device)
    for chunk in order.tensor_split(math.ceil(len(x) / chunk_size)):
        with autocast:
            model(x[chunk].contiguous(memory_format=torch.channels_last) if channels_last else x[chunk])
    for m, (momentum, tracked) in zip(norms, kept):
        m.momentum = momentum
        m.num_batches_tracked.copy_(tracked)
    model.train(was_training)


