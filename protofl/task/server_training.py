"""Training a server runs on its own device between rounds (FedGH's head, FedTGP's prototypes,
CReFF's classifier): plain mini-batch SGD over pairs in seeded orders."""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch


def shuffles(n: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Each epoch's order of ``n`` samples, from ``generator``."""
    while True:
        yield torch.randperm(n, generator=generator)


def minibatch_sgd(parameters: Sequence[torch.Tensor], batch_loss: Callable[[torch.Tensor], torch.Tensor], n: int,
                  epochs: int, batch_size: int, lr: float, orders: Iterator[torch.Tensor]) -> None:
    """``epochs`` epochs of plain SGD at ``lr`` of ``parameters`` (a DataLoader's ``shuffle=True,
    drop_last=False`` with ``torch.optim.SGD``), in place: each epoch's order of the ``n`` samples
    from ``orders``, cut into batches of ``batch_size`` (the last one smaller), each step on
    ``batch_loss(indices)``."""
    for _ in range(epochs):
        order = next(orders)
        for start in range(0, n, batch_size):
            gradients = torch.autograd.grad(batch_loss(order[start:start + batch_size]), list(parameters))
            with torch.no_grad():
                for parameter, gradient in zip(parameters, gradients):
                    parameter -= lr * gradient
