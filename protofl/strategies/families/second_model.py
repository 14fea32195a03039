"""The second-model family: each client trains a shared model of one architecture beside its own
model (any architecture, kept on its node), both in one training loop; the shared one goes up and is
averaged (FML, FedKD)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from protofl.federation.client import PrototypeClient
from protofl.settings import KeptModel
from protofl.strategies.families.averaging import ParameterAveraging
from protofl.task.kept_models import kept_model
from protofl.task.models import SplitModel, build_model, client_architecture
from protofl.task.precision import uses_channels_last


@dataclass(frozen=True)
class SecondModel(ParameterAveraging):
    """A method whose clients share a second model beside their own (FML, FedKD)."""

    keeps_model: ClassVar[KeptModel] = "trains"  # the own model; the shared one is received
    shares_across_architectures: ClassVar[bool] = True  # the shared model has one architecture
    max_grad_norm: ClassVar[float] = 10.0  # each model's (HtFLlib's)
    weighted: bool = False


class MutualModels(nn.Module):
    """Models trained together in one training loop: the first one's outputs go to the loss, which
    runs the others."""

    def __init__(self, *models: nn.Module) -> None:
        super().__init__()
        self.models = nn.ModuleList(models)

    def forward(self, x: torch.Tensor):
        return self.models[0](x)

    @property
    def channels_last_faster(self) -> tuple[str, ...]:
        """The devices where every backbone among them trains faster channels-last."""
        kinds = [set(m.channels_last_faster) for m in self.models if hasattr(m, "channels_last_faster")]
        return tuple(set.intersection(*kinds)) if kinds else ()


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


class SecondModelClient(PrototypeClient):
    """A client that trains the shared model beside its own, in one loop (FML's, FedKD's)."""

    def exchanged_model(self) -> SplitModel:
        """The family's first architecture (the server's model) for every client: the thread's kept
        one, set back to its values as built, as the client's own model is
        (:func:`~protofl.task.kept_models.kept_model`), not one built for every message."""
        d, s = self.data, self.settings
        name = client_architecture(s.model, 0)
        key = ("second model", name, d.in_channels, d.num_classes, d.image_size, repr(s))
        model = kept_model(key, lambda: build_model(name, d.in_channels, d.num_classes, d.image_size, s.seed))
        return model.to(self.device, next(self.model.parameters()).dtype)

    def train_together(self, this_round, loss, *extra: nn.Module) -> float:
        """Both models (and ``extra`` modules) trained on ``loss``, each one's gradient clipped alone."""
        models = (self.model, self.exchanged, *extra)
        together = MutualModels(*models)
        precision = self.precision
        if not uses_channels_last(together, precision["channels_last"], self.device, precision["cuda_graphs"]):
            together.to(memory_format=torch.contiguous_format)  # not as an earlier pass left one of them
        return self.train_model(this_round, model=together, loss=loss, clip_groups=[trainable(m) for m in models])
