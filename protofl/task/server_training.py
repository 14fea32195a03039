"""Training a server runs on its own device between rounds (FedGH's head, FedTGP's prototypes,
CReFF's classifier): plain mini-batch SGD over pairs in seeded orders, on one CPU thread."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch


def shuffles(n: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Each epoch's order of ``n`` samples, from ``generator``."""
    while True:
        yield torch.randperm(n, generator=generator)


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Within, torch computes on one CPU thread. Server training's tensors are small (a batch of ten
    pairs, a few 512 x 512 layers): a step is a few hundred operations of microseconds each, and
    splitting each across threads only adds their handover, which on a host whose cores are busy
    waits for a descheduled thread: on 2 cores beside other work, 2.6 to 11 times slower on two
    threads than on one; idle, 0.9 to 1.1 times; the same values (docs/results/scale.md,
    benchmarks/server_training.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def minibatch_sgd(parameters: Sequence[torch.Tensor], batch_loss: Callable[[torch.Tensor], torch.Tensor], n: int,
                  epochs: int, batch_size: int, lr: float, orders: Iterator[torch.Tensor]) -> None:
    """``epochs`` epochs of plain SGD at ``lr`` of ``parameters`` (a DataLoader's ``shuffle=True,
    drop_last=False`` with ``torch.optim.SGD``), in place: each epoch's order of the ``n`` samples
    from ``orders``, cut into batches of ``batch_size`` (the last one smaller), each step on
    ``batch_loss(indices)``, on one CPU thread (:func:`one_cpu_thread`)."""
    with one_cpu_thread():
        for _ in range(epochs):
            order = next(orders)
            for start in range(0, n, batch_size):
                gradients = torch.autograd.grad(batch_loss(order[start:start + batch_size]), list(parameters))
                with torch.no_grad():
                    for parameter, gradient in zip(parameters, gradients):
                        parameter -= lr * gradient
