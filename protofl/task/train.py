"""Local training and evaluation on ready tensors (no DataLoader, no per-sample Python)."""

from __future__ import annotations

import contextlib
import math
import socket
from typing import Any, Callable, Literal, get_args

import numpy as np
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
from protofl.task.weights import all_tensors

# extra_loss(features, logits, labels) -> scalar tensor added to the cross-entropy (None: nothing)
ExtraLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]
# where local prototypes come from: an eval pass after training, or the training-mode vectors seen
# in training (every epoch, or the last one)
PrototypePass = Literal["post-eval", "during-train", "last-epoch"]
PostOrLastEpochPass = Literal["post-eval", "last-epoch"]
# BatchNorm statistics after local training: recomputed on the training split when the running
# averages are still mostly those from before training ("auto"), always, or never (the running
# averages, PyTorch's default and the papers' code)
BatchNormStats = Literal["auto", "recompute", "running"]
# the batch left over when the batch size does not divide the training split: dropped each epoch
# (PFLlib's and HtFLlib's drop_last), or trained on (a one-sample batch is always skipped)
PartialBatch = Literal["drop", "keep"]
# mixed precision of the forward pass and loss: none (float32), bfloat16 autocast (no loss scaling
# needed: bfloat16 has float32's exponent range), or bfloat16 where the device runs it natively
# and float32 elsewhere ("auto": see native_bf16)
Amp = Literal["auto", "off", "bf16"]
AMPS = get_args(Amp)
# memory order of the model and the image batches: channels-last, NCHW (False), or "auto": the
# order the backbone trains faster in (SplitModel.channels_last_faster, measured per backbone)
ChannelsLast = bool | Literal["auto"]


def get_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
    extra_loss: ExtraLoss | None = None,
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
    that can wreck the model (see docs/results/batchnorm.md). ``max_grad_norm > 0`` clips the total gradient norm.
    Only parameters with ``requires_grad`` are optimised (buffers, e.g. a frozen head, never are).
    ``augment`` transforms each batch's images (its draws from the same seeded generator).
    ``amp="bf16"`` runs the forward pass and the loss under bfloat16 autocast (the weights, their
    gradients and the optimiser stay float32); ``channels_last`` keeps the model and 4-D batches in
    ``torch.channels_last`` memory format (``"auto"``: where the backbone trains faster so,
    :func:`uses_channels_last`). ``cuda_graphs``: full batches through a :class:`CapturedStep`
    (:func:`resolve_cuda_graphs`); ``extra_loss`` must then be capturable (see there). The
    captured step is kept for the next ``train`` of this thread whose model, data and arguments
    have the same shapes and values (:class:`KeptStep`): with ``extra_loss``, only when
    ``step_state`` says what it reads and writes. The loss is summed on the device and read once,
    at the end.
    """
    autocast = _autocast(amp, x.device, cuda_graphs)
    channels_last = _to_channels_last(model, x, channels_last, cuda_graphs)
    model.train()
    generator = torch.Generator().manual_seed(seed)
    n = len(y)
    seed_dropout(model, generator)
    kind = resolve_cuda_graphs(cuda_graphs, x.device)
    full_batches = epochs * (n // batch_size)
    if step_state is None and extra_loss is None:
        step_state = StepState()
    key = kept = None
    if kind != "off" and step_state is not None:
        tensors = all_tensors(model)
        structure = tuple((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in tensors.items())
        key = (type(model), structure, tuple(x.shape[1:]), x.dtype, y.dtype, str(x.device), batch_size, lr,
               momentum, weight_decay, max_grad_norm, resolve_amp(amp, x.device, cuda_graphs), channels_last, kind,
               extra_loss is None, step_state.key())
        kept = kept_step(key)
    if kept is not None:  # a step captured for an earlier client: this one's tensors go through it
        kept.load(tensors, step_state)
        step, captured, total = kept.step, kept.captured, kept.total
    else:
        step, optimizer, total = _training_step(model, autocast, lr, momentum, weight_decay, max_grad_norm, extra_loss)
        captured = (CapturedStep(step, static=kind == "static")
                    if kind != "off" and full_batches > CAPTURE_WARMUP_STEPS else None)
    dropouts = host_dropouts(model)  # this client's, seeded for it
    fed = host_dropouts(kept.model) if kept is not None else dropouts  # the step's, which know the shapes
    steps = 0
    for _ in range(epochs):
        order = drawn_to(torch.randperm(n, generator=generator), x.device)
        for start in range(0, n, batch_size):
            batch = order[start : start + batch_size]
            if _skipped(len(batch), n, batch_size, partial_batch):
                continue
            inputs = x[batch] if augment is None else augment(x[batch], generator)
            if channels_last:
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            masks = next_masks(dropouts, fed, len(batch), x.device)  # inputs of the step: it cannot draw
            (captured if captured is not None and len(batch) == batch_size else step)(inputs, y[batch], *masks)
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
                   weight_decay: float, max_grad_norm: float, extra_loss: ExtraLoss | None):
    """(step, its optimizer, its summed loss): ``step(inputs, labels, *masks)`` trains ``model`` on one
    batch: forward, the loss, backward, clipping, the SGD step, the loss added to the sum; ``masks``:
    one per drawing dropout layer (:func:`host_dropouts`), or none (the layers draw)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = SGD(parameters, lr=lr, momentum=momentum, weight_decay=weight_decay)
    total = torch.zeros((), device=next(model.parameters()).device)  # on the device: no sync per step
    dropouts = host_dropouts(model)

    def step(inputs: torch.Tensor, labels: torch.Tensor, *masks: torch.Tensor) -> None:
        with fed_masks(dropouts, masks), autocast:
            features, logits = model(inputs)
            loss = F.cross_entropy(logits, labels)
            extra = extra_loss(features, logits, labels) if extra_loss is not None else None
            if extra is not None:
                loss = loss + extra
        optimizer.zero_grad()
        loss.backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
        optimizer.step()
        total.add_(loss.detach())

    return step, optimizer, total


class SGD:
    """``torch.optim.SGD``'s update without dampening or Nesterov momentum, the same floats step for
    step, but not through ``torch.optim``: creating a torch optimizer imports ``torch._dynamo``,
    1.1-1.4 s of every fresh ClientApp process (a deployment starts one per message)."""

    def __init__(self, parameters: list[torch.Tensor], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        self.parameters, self.lr, self.momentum, self.weight_decay = parameters, lr, momentum, weight_decay
        self.velocity: list[torch.Tensor | None] = [None] * len(parameters)  # momentum buffers, from a first step

    def zero_grad(self) -> None:
        for p in self.parameters:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        stepped = [i for i, p in enumerate(self.parameters) if p.grad is not None]
        params = [self.parameters[i] for i in stepped]
        grads = [p.grad for p in params]
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


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively, as torch reports it: a CUDA GPU of compute
    capability 8.0 or more (Ampere on), or a CPU whose instruction set oneDNN runs bf16 kernels with
    (AVX-512 BF16 or AMX). Elsewhere bf16 is emulated (on an AVX-512 CPU without BF16, or AVX2) and
    slower than float32. Other devices (Apple MPS, Arm CPUs): no."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":
        return torch.backends.mkldnn.is_available() and bool(
            torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


def resolve_amp(amp: Amp, device: torch.device, cuda_graphs: CudaGraphs = "auto") -> Literal["off", "bf16"]:
    """What ``amp`` means on ``device``: ``"auto"`` is ``"bf16"`` where :func:`native_bf16`, else
    ``"off"``; on CUDA only with captured training steps (``cuda_graphs``): launched eagerly, bf16
    autocast trained slower than float32 on an H200 (docs/results/gpu.md)."""
    if amp not in AMPS:
        raise ValueError(f"amp must be one of {AMPS}, got {amp!r}")
    if amp == "auto":
        return "bf16" if native_bf16(device) and _captures_on_cuda_or_cpu(device, cuda_graphs) else "off"
    return amp


def uses_channels_last(model: nn.Module, channels_last: ChannelsLast, device: torch.device = torch.device("cpu"),
                       cuda_graphs: CudaGraphs = "auto") -> bool:
    """Whether ``model``'s image batches go channels-last on ``device``: as ``channels_last`` says,
    or for ``"auto"`` where the backbone measured faster so on that kind of device (its
    ``channels_last_faster``; on CUDA: with captured training steps, else NCHW)."""
    if channels_last == "auto":
        return (device.type in getattr(model, "channels_last_faster", ())
                and _captures_on_cuda_or_cpu(device, cuda_graphs))
    return bool(channels_last)


def _captures_on_cuda_or_cpu(device: torch.device, cuda_graphs: CudaGraphs) -> bool:
    """Where the "auto" precision and memory format hold: any device but CUDA, and CUDA with
    captured steps (eager CUDA steps run float32 NCHW, the plain setting)."""
    return device.type != "cuda" or resolve_cuda_graphs(cuda_graphs, device) == "captured"


def compute_description(amp: Amp, channels_last: ChannelsLast, device: torch.device,
                        model: nn.Module | None = None, cuda_graphs: CudaGraphs = "auto") -> dict[str, Any]:
    """How a run with ``amp``, ``channels_last`` and ``cuda_graphs`` computes on ``device`` (logged,
    and recorded in results.json): the host, the device, torch's threads on a CPU, the autocast
    dtype, the memory format (of ``model``, when given) and the training step."""
    described: dict[str, Any] = {"host": socket.gethostname(), "device": device.type}
    if device.type == "cpu":
        described |= {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
                      "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    else:
        described["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    described |= {"amp": amp, "autocast": resolve_amp(amp, device, cuda_graphs), "native_bf16": native_bf16(device),
                  "channels_last": channels_last}
    if model is not None:
        described["memory_format"] = ("channels-last" if uses_channels_last(model, channels_last, device, cuda_graphs)
                                      else "NCHW")
    described["training_step"] = resolve_cuda_graphs(cuda_graphs, device)
    return described


def _autocast(amp: Amp, device: torch.device, cuda_graphs: CudaGraphs) -> contextlib.AbstractContextManager:
    """The autocast context ``amp`` names on ``device`` (none for float32)."""
    if resolve_amp(amp, device, cuda_graphs) == "off":
        return contextlib.nullcontext()
    # no cache of cast weights: torch keeps one per process, and clients training on a process's
    # threads at once (Flower's thread pool) read each other's entries
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=False)


def _to_channels_last(model: nn.Module, x: torch.Tensor, channels_last: ChannelsLast, cuda_graphs: CudaGraphs) -> bool:
    """Moves ``model`` to channels_last when asked (:func:`uses_channels_last`) and ``x`` is a batch
    of images (4-D); returns whether the batches go channels_last too."""
    if uses_channels_last(model, channels_last, x.device, cuda_graphs) and x.dim() == 4:
        model.to(memory_format=torch.channels_last)
        return True
    return False


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
    autocast = _autocast(amp, x.device, cuda_graphs)
    channels_last = _to_channels_last(model, x, channels_last, cuda_graphs)
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
    autocast = _autocast(amp, x.device, cuda_graphs)
    # outside inference mode: the weights stay trainable
    channels_last = _to_channels_last(model, x, channels_last, cuda_graphs)
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


def class_means(
    features: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-class mean feature (C x d float32, zero rows for absent classes) and class counts."""
    counts = torch.bincount(labels, minlength=num_classes)
    sums = torch.zeros(num_classes, features.shape[1], device=features.device, dtype=features.dtype)
    sums.index_add_(0, labels, features)
    means = sums / counts.clamp(min=1).unsqueeze(1).to(features.dtype)
    return means.float().cpu().numpy(), counts.cpu().numpy().astype(np.int64)


class FeatureSums:
    """Per-class sums and counts of the (detached) vectors a training loop sees, e.g. from its
    ``extra_loss``: the training-mode prototypes of FedSA's, HtFLlib's FedProto and FedSC's code.
    The first ``skip`` batches are not counted (``skip`` = the steps before the last epoch: the
    last epoch only)."""

    def __init__(self, num_classes: int, dim: int, device: torch.device, skip: int = 0) -> None:
        self.sums = torch.zeros(num_classes, dim, device=device)
        self.counts = torch.zeros(num_classes, dtype=torch.long, device=device)
        self.skip = skip
        self.batches = torch.zeros((), dtype=torch.long, device=device)  # seen so far, counted on the device

    def step_key(self) -> tuple:
        return tuple(self.sums.shape), self.sums.dtype, self.skip

    def reset(self) -> None:
        for tensor in (self.sums, self.counts, self.batches):
            tensor.zero_()

    def take(self, other: FeatureSums) -> None:
        for tensor, kept in ((self.sums, other.sums), (self.counts, other.counts), (self.batches, other.batches)):
            tensor.copy_(kept)

    def add(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Count a batch, on the device and without waiting for the host (a captured step replays it)."""
        counted = torch.ones_like(labels)
        features = features.detach().to(self.sums.dtype)
        if self.skip > 0:  # the batch counts once ``skip`` batches have gone by
            past_skip = self.batches >= self.skip
            features, counted = torch.where(past_skip, features, 0.0), counted * past_skip
            self.batches.add_(1)
        self.sums.index_add_(0, labels, features)
        self.counts.index_add_(0, labels, counted)

    def means(self) -> np.ndarray:
        """C x d float32 mean features (the wire's dtype, whatever the sums'); zero rows for classes
        never seen."""
        return (self.sums / self.counts.clamp(min=1).unsqueeze(1)).float().cpu().numpy()

    def means_filled(self, held: np.ndarray, fallback: Callable[[], np.ndarray]) -> np.ndarray:
        """:meth:`means`, with the rows of ``held`` classes never seen (all their samples in skipped
        batches) taken from ``fallback()``, called only when there are such rows."""
        means = self.means()
        missing = held & (self.counts.cpu().numpy() == 0)
        if missing.any():
            means[missing] = fallback()[missing]
        return means


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

