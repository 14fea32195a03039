"""The local training loop: which mini-batches an epoch takes, its SGD, what it imports."""

import pytest
import torch
from fresh_process import imported_by
from torch import nn

from protofl.task.models import SplitModel
from protofl.task.train import SGD, steps_per_epoch, train


def batch_sizes(n, batch_size, partial_batch, epochs=1):
    """The sizes of the mini-batches :func:`train` trains on, in order."""
    model = SplitModel(nn.Flatten(), nn.Linear(2, 3), 2)
    sizes = []
    train(model, torch.zeros(n, 2), torch.zeros(n, dtype=torch.long), epochs=epochs, batch_size=batch_size,
          lr=0.1, seed=0, partial_batch=partial_batch,
          loss=lambda inputs, f, logits, y: sizes.append(len(y)) or logits.sum())
    return sizes


@pytest.mark.parametrize("n, drop, keep", [
    (20, [10, 10], [10, 10]),
    (22, [10, 10], [10, 10, 2]),  # the remainder of two: dropped by default (issue 23)
    (25, [10, 10], [10, 10, 5]),
    (21, [10, 10], [10, 10]),  # a one-sample batch is never trained on
    (9, [9], [9]),  # a split smaller than one batch is one batch
    (1, [1], [1]),
])
def test_an_epoch_drops_or_keeps_the_partial_batch(n, drop, keep):
    assert batch_sizes(n, 10, "drop") == drop and batch_sizes(n, 10, "keep") == keep
    assert steps_per_epoch(n, 10) == len(drop) and steps_per_epoch(n, 10, "keep") == len(keep)
    assert batch_sizes(n, 10, "drop", epochs=3) == drop * 3


def test_recomputed_batchnorm_statistics_are_those_of_the_data():
    from protofl.task.train import recompute_batchnorm_stats

    norm = nn.BatchNorm1d(2)
    model = nn.Sequential(norm, nn.Dropout(0.5))
    model.train()
    norm.num_batches_tracked.fill_(7)
    x = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    recompute_batchnorm_stats(model, x)
    assert norm.running_mean.tolist() == [2.0, 4.0] and norm.running_var.tolist() == [2.0, 8.0]  # unbiased
    assert norm.momentum == 0.1 and int(norm.num_batches_tracked) == 7 and model.training
    # in equal chunks (a seeded shuffle), each chunk's statistics count equally
    x = torch.arange(8.0).reshape(4, 2) ** 2
    recompute_batchnorm_stats(model, x, chunk_size=2)
    assert torch.allclose(norm.running_mean, x.mean(0))
    model.eval()
    assert torch.allclose(model(x), (x - norm.running_mean) / torch.sqrt(norm.running_var + norm.eps))


def test_batchnorm_statistics_are_stale_while_they_hold_over_one_percent_of_the_old_ones():
    from protofl.task.train import stale_batchnorm

    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    assert stale_batchnorm(model, 43) and not stale_batchnorm(model, 44)  # 0.9^43 = 0.0108, 0.9^44 = 0.0097
    assert not stale_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.GroupNorm(1, 2)), 0)
    assert not stale_batchnorm(nn.Sequential(nn.BatchNorm1d(2, track_running_stats=False)), 0)
    model[1].momentum = None
    assert stale_batchnorm(model, 1000)


def test_crop_flip_is_each_images_own_window_of_the_padded_image():
    from protofl.task.augment import crop_flip

    x = torch.arange(2 * 3 * 5 * 6, dtype=torch.float32).reshape(2, 3, 5, 6)
    fill = torch.tensor([-1.0, -2.0, -3.0])
    out = crop_flip(x, torch.Generator().manual_seed(7), fill, padding=2)
    padded = torch.cat([torch.full((2, 1, 9, 10), v) for v in fill.tolist()], dim=1)
    padded[:, :, 2:7, 2:8] = x
    for i in range(2):  # some offset (dy, dx) in [0, 4]^2, flipped or not
        windows = [padded[i, :, dy:dy + 5, dx:dx + 6] for dy in range(5) for dx in range(5)]
        assert any(torch.equal(out[i], w) or torch.equal(out[i], w.flip(-1)) for w in windows)
    # over many draws: every offset and both flips occur, and the draws come from the generator
    many = crop_flip(x[:1].expand(400, 3, 5, 6), torch.Generator().manual_seed(0), fill, padding=2)
    corner = many[:, 0, 0, 0]
    assert (corner == -1.0).any() and (corner != -1.0).any()
    assert torch.equal(many, crop_flip(x[:1].expand(400, 3, 5, 6), torch.Generator().manual_seed(0), fill, 2))


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.9, 1e-3), (0.0, 1e-2)])
def test_sgd_takes_torch_sgds_steps_to_the_bit(momentum, weight_decay):
    torch.manual_seed(0)
    ours, theirs = (nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)) for _ in range(2))
    theirs.load_state_dict(ours.state_dict())
    only_sometimes = ours[2].bias, theirs[2].bias  # a parameter that gets a gradient from step 3 on
    optimizers = (SGD(list(ours.parameters()), lr=0.1, momentum=momentum, weight_decay=weight_decay),
                  torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay))
    for step in range(6):
        x = torch.randn(8, 5)
        for model, optimizer, bias in zip((ours, theirs), optimizers, only_sometimes):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            if step < 2:
                bias.grad = None
            optimizer.step()
        for a, b in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(a, b)
    assert not torch.equal(ours[0].weight, nn.Sequential(nn.Linear(5, 4))[0].weight)


@pytest.mark.slow  # a fresh Python process, 2-3 s
def test_model_sizes_and_training_in_a_fresh_process_import_no_dynamo_torchvision_or_sympy():
    """torch.optim's first optimizer imports torch._dynamo: ~1.2 s of every deployment message; a CNN
    measured on torch's meta device (the ServerApp's model_bytes, once a run) by a forward pass
    imports sympy: ~1 s."""
    code = ("import sys, torch\nfrom protofl.task.models import build_model, model_bytes\n"
            "from protofl.task.train import train\n"
            "model_bytes('cnn', 1, 10, 28), model_bytes('fednh-cnn', 3, 10, 32)\n"
            "m = build_model('cnn', 1, 10, 28, 0)\n"
            "train(m, torch.randn(20, 1, 28, 28), torch.arange(20) % 10, epochs=1, batch_size=10, lr=0.1, seed=0,"
            " momentum=0.9, weight_decay=1e-4, max_grad_norm=1.0)\n")
    assert imported_by(code, ("torch._dynamo", "torchvision", "sympy")) == []
