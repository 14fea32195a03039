"""On-device training augmentation of normalised image batches: one call per batch, no per-sample Python."""

from __future__ import annotations

from typing import Callable, Literal

import torch

Augmentation = Literal["none", "crop-flip"]
Augment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def drawn_to(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """CPU draws (a batch order, crop offsets) on ``device``; to a GPU from pinned memory without
    waiting: a copy from pageable memory would wait for the GPU's queued work first."""
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def crop_flip(x: torch.Tensor, generator: torch.Generator, fill: torch.Tensor, padding: int = 4) -> torch.Tensor:
    """Each image of the N x C x H x W batch padded by ``padding`` pixels of ``fill`` (per channel:
    a black pixel, normalised), cropped back to H x W at its own random offset, and flipped left to
    right with probability 1/2 (torchvision's RandomCrop(H, padding) + RandomHorizontalFlip).
    The draws come from the CPU ``generator``; the images stay on their device."""
    n, c, h, w = x.shape
    padded = fill.to(x.device, x.dtype).view(1, c, 1, 1).expand(n, c, h + 2 * padding, w + 2 * padding).clone()
    padded[:, :, padding : padding + h, padding : padding + w] = x
    offsets = drawn_to(torch.randint(0, 2 * padding + 1, (2, n), generator=generator), x.device)
    rows = (offsets[0, :, None] + torch.arange(h, device=x.device))[:, None, :, None]
    cols = (offsets[1, :, None] + torch.arange(w, device=x.device))[:, None, None, :]
    images = torch.arange(n, device=x.device)[:, None, None, None]
    channels = torch.arange(c, device=x.device)[None, :, None, None]
    cropped = padded[images, channels, rows, cols]
    flipped = drawn_to(torch.rand(n, generator=generator) < 0.5, x.device)[:, None, None, None]
    return torch.where(flipped, cropped.flip(-1), cropped)


def make_augment(kind: Augmentation, fill: torch.Tensor) -> Augment | None:
    """The batch transform ``augment`` names (None for ``"none"``)."""
    if kind == "none":
        return None
    fills: dict[torch.device, torch.Tensor] = {}  # copied to a device once, not per batch

    def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if x.device not in fills:
            fills[x.device] = fill.to(x.device)
        return crop_flip(x, generator, fills[x.device])

    return augment
