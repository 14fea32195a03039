"""Mixed precision (bf16 autocast) and channels_last in the training loop and the eval pass."""

import pytest
import torch

from protofl.settings import ExperimentSettings
from protofl.task.models import SplitModel, build_model
from protofl.task.inference import features_and_logits
from protofl.task.precision import native_bf16, resolve_amp
from protofl.task.train import recompute_batchnorm_stats, train

CHANNELS, CLASSES, SIZE = 3, 4, 16


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: a second CPU thread only adds waiting (and is slow on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def toy_set() -> tuple[torch.Tensor, torch.Tensor]:
    """64 noisy 3x16x16 images; class k has a bright band in rows 4k..4k+3: separable."""
    y = torch.arange(64) % CLASSES
    x = 0.3 * torch.randn(64, CHANNELS, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    for k in range(CLASSES):
        x[y == k, :, 4 * k : 4 * k + 4, :] += 1.0
    return x, y


def fit(model, amp="off", channels_last=False, epochs=4) -> list[float]:
    """One ``train`` call per epoch on the toy set: the loss of each epoch."""
    x, y = toy_set()
    return [train(model, x, y, epochs=1, batch_size=16, lr=0.05, seed=epoch, amp=amp, channels_last=channels_last)
            for epoch in range(epochs)]


def trained(amp="off", channels_last=False, epochs=4):
    """A fresh seeded CNN after :func:`fit`: (model, loss of each epoch)."""
    model = build_model("cnn", CHANNELS, CLASSES, SIZE, seed=0)
    return model, fit(model, amp, channels_last, epochs)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_bf16_autocast_trains_close_to_float32_but_not_the_same():
    reference, fp32_losses = trained()
    model, losses = trained("bf16")
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.9 * losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast: the weights stay float32
    update = (flat(reference) - flat(build_model("cnn", CHANNELS, CLASSES, SIZE, seed=0))).norm()
    gap = (flat(model) - flat(reference)).norm() / update
    assert 1e-3 < gap < 0.2  # bf16 matmuls really ran, and the training went the same way
    assert losses != fp32_losses and losses == pytest.approx(fp32_losses, rel=0.02)


def test_channels_last_gives_the_same_losses_and_reaches_the_convolutions():
    reference, contiguous = trained()
    x, _ = toy_set()
    assert not x.is_contiguous(memory_format=torch.channels_last)  # 3 channels: the check can fail
    seen = []
    model = build_model("cnn", CHANNELS, CLASSES, SIZE, seed=0)
    convolutions = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    convolutions[0].register_forward_pre_hook(
        lambda _, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    assert fit(model, channels_last=True) == pytest.approx(contiguous, rel=1e-4)
    assert seen and all(seen)
    assert all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convolutions)
    features, logits = features_and_logits(model, x, channels_last=True)
    expected_features, expected_logits = features_and_logits(reference, x)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(features, expected_features, rtol=1e-3, atol=1e-3)


def test_a_model_first_moved_to_channels_last_by_the_eval_pass_still_trains():
    model = build_model("cnn", CHANNELS, CLASSES, SIZE, seed=0)
    features_and_logits(model, toy_set()[0], channels_last=True, amp="bf16")
    assert not any(torch.is_inference(p) for p in model.parameters())
    assert all(torch.isfinite(torch.tensor(fit(model, channels_last=True, epochs=1))))


@pytest.mark.parametrize("name", ["cnn", "tv-resnet18"])  # one of each: channels-last measured faster, slower
def test_auto_puts_a_backbone_in_channels_last_order_only_where_it_trains_faster_so(name):
    from protofl.task.models import CHANNELS_LAST_FASTER
    from protofl.task.precision import uses_channels_last

    model = build_model(name, CHANNELS, CLASSES, SIZE, seed=0)
    faster = name in CHANNELS_LAST_FASTER
    seen = []
    model.body.register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous(
        memory_format=torch.channels_last)))
    fit(model, channels_last="auto", epochs=1)
    features_and_logits(model, toy_set()[0], channels_last="auto")
    assert seen and set(seen) == {faster} and uses_channels_last(model, "auto") == faster
    assert uses_channels_last(model, True) and not uses_channels_last(model, False)  # explicit: as written


def test_channels_last_leaves_flat_inputs_alone():
    x, y = torch.randn(20, 8, generator=torch.Generator().manual_seed(0)), torch.arange(20) % 3

    def loss(channels_last):
        model = SplitModel(torch.nn.Identity(), torch.nn.Linear(8, 3), 8)
        torch.nn.init.constant_(model.head.weight, 0.1)
        torch.nn.init.zeros_(model.head.bias)
        return train(model, x, y, epochs=2, batch_size=10, lr=0.1, seed=0, channels_last=channels_last)

    assert loss(True) == loss(False)


def test_the_eval_pass_returns_float32_tensors_outside_autograd_under_amp():
    model, _ = trained(epochs=1)
    x, _ = toy_set()
    features, logits = features_and_logits(model, x, batch_size=24, amp="bf16")
    fp32_features, fp32_logits = features_and_logits(model, x, batch_size=24)
    for tensor in (features, logits, fp32_features, fp32_logits):
        assert tensor.dtype == torch.float32 and not tensor.requires_grad and not torch.is_inference(tensor)
    weight = torch.ones(CLASSES, requires_grad=True)
    (logits * weight).sum().backward()  # usable as a constant in a later loss
    torch.testing.assert_close(weight.grad, logits.sum(0))
    assert features.shape == (64, 512) and logits.shape == (64, CLASSES)
    assert not torch.equal(logits, fp32_logits)  # computed in bf16 ...
    torch.testing.assert_close(logits, fp32_logits, rtol=0.05, atol=0.05)  # ... and close
    assert model.training is False and all(p.requires_grad for p in model.parameters())


def test_a_bad_amp_is_an_error_and_the_run_config_reads_both_keys():
    with pytest.raises(ValueError, match="amp must be one of"):
        fit(build_model("cnn", CHANNELS, CLASSES, SIZE, seed=0), amp="fp16")
    settings = ExperimentSettings.from_run_config({"amp": "bf16", "channels-last": True})
    assert (settings.amp, settings.channels_last) == ("bf16", True)
    assert (ExperimentSettings().amp, ExperimentSettings().channels_last) == ("auto", "auto")
    with pytest.raises(ValueError, match="amp must be one of"):
        ExperimentSettings.from_run_config({"amp": "fp16"})


@pytest.mark.parametrize("avx512_bf16, amx, expected",
                         [(False, False, "off"), (True, False, "bf16"), (False, True, "bf16")])
def test_auto_is_bf16_only_on_a_cpu_with_native_bf16_and_then_trains_as_that(monkeypatch, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cpu = torch.device("cpu")
    assert native_bf16(cpu) == (expected == "bf16") and resolve_amp("auto", cpu) == expected
    assert resolve_amp("off", cpu) == "off" and resolve_amp("bf16", cpu) == "bf16"  # explicit: as written
    model, losses = trained("auto", epochs=2)
    reference, expected_losses = trained(expected, epochs=2)
    assert losses == expected_losses and torch.equal(flat(model), flat(reference))


@pytest.mark.parametrize("capability, expected", [((7, 5), "off"), ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_auto_on_cuda_is_bf16_from_compute_capability_8_with_captured_steps_only(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda")
    assert resolve_amp("auto", cuda) == resolve_amp("auto", cuda, "auto") == expected
    assert resolve_amp("auto", cuda, "off") == "off"  # eager steps: bf16 trained slower than float32
    assert resolve_amp("bf16", cuda, "off") == "bf16"  # explicit: as written


@pytest.mark.parametrize("name", ["tv-resnet18", "tv-mobilenetv2"])  # channels-last faster on CUDA, slower
def test_auto_on_cuda_puts_a_backbone_in_channels_last_order_as_measured_there_with_captured_steps(name):
    from protofl.task.models import CHANNELS_LAST_FASTER_CUDA
    from protofl.task.precision import uses_channels_last

    model, cuda = build_model(name, CHANNELS, CLASSES, SIZE, seed=0), torch.device("cuda")
    assert uses_channels_last(model, "auto", cuda) == (name in CHANNELS_LAST_FASTER_CUDA) == (name == "tv-resnet18")
    assert not uses_channels_last(model, "auto", cuda, "off")  # eager CUDA steps: NCHW
    assert uses_channels_last(model, True, cuda, "off")  # explicit: as written


def test_batchnorm_statistics_are_recomputed_in_the_eval_pass_precision_and_format():
    model = build_model("resnet8-x4", CHANNELS, CLASSES, SIZE, seed=0)
    x, _ = toy_set()

    def statistics(**precision):
        recompute_batchnorm_stats(model, x, **precision)
        return [b.clone() for name, b in model.named_buffers() if name.endswith(("running_mean", "running_var"))]

    fp32 = statistics()
    seen = []
    convolution = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    hook = convolution.register_forward_hook(lambda _, args, out: seen.append((
        args[0].is_contiguous(memory_format=torch.channels_last), out.dtype)))
    bf16 = statistics(amp="bf16", channels_last=True)
    hook.remove()
    assert seen and all(s == (True, torch.bfloat16) for s in seen)  # the pass ran channels-last, in bf16
    assert any(not torch.equal(a, b) for a, b in zip(fp32, bf16))
    for a, b in zip(fp32, bf16):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)


def test_a_run_records_how_it_computes_and_the_server_scores_the_global_model_with_the_runs_precision(
        tmp_path, monkeypatch):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from inprocess import run_in_process

    from protofl.federation import evaluation

    scored = []
    original = evaluation.features_and_logits
    monkeypatch.setattr(evaluation, "features_and_logits", lambda *a, **k: scored.append(k) or original(*a, **k))
    for amp in ("auto", "off"):
        run_in_process({"dataset": "digits", "num-server-rounds": 1, "local-epochs": 1, "amp": amp,
                        "output-dir": str(tmp_path), "run-name": amp}, num_nodes=2)
        compute = json.loads((tmp_path / amp / "results.json").read_text())["compute"]
        assert compute["amp"] == amp and compute["autocast"] == resolve_amp(amp, torch.device("cpu"))
        assert compute["channels_last"] == "auto" and compute["memory_format"] == "channels-last"  # the CNN's
        assert compute["device"] == "cpu" and compute["threads"] >= 1
        assert scored[-1] == {"amp": amp, "channels_last": "auto", "cuda_graphs": "auto"}


def test_bf16_training_on_concurrent_threads_gives_what_it_gives_alone():
    """Clients on one process's threads (Flower's thread pool) train under bf16 autocast at once:
    torch's autocast cache of cast weights is process-wide, so it must be off for them to stay apart."""
    from concurrent.futures import ThreadPoolExecutor

    x, y = toy_set()

    def run(seed: int) -> tuple[list[float], torch.Tensor]:
        model = build_model("cnn", CHANNELS, CLASSES, SIZE, seed=seed)
        anchors = torch.randn(CLASSES, 512, generator=torch.Generator().manual_seed(seed))

        def head_twice(inputs, features, logits, labels):  # the head again in the same autocast region (FedSA's L_CC)
            cross_entropy = torch.nn.functional.cross_entropy
            return cross_entropy(logits, labels) + cross_entropy(model.head(anchors), torch.arange(CLASSES))

        losses = [train(model, x, y, epochs=1, batch_size=8, lr=0.05, seed=e, amp="bf16", loss=head_twice)
                  for e in range(2)]
        return losses, flat(model)

    alone = [run(seed) for seed in range(4)]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(2):
            together = list(pool.map(run, range(4)))
            for (losses, weights), (expected_losses, expected) in zip(together, alone):
                assert losses == expected_losses and torch.equal(weights, expected)
