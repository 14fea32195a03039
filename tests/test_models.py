import pytest
import torch

from protofl.task.models import build_model


@pytest.mark.parametrize(
    "name,channels,size,classes",
    [("cnn", 1, 16, 10), ("cnn", 1, 28, 10), ("cnn", 3, 32, 100), ("resnet18", 3, 32, 10), ("resnet18", 1, 28, 10)],
)
def test_models_return_512_d_features_and_logits(name, channels, size, classes):
    model = build_model(name, channels, classes, size, seed=0)
    features, logits = model(torch.randn(4, channels, size, size))
    assert features.shape == (4, 512) and logits.shape == (4, classes)
    assert model.feature_dim == 512
    assert torch.equal(model.head(features), logits)


def test_same_seed_same_initial_weights():
    a, b, c = (build_model("cnn", 1, 10, 28, seed=s) for s in (1, 1, 2))
    for (name, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), name
    assert not all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="model must be one of"):
        build_model("vgg", 3, 10, 32, seed=0)
