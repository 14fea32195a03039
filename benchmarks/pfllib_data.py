"""Random CIFAR-10-shaped data written twice: for protofl and for PFLlib (benchmarks/pfllib_fedproto.sh).

    python benchmarks/pfllib_data.py --out /tmp/pfl [--samples 60000] [--clients 20] [--alpha 0.1] [--seed 1]

``--samples`` random 3x32x32 uint8 images, labels spread evenly over the 10 classes in a seeded
order, written

- in torchvision's CIFAR-10 layout, ``<out>/cifar/cifar-10-batches-py/data_batch_1..5`` (the first
  5/6 of the images) and ``test_batch`` (the last 1/6), which protofl reads with
  ``dataset='cifar10' data-dir='<out>/cifar' pool='train+test'`` (train then test, merged: the same
  order as here);
- in PFLlib's layout, ``<out>/dataset/Cifar10/{train,test}/<client>.npz`` and ``config.json``, as
  PFLlib's ``dataset/generate_Cifar10.py noniid - dir`` writes them: each file ``np.savez_compressed``
  of ``data={'x': float32 (n, 3, 32, 32) = (pixel / 255 - 0.5) / 0.5, 'y': int64 (n,)}``, what
  ``system/utils/data_utils.py:read_client_data`` loads (run PFLlib's ``system/main.py`` from
  ``<out>/system``: it reads ``../dataset/Cifar10``).

The client split is PFLlib's own (``--pfllib-split pfllib``, default): its ``dataset_utils.separate_data``
(Dirichlet ``dir``, ``alpha``) and ``split_data`` (sklearn's ``train_test_split``, 75 % train) run on
the sample indices with ``np.random.seed(seed)`` first, as generate_Cifar10.py does (seed 1). That
Dirichlet draw is the one protofl's ``partition='dirichlet-pfllib'`` makes with ``partition-seed``
= seed, which is checked here client by client; the local 75/25 cut differs (protofl's is
stratified per class, PFLlib's is not), so the training sizes may differ by a few samples per client:
both are printed. ``--pfllib-split protofl`` writes PFLlib's files with protofl's own per-client
train/test indices instead (then both train on exactly the same samples).

A preset's own clients, for PFLlib or HtFLlib (benchmarks/htfllib_compare.sh)::

    python benchmarks/pfllib_data.py --preset presets/fmnist-fedsa-table2.toml --out /tmp/htfl --name FMNIST-fedsa

writes the tensors protofl's clients of that preset train and test on (``load_client_data``: the
same samples, normalised as protofl normalises them, in the input shape protofl uses, e.g.
1 x 28 x 28) to ``<out>/dataset/<name>/{train,test}/<client>.npz``, each split in a seeded random
order (``--order``, ``--seed``); ``--run-config`` adds overrides after the preset's, ``--clients``
overrides the preset's ``num-supernodes``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import sys
import time
import types
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PFLLIB = ROOT / ".pfllib"
IMAGES: np.ndarray | None = None  # (samples, 3072) uint8, shared with the writer processes by fork
LABELS: np.ndarray | None = None


def write_cifar(folder: Path, num_train: int) -> None:
    """torchvision's cifar-10-batches-py: five training batches and the test batch, pickled dicts."""
    folder.mkdir(parents=True, exist_ok=True)
    batches = [(f"data_batch_{i + 1}", part) for i, part in enumerate(np.array_split(np.arange(num_train), 5))]
    batches.append(("test_batch", np.arange(num_train, len(LABELS))))
    for name, idx in batches:
        batch = {"batch_label": name, "labels": LABELS[idx].tolist(), "data": IMAGES[idx],
                 "filenames": [f"{i}.png" for i in idx]}
        with open(folder / name, "wb") as handle:
            pickle.dump(batch, handle, protocol=2)
    with open(folder / "batches.meta", "wb") as handle:
        pickle.dump({"label_names": [f"class{c}" for c in range(10)], "num_cases_per_batch": 10000,
                     "num_vis": 3072}, handle, protocol=2)


def save_client_file(path: str, x: np.ndarray, y: np.ndarray, compressed: bool) -> str:
    """One client file as PFLlib's and HtFLlib's ``read_client_data`` load it: ``np.savez[_compressed]``
    of ``data={'x': float32 (n, C, H, W), 'y': int64 (n,)}``."""
    data = {"x": np.ascontiguousarray(x, dtype=np.float32), "y": np.asarray(y, dtype=np.int64)}
    with open(path, "wb") as f:
        (np.savez_compressed if compressed else np.savez)(f, data=data)
    return path


def write_client_file(path: str, idx: np.ndarray, compressed: bool) -> str:
    """One PFLlib client file: images of ``idx`` as ToTensor + Normalize(0.5, 0.5) gives them."""
    x = IMAGES[idx].reshape(-1, 3, 32, 32).astype(np.float32) / np.float32(255)
    x = (x - np.float32(0.5)) / np.float32(0.5)
    return save_client_file(path, x, LABELS[idx], compressed)


def write_config(root: Path, num_clients: int, statistic: list, alpha: float, batch_size: int, **extra) -> None:
    """``config.json`` beside the client folders, as PFLlib's generate_*.py scripts write it."""
    config = {"num_clients": num_clients, "num_classes": 10, "non_iid": True, "balance": False,
              "partition": "dir", "Size of samples for labels in clients": statistic, "alpha": alpha,
              "batch_size": batch_size} | extra
    (root / "config.json").write_text(json.dumps(config))


def write_preset_clients(args: argparse.Namespace) -> int:
    """``--preset``: protofl's own clients of a preset (its partition, data fraction, local train/test
    split and normalisation: the tensors ``load_client_data`` gives each client) in PFLlib's / HtFLlib's
    layout, ``<out>/dataset/<name>/{train,test}/<client>.npz`` and ``config.json``.

    Each split is written in a seeded random order (``--order shuffled``, seed ``--seed``): the files
    that PFLlib's generate scripts write come out of sklearn's shuffling ``train_test_split``, and
    PFLlib's and HtFLlib's training loaders read them unshuffled, while protofl's partitions are in
    index order (grouped by class). ``--order as-is`` keeps protofl's order."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from compare import merged, preset_overrides, preset_federation, config_pairs
    from protofl.settings import ExperimentSettings, default_run_config, parse_overrides
    from protofl.task.data import load_client_data

    overrides = merged(f"{preset_overrides(args.preset)} {args.run_config}")
    settings = ExperimentSettings.from_run_config(default_run_config(ROOT / "pyproject.toml") | parse_overrides(overrides))
    clients = args.clients or int(config_pairs(preset_federation(args.preset)).get("num-supernodes", 10))
    spec = settings.partition_spec(clients)
    root = args.out.expanduser().resolve() / "dataset" / args.name
    for sub in ("train", "test"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    statistic, sizes = [], {"train": [], "test": []}
    for p in range(clients):
        data = load_client_data(settings.dataset, settings.data_dir, spec, p)
        splits = {"train": (data.train_x.numpy(), data.train_y.numpy()), "test": (data.test_x.numpy(), data.test_y.numpy())}
        for sub, (x, y) in splits.items():
            order = rng.permutation(len(y)) if args.order == "shuffled" else np.arange(len(y))
            save_client_file(str(root / sub / f"{p}.npz"), x[order], y[order], not args.uncompressed)
            sizes[sub].append(len(y))
        labels = np.concatenate([data.train_y.numpy(), data.test_y.numpy()])
        statistic.append([(int(c), int(n)) for c, n in zip(*np.unique(labels, return_counts=True))])
        print(f"client {p}: train {len(data.train_y)} {data.class_counts().tolist()}, test {len(data.test_y)}")
    write_config(root, clients, statistic, spec.alpha, settings.batch_size, partition=spec.scheme,
                 protofl_preset=str(args.preset), protofl_overrides=args.run_config, order=args.order,
                 order_seed=args.seed, shape=list(data.train_x.shape[1:]))
    (root / "sizes.json").write_text(json.dumps(sizes))
    print(f"{settings.dataset}: {clients} clients of {args.preset} ({spec}) in {root}: "
          f"train {sum(sizes['train'])}, test {sum(sizes['test'])}, input {tuple(data.train_x.shape[1:])}")
    return 0


def import_dataset_utils():
    """PFLlib's dataset/utils/dataset_utils.py, with the stand-ins for what it imports and does
    not use here (ujson; PIL for its ImageDataset, only if missing)."""
    saved = list(sys.path)
    sys.path[:0] = [str(PFLLIB / "stubs"), str(PFLLIB / "dataset")]
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        sys.modules["PIL"] = types.SimpleNamespace(Image=None)
    try:
        from utils import dataset_utils  # PFLlib's dataset/utils package (no __init__.py: namespace package)
    finally:
        sys.path[:] = saved  # the stand-ins only for this import
    return dataset_utils


def pfllib_split(num_clients: int, alpha: float, seed: int) :
    """(train indices, test indices, statistic) per client, by PFLlib's own functions, seeded as
    generate_Cifar10.py: the images are indexed by sample number, so the draws are PFLlib's."""
    du = import_dataset_utils()
    du.alpha = alpha  # a module constant there (0.1)
    np.random.seed(seed)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints every client's classes
        X, y, statistic = du.separate_data((np.arange(len(LABELS)), LABELS), num_clients, 10,
                                           niid=True, balance=False, partition="dir")
        train, test = du.split_data(X, y)
    return [t["x"] for t in train], [t["x"] for t in test], statistic, du


def protofl_split(num_clients: int, alpha: float, seed: int):
    """protofl's partitions and local train/test indices for the same pool (``dirichlet-pfllib``,
    partition-seed = seed, pool train+test, test-fraction 0.25)."""
    sys.path.insert(0, str(ROOT))
    from protofl.task.partition import PartitionSpec, client_split, partition_indices

    spec = PartitionSpec(scheme="dirichlet-pfllib", num_partitions=num_clients, alpha=alpha, seed=seed,
                         test_fraction=0.25, pool="train+test")
    parts = partition_indices(LABELS, spec)
    splits = [client_split(LABELS, part, spec, p) for p, part in enumerate(parts)]
    return parts, [s[0] for s in splits], [s[1] for s in splits]


def main(argv: list[str] | None = None) -> int:
    global IMAGES, LABELS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=60_000, help="images in all (CIFAR-10: 60,000)")
    parser.add_argument("--clients", type=int, help="20 (random images); a preset's own count (--preset)")
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=1, help="PFLlib's np.random.seed and protofl's partition-seed")
    parser.add_argument("--pfllib-split", choices=("pfllib", "protofl"), default="pfllib")
    parser.add_argument("--uncompressed", action="store_true", help="np.savez instead of PFLlib's savez_compressed")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with protofl's split")
    preset = parser.add_argument_group("a preset's clients (instead of random CIFAR-10-shaped images)")
    preset.add_argument("--preset", type=Path, help="write protofl's clients of this preset (presets/*.toml)")
    preset.add_argument("--run-config", default="", help="overrides after the preset's")
    preset.add_argument("--name", default="protofl", help="the data set folder's name (HtFLlib's -data)")
    preset.add_argument("--order", choices=("shuffled", "as-is"), default="shuffled")
    args = parser.parse_args(argv)
    if args.preset:
        return write_preset_clients(args)
    args.clients = args.clients or 20
    if args.samples % 60:
        parser.error("--samples must be a multiple of 60 (10 classes, 5/6 in the training files)")
    started = time.perf_counter()
    out = args.out.expanduser().resolve()
    LABELS = np.random.default_rng(args.seed).permutation(np.arange(args.samples) % 10).astype(np.int64)
    IMAGES = np.random.default_rng(args.seed + 1).integers(0, 256, (args.samples, 3072), dtype=np.uint8)
    num_train = args.samples * 5 // 6
    write_cifar(out / "cifar" / "cifar-10-batches-py", num_train)

    train, test, statistic, du = pfllib_split(args.clients, args.alpha, args.seed)
    sizes = {"pfllib_train": [len(t) for t in train], "pfllib_test": [len(t) for t in test]}
    p_split = None
    if not args.no_check or args.pfllib_split == "protofl":
        try:
            p_split = protofl_split(args.clients, args.alpha, args.seed)
        except (ImportError, ValueError) as err:  # no flwr-datasets here, or protofl's split gives up
            if args.pfllib_split == "protofl":
                raise
            print(f"WARNING: protofl's split not checked: {type(err).__name__}: {err}")
    if p_split is not None:
        parts, p_train, p_test = p_split
        sizes |= {"protofl_train": [len(t) for t in p_train], "protofl_test": [len(t) for t in p_test]}
        same_partition = [np.array_equal(np.sort(np.concatenate([a, b])), part)
                          for a, b, part in zip(train, test, parts)]
        sizes["same_partition"] = same_partition
        if args.pfllib_split == "protofl":
            train, test = p_train, p_test
            sizes["pfllib_train"], sizes["pfllib_test"] = sizes["protofl_train"], sizes["protofl_test"]
            statistic = [[(int(c), int(n)) for c, n in zip(*np.unique(LABELS[np.concatenate([a, b])],
                                                                        return_counts=True))]
                         for a, b in zip(train, test)]

    root = out / "dataset" / "Cifar10"
    for sub in ("train", "test"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    jobs = [(str(root / "train" / f"{i}.npz"), t) for i, t in enumerate(train)]
    jobs += [(str(root / "test" / f"{i}.npz"), t) for i, t in enumerate(test)]
    jobs.sort(key=lambda job: -len(job[1]))  # the largest first
    with ProcessPoolExecutor(max(1, args.workers), mp_context=get_context("fork")) as pool:
        list(pool.map(write_client_file, *zip(*jobs), [not args.uncompressed] * len(jobs)))
    write_config(root, args.clients, statistic, args.alpha, du.batch_size)
    (out / "sizes.json").write_text(json.dumps(sizes | {"split": args.pfllib_split, "seed": args.seed}))

    print(f"{args.samples} images, {args.clients} clients, alpha {args.alpha}, seed {args.seed}: "
          f"protofl files {out / 'cifar'}, PFLlib files {root} ({args.pfllib_split}'s client split), "
          f"{time.perf_counter() - started:.1f} s")
    print("client | PFLlib train | PFLlib test" + (" | protofl train | protofl test | same partition"
                                                   if "protofl_train" in sizes else ""))
    for i in range(args.clients):
        row = f"{i} | {sizes['pfllib_train'][i]} | {sizes['pfllib_test'][i]}"
        if "protofl_train" in sizes:
            row += f" | {sizes['protofl_train'][i]} | {sizes['protofl_test'][i]} | {sizes['same_partition'][i]}"
        print(row)
    total = f"all | {sum(sizes['pfllib_train'])} | {sum(sizes['pfllib_test'])}"
    if "protofl_train" in sizes:
        diff = np.array(sizes["protofl_train"]) - np.array(sizes["pfllib_train"])
        total += (f" | {sum(sizes['protofl_train'])} | {sum(sizes['protofl_test'])} | "
                  f"{sum(sizes['same_partition'])}/{args.clients}")
        print(total)
        print(f"training sizes protofl - PFLlib per client: min {diff.min()}, max {diff.max()}, "
              f"sum {diff.sum()}; batches of 64 (drop last) per round: PFLlib "
              f"{sum(n // 64 for n in sizes['pfllib_train'])}, protofl {sum(n // 64 for n in sizes['protofl_train'])}; "
              f"of 10: {sum(n // 10 for n in sizes['pfllib_train'])}, {sum(n // 10 for n in sizes['protofl_train'])}")
        if not all(sizes["same_partition"]):
            print("WARNING: protofl's dirichlet-pfllib partition differs from PFLlib's for some clients")
    else:
        print(total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
