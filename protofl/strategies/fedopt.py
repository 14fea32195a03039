"""FedOpt (Reddi et al., ICLR 2021): FedAvg's clients, an adaptive optimiser on the server.

Server (Algorithm 2 of the paper): the round's pseudo-gradient Delta_t = mean over its clients of
(x_i - x_t), the global model's change (uniform, as Algorithm 2; ``form = "flower"``: by training
size, as Flower's strategies); m_t = beta_1 m_(t-1) + (1 - beta_1) Delta_t, and v_t by the
``optimizer``: ``adagrad`` v_(t-1) + Delta_t^2, ``adam`` beta_2 v_(t-1) + (1 - beta_2) Delta_t^2,
``yogi`` v_(t-1) - (1 - beta_2) Delta_t^2 sign(v_(t-1) - Delta_t^2); then
x_(t+1) = x_t + eta m_t / (sqrt(v_t) + tau), per entry. v starts at tau^2 (Algorithm 2's
v_(-1) >= tau^2); ``form = "flower"`` is Flower's FedAdagrad / FedAdam / FedYogi exactly (v from 0,
FedAdagrad without the first moment (beta_1 = 0), FedAdam's bias-corrected step
eta sqrt(1 - beta_2^(t+1)) / (1 - beta_1^(t+1))), which
tests/test_conformance_fedopt.py checks against Flower's own strategies.

``eta`` and ``tau`` ``"auto"``: the paper's best values for its CIFAR-100 task (its appendix, the
authors' code's README): adagrad eta 10^-1, tau 10^-2; adam and yogi eta 1, tau 10^-1. beta_1 0.9,
beta_2 0.99 (the paper's; the authors' code ran Keras' 0.999). Only the trainable parameters take
the server's step; a BatchNorm's statistics (whose variance a step could drive below zero) and batch
count take the clients' mean (Flower's strategies step every array: the same on a model without
buffers). Clients train as FedAvg's; PM is the global model on each client's split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from protofl.federation.admission import ClientUpdate
from protofl.federation.client import PrototypeClient
from protofl.federation.server_rule import ServerRule
from protofl.settings import MethodOptions

ServerOptimizer = Literal["adam", "yogi", "adagrad"]
AUTO_ETA = {"adagrad": 10**-1, "adam": 1.0, "yogi": 1.0}  # the paper's CIFAR-100 server learning rates
AUTO_TAU = {"adagrad": 10**-2, "adam": 10**-1, "yogi": 10**-1}  # and adaptivities


@dataclass(frozen=True)
class FedOptOptions(MethodOptions):
    statistics: ClassVar[None] = None  # parameters only
    optimizer: ServerOptimizer = "adam"
    eta: float | Literal["auto"] = "auto"  # the server learning rate
    tau: float | Literal["auto"] = "auto"  # the adaptivity
    beta1: float = 0.9
    beta2: float = 0.99
    form: Literal["paper", "flower"] = "paper"

    capturable: ClassVar[bool] = True  # no batch loss

    def check(self) -> None:
        for key, value in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"fedopt.{key} must be in [0, 1), got {value}")
        for key, value in (("eta", self.server_lr), ("tau", self.adaptivity)):
            if value <= 0:
                raise ValueError(f"fedopt.{key} must be > 0, got {value}")

    @property
    def server_lr(self) -> float:
        return AUTO_ETA[self.optimizer] if self.eta == "auto" else float(self.eta)

    @property
    def adaptivity(self) -> float:
        return AUTO_TAU[self.optimizer] if self.tau == "auto" else float(self.tau)

    def resolved(self, settings) -> dict[str, float]:
        given = {"eta": (self.eta, self.server_lr), "tau": (self.tau, self.adaptivity)}
        return {key: value for key, (option, value) in given.items() if option == "auto"}


def server_step(x: np.ndarray, delta: np.ndarray, m: np.ndarray, v: np.ndarray, options: FedOptOptions,
                server_round: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One entry's (x_(t+1), m_t, v_t) of Algorithm 2, in float64."""
    b1, b2, eta, tau = options.beta1, options.beta2, options.server_lr, options.adaptivity
    if options.form == "flower" and options.optimizer == "adagrad":
        b1 = 0.0  # Flower's FedAdagrad has no first moment
    m = b1 * m + (1 - b1) * delta
    square = delta * delta
    if options.optimizer == "adagrad":
        v = v + square
    elif options.optimizer == "adam":
        v = b2 * v + (1 - b2) * square
    else:  # yogi
        v = v - (1 - b2) * square * np.sign(v - square)
    if options.form == "flower" and options.optimizer == "adam":  # Flower's FedAdam: Adam's bias correction
        eta = eta * np.sqrt(1 - b2 ** (server_round + 1.0)) / (1 - b1 ** (server_round + 1.0))
    return x + eta * m / (np.sqrt(v) + tau), m, v


class FedOptStrategy(ServerRule):
    options_class = FedOptOptions
    state_fields = ("first_moment", "second_moment")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        start = 0.0 if self.options.form == "flower" else self.options.adaptivity**2  # v_(-1)
        self.first_moment = [np.zeros(w.shape) for w in self.shared_weights()]
        self.second_moment = [np.full(w.shape, start) for w in self.shared_weights()]

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        weights = None if self.options.form == "flower" else [1.0] * len(updates)
        mean = self.average_parameters(updates, weights)  # x_t + Delta_t

        def step(i: int, x: np.ndarray, averaged: np.ndarray) -> np.ndarray:
            stepped, self.first_moment[i], self.second_moment[i] = server_step(
                x, averaged - x, self.first_moment[i], self.second_moment[i], self.options, server_round)
            return stepped

        return self.stepped_entries(self.admission.sent_parameters, mean, step)


class FedOptClient(PrototypeClient):
    options_class = FedOptOptions


STRATEGY, CLIENT = FedOptStrategy, FedOptClient
