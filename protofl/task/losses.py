"""Loss terms several methods add to their clients' cross-entropy (pure torch)."""

from __future__ import annotations

import torch


def proximal_term(parameters: list[torch.Tensor], anchors: list[torch.Tensor]) -> torch.Tensor:
    """||w - w^t||^2 / 2 over every parameter (FedProx's Eq. 2 without mu; Ditto's, FedAMP's)."""
    return sum(((p - a) ** 2).sum() for p, a in zip(parameters, anchors)) / 2


def prototype_loss(
    features: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """MSE between each feature and its label's global prototype, averaged over batch x d (FedProto's,
    FedTGP's, FedPAC's).

    Samples whose class has no global prototype contribute zero (as PFLlib's FedProto).
    """
    has_prototype = mask[labels].unsqueeze(1).to(features.dtype)
    return ((features - prototypes[labels]) ** 2 * has_prototype).sum() / features.numel()


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32, or float64 if it is: a divergence of bfloat16 logits (bf16 autocast,
    which leaves CPU softmaxes in bfloat16) summed in bfloat16 is rounding noise around 0, negative
    as often as not for two near distributions, and a bfloat16 running sum stops growing."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def mean_kl(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(target) || softmax(logits)) averaged over the batch and the classes (``nn.KLDivLoss()``
    on log-probabilities and probabilities; FML's, FedKD's), in float32 at least."""
    logits, target_logits = at_least_float32(logits), at_least_float32(target_logits)
    target = target_logits.softmax(dim=1)
    return (torch.xlogy(target, target) - target * logits.log_softmax(dim=1)).mean()
