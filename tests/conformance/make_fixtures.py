"""Write the conformance fixtures of one method by running the authors' code (not at test time).

    python tests/conformance/make_fixtures.py <method> --checkout [NAME=]DIR [--checkout ...]

``<method>`` names a module ``tests/conformance/<method>.py`` that defines

- ``SNAPSHOTS``: ``{name: Snapshot(repository, commit)}``, the authors' code the fixtures come from;
- ``make(checkouts: dict[str, Path], rerun: str) -> list[Path]``: imports their code from the
  checkouts, calls it on seeded inputs and saves the fixtures (``common.save_fixture``).

Each checkout is a directory holding the files of ``repository`` at ``commit`` (outside this
tree), e.g. ``git --git-dir=<mirror> archive <commit> | tar -x -C /tmp/ref/<repo>``; with one
snapshot, ``NAME=`` may be left out. When the directory is a git work tree, its HEAD must be the
recorded commit. Their dependencies must import in this venv (the modules stub what they need
that we do not have, e.g. mmcv's norm-layer builder). A different commit: change ``SNAPSHOTS``
and run again; the fixtures record repository, commit, the call and this command.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, so that `conformance` imports


def _head(directory: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(directory), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method")
    parser.add_argument("--checkout", action="append", required=True, metavar="[NAME=]DIR")
    args = parser.parse_args(argv)
    module = importlib.import_module(f"conformance.{args.method}")
    snapshots = module.SNAPSHOTS
    checkouts: dict[str, Path] = {}
    for given in args.checkout:
        name, _, directory = given.rpartition("=")
        if not name:
            if len(snapshots) != 1:
                parser.error(f"{args.method} has snapshots {sorted(snapshots)}: give NAME=DIR")
            name = next(iter(snapshots))
        if name not in snapshots:
            parser.error(f"unknown snapshot {name!r}; {args.method} has {sorted(snapshots)}")
        checkouts[name] = Path(directory).resolve()
    missing = set(snapshots) - set(checkouts)
    if missing:
        parser.error(f"no checkout given for {sorted(missing)}")
    for name, directory in checkouts.items():
        head = _head(directory)
        if head is not None and head != snapshots[name].commit:
            parser.error(f"{directory} is at {head}, the fixtures record {snapshots[name].commit}")
    rerun = f"python tests/conformance/make_fixtures.py {args.method} " + " ".join(
        f"--checkout {name}=<{s.repository} at {s.commit}>" for name, s in snapshots.items()
    )
    torch.set_default_dtype(torch.float64)  # their code computes in float64: the math, not a CPU's rounding
    for path in module.make(checkouts, rerun):
        print(path)


if __name__ == "__main__":
    main()
