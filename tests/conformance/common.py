"""What every method's conformance module shares: seeded inputs, the fixture file format, the
record of the snapshot a fixture came from, and the comparison.

A fixture is ``fixtures/<name>.npz`` (``<name>`` = ``<method>-<piece>``), holding

- ``input.<key>``: the arrays fed to the authors' function (and, at test time, to ours);
- ``output.<key>``: what the authors' function returned;
- ``snapshot.repository``, ``snapshot.commit``: the GitHub repository and commit that computed it;
- ``snapshot.call``: which of their functions, in which file, was called (and how it was adapted);
- ``snapshot.rerun``: the command that writes the fixture again.

Only numbers and strings are stored (no pickles): ``np.load(..., allow_pickle=False)`` reads it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"

# The fixtures hold the authors' code computed in float64 (``make_fixtures.py`` sets torch's
# default dtype so), and the conformance tests run protofl so too (tests/conftest.py), so what is
# compared is the math, not a CPU's float32 rounding (whose kernels differ from one instruction
# set to the next). Two float64 evaluations of one formula in another order differ by at most
# n u sum|terms| (u = 2^-53 = 1.1e-16): with n <= 10^4 terms a sum, sums that cancel at most
# 100-fold and a few SGD steps that amplify at most 10-fold, 1e-9 relative. A formula that
# differs shows at 1e-7 or more (a float32 rounding).
FLOAT64 = {"rtol": 1e-9, "atol": 1e-12}
# What protofl rounds to float32 on purpose (the wire's arrays: class means, prototypes, anchors;
# the eval pass's outputs) differs from float64 by at most 2^-24 relative per rounding.
FLOAT32_ROUNDING = 2.0**-24


def float32_roundings(count: int, scale: float = 1.0) -> dict[str, float]:
    """The tolerance of a value that went through ``count`` float32 roundings of protofl's, on
    numbers of magnitude up to ``scale`` (the absolute part, for entries near zero)."""
    rtol = count * FLOAT32_ROUNDING + FLOAT64["rtol"]
    return {"rtol": rtol, "atol": rtol * scale}


@dataclass(frozen=True)
class Snapshot:
    """The authors' code a fixture was computed with."""

    repository: str  # "owner/name" on GitHub
    commit: str  # the 40 hex digits of the checked-out commit


@dataclass(frozen=True)
class Fixture:
    name: str
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    snapshot: Snapshot
    call: str  # which of their functions computed the outputs
    rerun: str  # the command that writes it again


def seeded(seed: int) -> np.random.Generator:
    """The generator every fixture input is drawn from (numpy's PCG64, stable across versions)."""
    return np.random.default_rng(seed)


def pixels(seed: int, n: int, shape: tuple[int, ...] = (1, 28, 28)) -> np.ndarray:
    """n seeded images as uint8 pixels (fixtures store them so); :func:`pixels_to_input` feeds them."""
    return seeded(seed).integers(0, 256, size=(n, *shape), dtype=np.uint8)


def pixels_to_input(values: np.ndarray) -> torch.Tensor:
    """uint8 pixels -> [-1, 1] (the authors' ToTensor + Normalize(0.5, 0.5)) in torch's default dtype."""
    return torch.from_numpy((values.astype(np.float64) / 255.0 - 0.5) / 0.5).to(torch.get_default_dtype())


# PFLlib's FedAvgCNN, which FedProto's and FedSA's code build (base: conv1, conv2, fc1; head = its
# fc) -> ours (protofl.task.models.cnn)
PFLLIB_CNN_NAMES = {
    "base.conv1.0.weight": "body.0.0.weight", "base.conv1.0.bias": "body.0.0.bias",
    "base.conv2.0.weight": "body.0.3.weight", "base.conv2.0.bias": "body.0.3.bias",
    "base.fc1.0.weight": "body.1.weight", "base.fc1.0.bias": "body.1.bias",
    "head.weight": "head.weight", "head.bias": "head.bias",
}


@functools.lru_cache(maxsize=64)
def _directions(size: int, projections: int) -> np.ndarray:
    """The fixed Gaussian directions of arrays of ``size`` entries, drawn once (drawing them is most of
    a fingerprint's time, and a test fingerprints many arrays of a model's few sizes)."""
    directions = np.random.default_rng(size).standard_normal((projections, size))
    directions.flags.writeable = False
    return directions


def fingerprint(array, projections: int = 8) -> np.ndarray:
    """A few numbers that stand for a large array (model weights a fixture cannot hold in full):
    its sum, its L2 norm and its projections onto ``projections`` fixed Gaussian directions
    (seeded by the array's size), in float64. Two arrays that differ by d have projections that
    differ by about |d| each, so comparing fingerprints with a tolerance compares the arrays."""
    flat = np.asarray(array, dtype=np.float64).ravel()
    return np.concatenate([[flat.sum(), np.linalg.norm(flat)], _directions(flat.size, projections) @ flat])


def save_fixture(
    name: str,
    snapshot: Snapshot,
    call: str,
    rerun: str,
    inputs: dict[str, np.ndarray],
    outputs: dict[str, np.ndarray],
    directory: Path = FIXTURES,
) -> Path:
    """Write ``<directory>/<name>.npz``; returns its path."""
    if len(snapshot.commit) != 40:
        raise ValueError(f"record the full commit, got {snapshot.commit!r}")
    arrays = {f"input.{k}": np.asarray(v) for k, v in inputs.items()}
    arrays |= {f"output.{k}": np.asarray(v) for k, v in outputs.items()}
    arrays |= {
        "snapshot.repository": np.str_(snapshot.repository),
        "snapshot.commit": np.str_(snapshot.commit),
        "snapshot.call": np.str_(call),
        "snapshot.rerun": np.str_(rerun),
    }
    if any(a.dtype == object for a in arrays.values()):
        raise TypeError("a fixture holds numbers and strings only")
    computed_in_float32 = sorted(k for k, v in outputs.items() if np.asarray(v).dtype.kind == "f"
                                 and np.asarray(v).dtype != np.float64)
    if computed_in_float32:
        raise TypeError(f"outputs not computed in float64: {computed_in_float32}")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.npz"
    np.savez_compressed(path, **arrays)
    return path


def load_fixture(name: str, directory: Path = FIXTURES) -> Fixture:
    """Read ``<directory>/<name>.npz`` (no pickles)."""
    with np.load(directory / f"{name}.npz", allow_pickle=False) as stored:
        arrays = {key: stored[key] for key in stored.files}

    def part(prefix: str) -> dict[str, np.ndarray]:
        return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}

    return Fixture(
        name=name,
        inputs=part("input."),
        outputs=part("output."),
        snapshot=Snapshot(str(arrays["snapshot.repository"]), str(arrays["snapshot.commit"])),
        call=str(arrays["snapshot.call"]),
        rerun=str(arrays["snapshot.rerun"]),
    )


def assert_matches(actual, expected, what: str, rtol: float = FLOAT64["rtol"],
                   atol: float = FLOAT64["atol"]) -> None:
    """``actual`` (ours) equals ``expected`` (the authors') within the tolerance; the message names
    ``what`` and the largest difference."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, the authors' code {expected.shape}"
    largest = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
    assert np.allclose(actual, expected, rtol=rtol, atol=atol), (
        f"{what}: differs from the authors' code by up to {largest:.3g} (rtol {rtol}, atol {atol})"
    )
