"""Loaders on small files written in the real on-disk formats."""

import gzip
import os
import pickle
import struct
import subprocess
import sys
import time
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
from fakes import write_cifar
from PIL import Image

from protofl.task import data
from protofl.task.partition import PartitionSpec

RNG = np.random.default_rng(0)


def write_idx(path, array, compress):
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(">" + "I" * array.ndim, *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    opener = gzip.open if compress else open
    with opener(str(path) + (".gz" if compress else ""), "wb") as handle:
        handle.write(payload)


@pytest.mark.parametrize("compress", [True, False])
def test_fmnist_idx_directory(tmp_path, compress):
    images = {p: RNG.integers(0, 256, (n, 28, 28)) for p, n in (("train", 50), ("t10k", 20))}
    labels = {p: RNG.integers(0, 10, len(images[p])) for p in images}
    for prefix in images:
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", images[prefix], compress)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", labels[prefix], compress)
    dataset = data.load_dataset("fmnist", str(tmp_path))
    assert dataset.train.images.shape == (50, 1, 28, 28) and dataset.test.images.shape == (20, 1, 28, 28)
    np.testing.assert_array_equal(dataset.train.labels, labels["train"])
    # pixel 0 -> -1, pixel 255 -> +1
    expected = images["t10k"][3, 5, 7] / 255.0 * 2 - 1
    assert dataset.test.images[3, 0, 5, 7] == pytest.approx(expected, abs=1e-6)


def test_idx_with_wrong_length_is_refused(tmp_path):
    path = tmp_path / "bad-idx"
    path.write_bytes(bytes([0, 0, 0x08, 1]) + struct.pack(">I", 10) + b"\x00" * 9)
    with pytest.raises(ValueError, match="header says"):
        data.read_idx(path)


def test_cifar10_torchvision_layout(tmp_path):
    batches = write_cifar(tmp_path, 10, [6, 6, 6, 6, 6], 5)
    dataset = data.load_dataset("cifar10", str(tmp_path))
    assert dataset.num_classes == 10 and dataset.train.images.shape == (30, 3, 32, 32)
    assert dataset.test.labels.tolist() == batches["test_batch"]["labels"]
    # channel-major rows: first 1024 bytes are the red plane
    red = batches["data_batch_1"]["data"][0, :1024].reshape(32, 32)
    np.testing.assert_allclose(dataset.train.images[0, 0], red / 255.0 * 2 - 1, atol=1e-6)


def test_cifar100_torchvision_layout(tmp_path):
    batches = write_cifar(tmp_path, 100, [12], 4)
    dataset = data.load_dataset("cifar100", str(tmp_path))
    assert dataset.num_classes == 100 and dataset.train.images.shape == (12, 3, 32, 32)
    assert dataset.train.labels.tolist() == batches["train"]["fine_labels"]


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_cifar_file_with_foreign_objects_is_refused(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name in ("train", "test"):
        with open(folder / name, "wb") as handle:
            pickle.dump({"data": _Payload(), "fine_labels": [0]}, handle, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        data.load_dataset("cifar100", str(tmp_path))


def test_missing_cifar_files_are_named(tmp_path):
    (tmp_path / "cifar-10-batches-py").mkdir()
    with pytest.raises(FileNotFoundError, match="data_batch_1"):
        data.load_dataset("cifar10", str(tmp_path))


def test_hub_records_convert_to_arrays():
    images = RNG.integers(0, 256, (3, 32, 32, 3)).astype(np.uint8)
    split = datasets.Dataset.from_dict({"img": [Image.fromarray(i) for i in images], "label": [4, 0, 9]})
    arrays = data.arrays_from_hf(split, "img", "label")
    assert arrays.images.shape == (3, 3, 32, 32) and arrays.labels.tolist() == [4, 0, 9]
    np.testing.assert_allclose(arrays.images[1, 2], images[1, :, :, 2] / 255.0 * 2 - 1, atol=1e-6)


def test_digits_is_embedded_and_split_once():
    dataset = data.load_dataset("digits")
    assert dataset.train.images.shape[1:] == (1, 16, 16)
    assert len(dataset.train) + len(dataset.test) == 1797
    assert np.bincount(dataset.test.labels).min() >= 30  # stratified 20 % of every digit


@pytest.mark.slow
def test_digits_are_scikit_learns_read_without_importing_it():
    """The pixels and labels of ``sklearn.datasets.load_digits``, from its file (a fresh process:
    importing scikit-learn costs seconds, and nothing of it is imported)."""
    code = ("import sys; from protofl.task.data.digits import digits_pixels; images, labels = digits_pixels(); "
            "assert 'sklearn' not in sys.modules, 'sklearn imported'; "
            "from sklearn.datasets import load_digits; bunch = load_digits(); "
            "assert images.dtype == bunch.images.dtype and (images == bunch.images).all(); "
            "assert labels.dtype == 'int64' and (labels == bunch.target).all()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_unknown_dataset_and_missing_dir_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="dataset must be one of"):
        data.load_dataset("mnist3d")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_dataset("cifar10", str(tmp_path / "nope"))


def test_client_data_is_cached_and_partitions_do_not_overlap():
    spec = PartitionSpec("dirichlet", 4, alpha=0.5, seed=0)
    first = data.load_client_data("digits", "", spec, 0)
    assert data.load_client_data("digits", "", spec, 0) is first
    sizes = [data.load_client_data("digits", "", spec, p) for p in range(4)]
    assert sum(c.num_train + c.num_test for c in sizes) == len(data.load_dataset("digits").train)
    assert first.class_counts().sum() == first.num_train
    with pytest.raises(ValueError, match="partition-id"):
        data.load_client_data("digits", "", spec, 4)


def test_global_test_subset_is_the_first_images_of_each_class():
    full_x, full_y = data.load_global_test("digits", "")
    x, y = data.load_global_test("digits", "", "cpu", 5)
    assert np.bincount(y.numpy()).tolist() == [5] * 10
    for c in range(10):
        np.testing.assert_array_equal(x[y == c].numpy(), full_x[full_y == c][:5].numpy())


def test_node_uses_its_own_local_data_whole(tmp_path):
    from protofl.client_app import node_data
    from protofl.settings import ExperimentSettings

    images, labels = RNG.integers(0, 256, (40, 28, 28)), np.repeat(np.arange(4), 10)
    write_idx(tmp_path / "train-images-idx3-ubyte", images, compress=True)  # no t10k files: a node's own data
    write_idx(tmp_path / "train-labels-idx1-ubyte", labels, compress=True)
    config = ExperimentSettings.from_run_config({"dataset": "fmnist", "test-fraction": 0.2})
    node = {"partition-id": 3, "num-partitions": 5, "local-data-dir": str(tmp_path)}
    client = node_data(config, node, "cpu")
    assert client.partition_id == 3 and client.num_train == 32 and client.num_test == 8  # all 40, 20 % per class
    assert client.class_counts().tolist() == [8, 8, 8, 8, 0, 0, 0, 0, 0, 0]
    pixels = sorted(client.train_x.sum(dim=(1, 2, 3)).tolist() + client.test_x.sum(dim=(1, 2, 3)).tolist())
    expected = sorted(((images / 255.0 * 2 - 1).astype(np.float32).sum(axis=(1, 2))).tolist())
    np.testing.assert_allclose(pixels, expected, rtol=1e-4)  # every image once, none from elsewhere


def test_node_local_cifar_data_may_hold_some_training_batches(tmp_path):
    write_cifar(tmp_path, 10, [40], 3)  # data_batch_1 only
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    spec = PartitionSpec("iid", 1, test_fraction=0.5)
    client = data.load_local_client_data("cifar10", str(tmp_path), spec, 0)
    assert client.num_train + client.num_test == 40 and client.in_channels == 3 and client.image_size == 32
    with pytest.raises(ValueError, match="local-data-dir works with"):
        data.load_local_client_data("digits", str(tmp_path), spec, 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="data_batch_1"):
        data.load_local_client_data("cifar10", str(tmp_path / "empty"), spec, 0)


def test_node_config_data_dir_replaces_the_run_configs(tmp_path):
    from protofl.client_app import node_data
    from protofl.settings import ExperimentSettings

    for prefix, n in (("train", 60), ("t10k", 10)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", RNG.integers(0, 256, (n, 28, 28)), compress=False)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10, compress=False)
    config = ExperimentSettings.from_run_config({"dataset": "fmnist", "data-dir": str(tmp_path / "server-path"),
                                               "partition": "iid"})
    client = node_data(config, {"partition-id": 1, "num-partitions": 2, "data-dir": str(tmp_path)}, "cpu")
    assert client.num_train + client.num_test == 30  # half of this node's 60 training images
    with pytest.raises(FileNotFoundError, match="server-path"):
        node_data(config, {"partition-id": 1, "num-partitions": 2}, "cpu")
    with pytest.raises(ValueError, match="lacks num-partitions"):
        node_data(config, {"partition-id": 1}, "cpu")


def test_global_test_pm_reads_the_nodes_data_dir_not_the_servers(tmp_path, monkeypatch):
    from flwr.common import Context, RecordDict

    import protofl.federation.scoring as scoring
    from protofl.client_app import make_client_fn

    # the node's global test set: 20 images whose labels run 9, 8, ..., 0, 9, ... (no other copy of
    # Fashion-MNIST, Debian's 10000 test images included, has them)
    node_test_labels = 9 - np.arange(20) % 10
    for prefix, labels in (("train", np.arange(60) % 10), ("t10k", node_test_labels)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", RNG.integers(0, 256, (len(labels), 28, 28)),
                  compress=False)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", labels, compress=False)
    read = []

    def load_global_test(*args, **kwargs):  # what the scoring got, from wherever it read it
        x, y = real_load_global_test(*args, **kwargs)
        read.append(y.cpu().numpy())
        return x, y

    real_load_global_test = scoring.load_global_test
    monkeypatch.setattr(scoring, "load_global_test", load_global_test)
    run_config = {"dataset": "fmnist", "data-dir": str(tmp_path / "server-path"), "partition": "iid",
                  "global-test-pm": True}
    node_config = {"partition-id": 0, "num-partitions": 2, "data-dir": str(tmp_path)}
    context = Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config=run_config)
    client = make_client_fn()(context).numpy_client.client
    parameters = [v.cpu().numpy() for v in client.model.state_dict().values()]
    _, _, metrics = client.evaluate(parameters, {"server-round": 1})
    assert 0.0 <= metrics["pm-l"] <= 1.0 and 0.0 <= metrics["pm-v"] <= 1.0
    assert len(read) == 1 and np.array_equal(read[0], node_test_labels)  # scored on the node's 20 images


def test_node_cache_serves_the_same_data_and_notices_changed_files(tmp_path, monkeypatch):
    from protofl.client_app import node_data
    from protofl.settings import ExperimentSettings

    def write_train(n):
        write_idx(tmp_path / "own" / "train-images-idx3-ubyte", RNG.integers(0, 256, (n, 28, 28)), compress=False)
        write_idx(tmp_path / "own" / "train-labels-idx1-ubyte", np.arange(n) % 4, compress=False)

    (tmp_path / "own").mkdir()
    write_train(40)
    config = ExperimentSettings.from_run_config({"dataset": "fmnist"})
    node = {"partition-id": 2, "num-partitions": 3, "local-data-dir": str(tmp_path / "own"),
            "cache-dir": str(tmp_path / "cache")}
    first = node_data(config, node, "cpu")
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1

    def no_loading(*args):
        raise AssertionError("loaded the data again instead of using the cache")

    monkeypatch.setattr("protofl.client_app.load_local_client_data", no_loading)
    again = node_data(config, node, "cpu")
    assert again is not first and again.partition_id == 2 and again.num_classes == 10
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch_equal(getattr(again, name), getattr(first, name)), name

    monkeypatch.undo()
    data.load_local_client_data.cache_clear()
    write_train(48)  # the node's data changed: a new entry
    assert node_data(config, node, "cpu").num_train + node_data(config, node, "cpu").num_test == 48
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2


def torch_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


@pytest.fixture
def cached_node(tmp_path, monkeypatch):
    """A digits node with a cache: ``get()`` is its data, ``loads`` counts the loads, ``path()``
    is its cache file; the first load has written it."""
    from protofl.client_app import node_data
    from protofl.settings import ExperimentSettings

    loads = []

    def counting(*args):
        data.load_client_data.cache_clear()  # a load, not the process's in-memory copy
        loads.append(args)
        return data.load_client_data(*args)

    monkeypatch.setattr("protofl.client_app.load_client_data", counting)
    config = ExperimentSettings.from_run_config({"dataset": "digits", "partition": "iid"})
    node = {"partition-id": 1, "num-partitions": 3, "cache-dir": str(tmp_path / "cache")}

    def path():
        (file,) = (tmp_path / "cache").glob("client-data-*.npz")
        return file

    fresh = node_data(config, node, "cpu")
    assert len(loads) == 1
    return SimpleNamespace(fresh=fresh, loads=loads, path=path, get=lambda: node_data(config, node, "cpu"))


def test_node_cache_is_private_to_its_user(tmp_path):
    from protofl.client_app import node_data
    from protofl.settings import ExperimentSettings

    config = ExperimentSettings.from_run_config({"dataset": "digits", "partition": "iid"})
    previous = os.umask(0)  # whatever the node's umask, the training data is not shared
    try:
        node_data(config, {"partition-id": 0, "num-partitions": 3, "cache-dir": str(tmp_path / "a" / "b")}, "cpu")
    finally:
        os.umask(previous)
    (file,) = (tmp_path / "a" / "b").glob("client-data-*.npz")
    assert os.stat(tmp_path / "a" / "b").st_mode & 0o777 == 0o700 and os.stat(file).st_mode & 0o777 == 0o600


def _rewrite(path, change):
    with np.load(path, allow_pickle=False) as stored:
        arrays = {name: stored[name] for name in stored.files}
    change(arrays)
    with open(path, "wb") as handle:  # np.savez, not through the cache's own writer
        np.savez(handle, **arrays)


def _set(name, value):
    return lambda arrays: arrays.__setitem__(name, value(arrays[name]))


def _poke(name, index, value):
    def change(arrays):
        arrays[name] = arrays[name].copy()
        arrays[name][index] = value
    return change


CORRUPTIONS = {
    "images-float64": _set("train_x", lambda x: x.astype(np.float64)),
    "labels-int32": _set("train_y", lambda y: y.astype(np.int32)),
    "labels-float": _set("test_y", lambda y: y.astype(np.float32)),
    "images-3d": _set("train_x", lambda x: x[:, 0]),
    "labels-2d": _set("train_y", lambda y: y[:, None]),
    "lengths-differ": _set("train_y", lambda y: y[:-1]),
    "test-shape-differs": _set("test_x", lambda x: np.ascontiguousarray(x[:, :, :8, :8])),
    "label-too-large": _poke("train_y", 0, 10),
    "label-negative": _poke("test_y", 0, -1),
    "nan": _poke("train_x", (0, 0, 0, 0), np.nan),
    "inf": _poke("test_x", (0, 0, 1, 1), -np.inf),
    "partition-id": _set("partition_id", lambda p: np.asarray(0)),
    "num-classes": _set("num_classes", lambda c: np.asarray(47)),
    "partition-id-not-a-scalar": _set("partition_id", lambda p: np.asarray([1])),
    "missing-array": lambda arrays: arrays.pop("test_y"),
    "extra-array": lambda arrays: arrays.__setitem__("extra", np.zeros(3)),
    "pickled-object-array": _set("train_y", lambda y: np.array(list(y), dtype=object)),
}


def _save_npy(path, array):
    with open(path, "wb") as handle:  # np.save(path) would add ".npy" to the name
        np.save(handle, array)


BROKEN_FILES = {
    "truncated": lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
    "garbage": lambda path: path.write_bytes(RNG.integers(0, 256, 4096, dtype=np.uint8).tobytes()),
    "empty": lambda path: path.write_bytes(b""),
    "zip-of-junk": lambda path: path.write_bytes(b"PK\x03\x04" + b"\0" * 100),
    "npy-not-npz": lambda path: _save_npy(path, np.zeros(3)),
    "pickle": lambda path: path.write_bytes(pickle.dumps({"train_x": np.zeros(3)})),
}


@pytest.mark.parametrize("damage", [*CORRUPTIONS, *BROKEN_FILES])
def test_node_cache_rejects_a_bad_file_and_loads_the_data_again(cached_node, damage, caplog):
    path = cached_node.path()
    if damage in CORRUPTIONS:
        _rewrite(path, CORRUPTIONS[damage])
    else:
        BROKEN_FILES[damage](path)
    again = cached_node.get()  # never an exception, never the file's data
    assert len(cached_node.loads) == 2, "the bad file was used instead of loading the data again"
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch_equal(getattr(again, name), getattr(cached_node.fresh, name)), name
    assert (again.partition_id, again.num_classes) == (1, 10)
    assert "node cache" in caplog.text and str(path.name) in caplog.text
    cached_node.get()  # written again, and good: no third load
    assert len(cached_node.loads) == 2


def test_node_cache_removes_only_its_own_stale_partial_writes(tmp_path, cached_node):
    cache = tmp_path / "cache"
    cached_node.path().unlink()  # a miss: the next call writes
    hour_ago = time.time() - 3700
    stale = cache / ".client-data-0123456789abcdef01234567.npz.k3j_x9q2.tmp"  # atomic_write's name, after kill -9
    fresh = cache / ".client-data-0123456789abcdef01234567.npz.a8b7c6d5.tmp"  # maybe another process's, now
    others = [cache / ".results.json.k3j_x9q2.tmp", cache / "notes.tmp", cache / "client-data-x.npz.tmp"]
    for path in [stale, fresh, *others]:
        path.write_bytes(b"partial")
    for path in [stale, *others]:
        os.utime(path, (hour_ago, hour_ago))
    cached_node.get()
    assert not stale.exists() and fresh.exists() and all(path.exists() for path in others)


@pytest.mark.parametrize("layout", ["", "gzip", "EMNIST/raw"])
def test_emnist_balanced_idx_files_in_nist_and_torchvision_layouts(tmp_path, layout):
    folder = tmp_path / layout
    folder.mkdir(parents=True, exist_ok=True)
    images = {p: RNG.integers(0, 256, (n, 28, 28)) for p, n in (("train", 94), ("test", 47))}
    labels = {p: np.arange(len(images[p])) % 47 for p in images}
    for split in images:
        write_idx(folder / f"emnist-balanced-{split}-images-idx3-ubyte", images[split], compress=layout == "gzip")
        write_idx(folder / f"emnist-balanced-{split}-labels-idx1-ubyte", labels[split], compress=layout == "gzip")
    dataset = data.load_dataset("emnist", str(tmp_path))
    assert dataset.num_classes == 47 and dataset.train.images.shape == (94, 1, 28, 28)
    np.testing.assert_array_equal(dataset.test.labels, labels["test"])
    # NIST stores the glyphs transposed: row 5, column 7 of the file is row 7, column 5 upright
    assert dataset.train.images[3, 0, 7, 5] == pytest.approx(images["train"][3, 5, 7] / 255.0 * 2 - 1, abs=1e-6)


def test_emnist_without_files_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="emnist-balanced"):
        data.load_dataset("emnist", str(tmp_path))


def test_dataset_normalisation_uses_the_channel_statistics(tmp_path):
    batches = write_cifar(tmp_path, 10, [6, 6, 6, 6, 6], 5)
    half = data.load_dataset("cifar10", str(tmp_path))
    own = data.load_dataset("cifar10", str(tmp_path), "dataset")
    pixel = batches["data_batch_1"]["data"][0, 1024 + 32 * 3 + 4] / 255.0  # green plane, row 3, column 4
    assert own.train.images[0, 1, 3, 4] == pytest.approx((pixel - 0.4822) / 0.1994, abs=1e-5)
    assert half.train.images[0, 1, 3, 4] == pytest.approx(pixel * 2 - 1, abs=1e-6)
    np.testing.assert_allclose(data.black_level("cifar10", "dataset"), [-0.4914 / 0.2023, -0.4822 / 0.1994,
                                                                        -0.4465 / 0.2010], rtol=1e-6)
    with pytest.raises(ValueError, match="normalisation='dataset'"):
        data.channel_stats("fmnist", "dataset")


def test_merged_pool_and_no_local_test_split(tmp_path):
    write_cifar(tmp_path, 10, [40, 40, 40, 40, 40], 50)
    pooled = PartitionSpec("iid", 5, test_fraction=0.25, pool="train+test")
    assert len(data.training_pool("cifar10", str(tmp_path), pooled)) == 250
    sizes = [data.partition_sizes("cifar10", str(tmp_path), pooled, p) for p in range(5)]
    assert sum(int(s.train_counts.sum()) + s.num_test for s in sizes) == 250
    # test-fraction 0: all of the partition trains, the test split is the global test set (shared tensors)
    whole = PartitionSpec("iid", 5, test_fraction=0.0)
    clients = [data.load_client_data("cifar10", str(tmp_path), whole, p) for p in range(2)]
    assert clients[0].num_train == 40 and clients[0].num_test == 50
    assert clients[0].test_x.data_ptr() == clients[1].test_x.data_ptr()
    assert data.partition_sizes("cifar10", str(tmp_path), whole, 0).num_test == 50


def test_tinyimagenet_folder(tmp_path):
    root = tmp_path / "tiny-imagenet-200"
    wnids = [f"n{i:08d}" for i in range(200)][::-1]  # listed out of order: ids follow the sorted names
    root.mkdir()
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for wnid in wnids[:3]:  # classes 199, 198, 197
        (root / "train" / wnid / "images").mkdir(parents=True)
        for k in range(2):
            Image.new("RGB", (64, 64), (10 * k, 128, 250)).save(root / "train" / wnid / "images" / f"{wnid}_{k}.JPEG")
    (root / "val" / "images").mkdir(parents=True)
    Image.new("RGB", (64, 64), (255, 0, 0)).save(root / "val" / "images" / "val_0.JPEG")
    (root / "val" / "val_annotations.txt").write_text(f"val_0.JPEG\t{wnids[-1]}\t0\t0\t63\t63\n")
    dataset = data.load_dataset("tinyimagenet", str(tmp_path))
    assert dataset.num_classes == 200 and dataset.train.images.shape == (6, 3, 64, 64)
    assert sorted(set(dataset.train.labels.tolist())) == [197, 198, 199] and dataset.test.labels.tolist() == [0]
    assert dataset.test.images[0, 0].mean() == pytest.approx(1.0, abs=0.02)  # red 255 -> +1 (JPEG is lossy)
    (root / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn99999999\t0\t0\t63\t63\n")
    with pytest.raises(ValueError, match="unknown class"):
        data.load_tinyimagenet_dir(tmp_path)
    with pytest.raises(ValueError, match="no hub copy"):
        data.load_dataset("tinyimagenet")
