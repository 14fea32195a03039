"""Where and in what precision a run computes: the device, bfloat16 autocast (``amp``) and the
memory format of image batches (``channels-last``), resolved per device from the run's settings and
whether training steps are captured (``cuda-graphs``), and the description of it all that runs log."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Literal, get_args

import torch
from torch import nn

from protofl.task.capture import CudaGraphs, resolve_cuda_graphs

# mixed precision of the forward pass and loss: none (float32), bfloat16 autocast (no loss scaling
# needed: bfloat16 has float32's exponent range), or bfloat16 where the device runs it natively
# and float32 elsewhere ("auto": see native_bf16)
Amp = Literal["auto", "off", "bf16"]


AMPS = get_args(Amp)


# memory order of the model and the image batches: channels-last, NCHW (False), or "auto": the
# order the backbone trains faster in (SplitModel.channels_last_faster, measured per backbone)
ChannelsLast = bool | Literal["auto"]


def set_thread_count(threads: int | None = None) -> None:
    """Torch's intra-op thread count set on the calling thread: ``threads``, else the count torch
    has. A thread that has not set or read it yet can run its first matrix products on another team
    than that count: a ServerApp thread after an earlier run in the process drew FedSA's anchors with
    other last bits than the same run's on the main thread, though both ran at 1 thread
    (tests/test_ray_cluster.py)."""
    torch.set_num_threads(threads or torch.get_num_threads())


def get_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
    dtype, the memory format (of ``model``, when given), the training step, and the process's
    niceness: Ray starts its workers, a simulation's ClientApps, at ``RAY_worker_niceness`` (15 where
    it is not set), where they get only the CPU other processes leave."""
    described: dict[str, Any] = {"host": socket.gethostname(), "device": device.type}
    if hasattr(os, "nice"):  # not on Windows
        described["nice"] = os.nice(0)
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


def autocast_for(amp: Amp, device: torch.device, cuda_graphs: CudaGraphs) -> contextlib.AbstractContextManager:
    """The autocast context ``amp`` names on ``device`` (none for float32)."""
    if resolve_amp(amp, device, cuda_graphs) == "off":
        return contextlib.nullcontext()
    # no cache of cast weights: torch keeps one per process, and clients training on a process's
    # threads at once (Flower's thread pool) read each other's entries
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=False)


def to_channels_last(model: nn.Module, x: torch.Tensor, channels_last: ChannelsLast, cuda_graphs: CudaGraphs) -> bool:
    """Moves ``model`` to channels_last when asked (:func:`uses_channels_last`) and ``x`` is a batch
    of images (4-D); returns whether the batches go channels_last too."""
    if uses_channels_last(model, channels_last, x.device, cuda_graphs) and x.dim() == 4:
        model.to(memory_format=torch.channels_last)
        return True
    return False
