"""HtFLlib's own ``system/main.py`` (TsingZ0/HtFLlib, its code run unmodified from a checkout) on a
data folder that benchmarks/pfllib_data.py wrote, with its per-round, per-client test scores saved.

    python benchmarks/htfllib_run.py --htfllib /tmp/htfllib-e959261 --work /tmp/htfl --out scores.json \\
        [--replay-seed 0 --fraction 0.5 --min-clients 5] -- -data FMNIST-fedsa -m HtFE-img-2 -algo FedProto ...

Everything after ``--`` is main.py's own command line. main.py runs in ``<work>/system`` (created
empty: it reads ``../dataset/<-data>`` and writes ``temp/`` and ``../results/`` there), with
HtFLlib's ``system/`` on the import path; nothing is written into the checkout. What this wrapper
does around it, each outside HtFLlib's files:

- ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``: HtFLlib keeps every model as a whole pickled module
  (``torch.save(model)`` / ``torch.load``), which torch >= 2.6 refuses by default (weights only).
- Stand-ins for modules main.py imports and FedProto never uses: ``h5py`` (its ``save_results``
  writes no .h5 file here; ``average_data``, which reads them back, is skipped), ``calmsize`` (its
  memory report, skipped), the three FedKTL servers (stylegan, stable diffusion) and the two FedL2G
  servers (``higher``), and, where they are not installed, ``cvxpy`` (PFLlib's FedPAC's solver) and
  ``mmcv.cnn`` (FedSA's server, lokinko/FedSA, an HtFLlib fork: its anchor projector's ``SyncBN``,
  which without a process group is BatchNorm, built as ``BatchNorm1d``); and each method server
  whose code, or its client's, is not valid Python (FedSA's fork's FedDistill client).
- Inputs other than 3 x 32 x 32 (Fashion-MNIST's 1 x 28 x 28): HtFLlib's image families name
  ``FedAvgCNN(in_features=3, ..., dim=1600)`` and torchvision models with a 3-channel stem. The CNN
  is built with the data's channels and flattened size (1 and 1024), and torchvision's ResNets get a
  stem for the data's channels, ``Conv2d(C, 64, 7, 2, 3, bias=False)`` Kaiming-initialised (fan_out,
  ReLU) as torchvision initialises its own: the architectures protofl's ``cnn`` and ``tv-resnet*``
  build for that input. Nothing changes for 3 x 32 x 32 data.
- ``--replay-seed S``: each round's clients are the ones protofl trains in that round
  (``protofl.task.sampling.sample_partitions`` with ``--fraction``, ``--min-clients`` and seed S;
  HtFLlib's round i = protofl's round i + 1); ``--numpy-seed S`` seeds HtFLlib's own unseeded
  ``np.random.choice`` instead. HtFLlib's models start from ``torch.manual_seed(0)`` whatever the seed
  (main.py, and again in every client's constructor); ``--torch-seed S`` makes each of those S, for
  the reference's own spread over initial weights and batch orders.

PFLlib (TsingZ0/PFLlib, HtFLlib's parent) has the same ``system/`` layout, data files, flags and
server hooks: ``--htfllib`` may be a PFLlib checkout. Its CNN for a data set named ``*MNIST*`` is
already the 1 x 28 x 28 one.

``--out``: JSON with every evaluation HtFLlib makes (``evaluate()`` at the start of each round, over
all clients, before that round's training: evaluation k scores the models and global prototypes
after k rounds of training): per client its correct count and test size, the sample-weighted
accuracy (HtFLlib's "Averaged Test Accuracy": sum correct / sum tested) and the unweighted mean of
the clients' accuracies; and each round's trained clients. ``--score personalized`` records the
scores of ``test_metrics_personalized`` instead, where a PFLlib method keeps a personal model beside
the one ``test_metrics`` scores (Ditto's ``model_per``, pFedMe's personalized model): the model
protofl's personalized accuracy scores.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import runpy
import sys
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def stub(name: str, **attributes) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module


def norm_layer(cfg: dict, num_features: int) -> tuple[str, torch.nn.Module]:
    """mmcv's ``build_norm_layer`` for the one norm FedSA's server asks for, ``SyncBN``: without a
    distributed process group it normalises as BatchNorm over the batch, so BatchNorm1d here."""
    if cfg.get("type") != "SyncBN":
        raise NotImplementedError(f"norm {cfg!r}: only SyncBN (FedSA's) is stood in for")
    layer = torch.nn.BatchNorm1d(num_features)
    layer.requires_grad_(cfg.get("requires_grad", True))
    return "bn", layer


def stub_servers_that_do_not_compile(system: Path) -> None:
    """main.py imports every method's server: one whose own file, or its client's, is not valid
    Python (lokinko/FedSA 75bf106's clientdistill.py) stops every run. Each such server module is
    stood in for by a module with main.py's names from it as None (the method itself cannot run)."""
    sources = {f"flcore.{folder}.{path.stem}": path.read_text()
               for folder in ("clients", "servers") for path in sorted((system / "flcore" / folder).glob("*.py"))}
    broken = set()
    for module, text in sources.items():
        try:
            compile(text, module, "exec")
        except SyntaxError:
            broken.add(module)
    main = (system / "main.py").read_text()
    for module, text in sources.items():
        if module.startswith("flcore.servers.") and (
                module in broken or any(f"from {name} import" in text for name in broken)):
            names = re.findall(rf"^from {re.escape(module)} import (\w+)", main, re.M)
            print(f"htfllib_run: {module} or a module it imports does not compile; stood in for "
                  f"({', '.join(names)} = None)", flush=True)
            stub(module, **dict.fromkeys(names))


def data_shape(work: Path, dataset: str) -> tuple[int, ...]:
    with open(work / "dataset" / dataset / "train" / "0.npz", "rb") as f:
        return tuple(np.load(f, allow_pickle=True)["data"].tolist()["x"].shape[1:])


def adapt_models(channels: int, size: int) -> None:
    """HtFLlib's image models for ``channels`` x ``size`` x ``size`` inputs (see the module's docstring)."""
    import torchvision
    from torch import nn

    from flcore.trainmodel import models

    original_init = models.FedAvgCNN.__init__  # the class stays (HtFLlib pickles its models whole)

    def cnn_init(self, in_features=3, num_classes=10, dim=1600):
        flat = 64 * (((size - 4) // 2 - 4) // 2) ** 2
        original_init(self, in_features=channels, num_classes=num_classes, dim=flat)

    models.FedAvgCNN.__init__ = cnn_init

    def with_stem(build):
        def built(*args, **kwargs):
            net = build(*args, **kwargs)
            old = net.conv1
            net.conv1 = nn.Conv2d(channels, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False)
            nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
            return net
        return built

    for name in ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152"):
        setattr(torchvision.models, name, with_stem(getattr(torchvision.models, name)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--htfllib", type=Path, required=True, help="an HtFLlib checkout (its system/ is used)")
    parser.add_argument("--work", type=Path, required=True, help="holds dataset/<name>/ (pfllib_data.py --out)")
    parser.add_argument("--out", type=Path, required=True, help="the scores' JSON")
    parser.add_argument("--replay-seed", type=int, help="train protofl's clients of each round (its seed)")
    parser.add_argument("--fraction", type=float, default=0.5, help="protofl's fraction-fit (with --replay-seed)")
    parser.add_argument("--min-clients", type=int, default=0, help="protofl's min-fit-clients (with --replay-seed)")
    parser.add_argument("--numpy-seed", type=int, help="np.random.seed before HtFLlib runs")
    parser.add_argument("--torch-seed", type=int,
                        help="seed torch with this wherever the reference seeds it with 0 (main.py, each client)")
    parser.add_argument("--score", choices=("model", "personalized"), default="model",
                        help="which evaluation is recorded: test_metrics, or test_metrics_personalized")
    args = parser.parse_args(ours)

    system = (args.htfllib / "system").resolve()
    work, out = args.work.resolve(), args.out.resolve()
    dataset = theirs[theirs.index("-data") + 1] if "-data" in theirs else "MNIST"
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    (work / "system").mkdir(parents=True, exist_ok=True)
    os.chdir(work / "system")
    sys.path.insert(0, str(system))
    stub("h5py", File=None)
    stub("calmsize", size=lambda *a, **k: "")
    for name in ("serverktl_stylegan_xl", "serverktl_stylegan_3", "serverktl_stable_diffusion"):
        stub(f"flcore.servers.{name}", FedKTL=None)
    for name in ("serverl2g_feat", "serverl2g_logit"):
        stub(f"flcore.servers.{name}", FedL2G=None)
    try:  # PFLlib's FedPAC solves with cvxpy; main.py imports it for every method
        import cvxpy  # noqa: F401
    except ImportError:
        stub("cvxpy")
    try:  # FedSA's server (lokinko/FedSA) builds its anchor projector's norms with mmcv
        import mmcv.cnn  # noqa: F401
    except ImportError:
        stub("mmcv")
        stub("mmcv.cnn", ConvModule=None, build_norm_layer=norm_layer)

    stub_servers_that_do_not_compile(system)
    from flcore.servers import serverbase
    from utils import mem_utils, result_utils

    result_utils.average_data = lambda **kwargs: None
    mem_utils.MemReporter.report = lambda self, *a, **k: None
    serverbase.Server.save_results = lambda self: None
    shape = data_shape(work, dataset)
    if shape != (3, 32, 32):
        adapt_models(shape[0], shape[1])

    record = {"command": ["main.py", *theirs], "wrapper": ours, "input_shape": list(shape), "selected": [],
              "evaluations": []}

    def write() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1))

    original_select = serverbase.Server.select_clients
    sys.path.append(str(ROOT))  # after HtFLlib's system/: its own modules come first
    from protofl.task.sampling import sample_partitions

    def select_clients(self):
        if args.replay_seed is None:
            chosen = original_select(self)
        else:
            ids = sample_partitions(range(self.num_clients), args.fraction, args.min_clients, args.replay_seed,
                                    len(record["selected"]) + 1)
            chosen = [self.clients[i] for i in ids]
        record["selected"].append(sorted(int(c.id) for c in chosen))
        return chosen

    def recording(original):
        def test_metrics(self):
            scores = original(self)
            record_scores(*scores[:3])
            return scores  # to HtFLlib's evaluate() as they came
        return test_metrics

    def record_scores(ids, sizes, correct):
        totals = [int(round(n)) for n in sizes]  # FedProto's "no prototypes yet": 1e-5
        accuracies = [c / n if n else 0.0 for c, n in zip(correct, totals)]
        record["evaluations"].append({
            "trained_rounds": len(record["evaluations"]), "clients": [int(i) for i in ids],
            "correct": [int(c) for c in correct], "tested": totals,
            "accuracy": sum(correct) / max(sum(totals), 1), "mean": float(np.mean(accuracies)),
            "std": float(np.std(accuracies)), "per_client": accuracies})
        write()

    serverbase.Server.select_clients = select_clients
    if args.score == "model":
        serverbase.Server.test_metrics = recording(serverbase.Server.test_metrics)
    else:  # the servers whose clients keep a personal model
        for module, name in (("serverditto", "Ditto"), ("serverpFedMe", "pFedMe")):
            server = getattr(importlib.import_module(f"flcore.servers.{module}"), name)
            server.test_metrics_personalized = recording(server.test_metrics_personalized)
    if args.numpy_seed is not None:
        np.random.seed(args.numpy_seed)
    if args.torch_seed is not None:  # its initial weights and batch orders, else the same whatever -go says
        seed_torch = torch.manual_seed
        torch.manual_seed = lambda seed: seed_torch(args.torch_seed if seed == 0 else seed)
    sys.argv = ["main.py", *theirs]
    write()
    runpy.run_path(str(system / "main.py"), run_name="__main__")
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
