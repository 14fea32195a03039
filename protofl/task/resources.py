"""The resources of a ClientApp in Flower's Ray simulation (no Flower; Ray only when it runs us): the
GPU share that packs N ClientApps onto each GPU, and the CPUs an actor was given.

    flwr run . --federation-config "num-supernodes=100 client-resources-num-cpus=1 \
        client-resources-num-gpus=$(python -m protofl.task.resources 10)"

Two counts decide how many ClientApps share a GPU, and both must come out N:

- Flower's actor pool (flwr 1.41 and 1.42, ``simulation/ray_transport/ray_actor.py``,
  ``pool_size_from_resources``): ``int(gpus / share)`` actors per node (and at most
  ``int(cpus / num_cpus)``);
- Ray's scheduler (2.55, ``src/ray/common/scheduling/fixed_point.h``): a share is counted in units
  of 1e-4, truncated (``(int64_t)(share * 10000)``), so ``10000 // units`` actors fit on one GPU.

``flwr run --federation-config`` carries the share in the ``SimulationConfig`` protobuf, whose
``client_resources_num_gpus`` is a 32-bit float (``flwr/proto/federation_config.proto``): 0.1
arrives as 0.10000000149..., and ``int(1 / 0.10000000149) = 9``: a pool of 9 actors, not 10.
:func:`gpu_share` checks a share both as written (``run_simulation``'s dict) and as that float.
"""

from __future__ import annotations

import struct
import sys

RAY_UNITS = 10_000  # Ray's fixed point: a resource quantity in units of 1e-4, truncated


def as_float32(share: float) -> float:
    """``share`` after a round trip through a protobuf ``float`` (what the Ray backend reads)."""
    return struct.unpack("f", struct.pack("f", share))[0]


def flower_actors_per_gpu(share: float) -> int:
    """ClientApp actors Flower's pool puts on one GPU (``int(num_gpus / share)``)."""
    return int(1.0 / share)


def ray_actors_per_gpu(share: float) -> int:
    """Actors of ``num_gpus=share`` that Ray schedules on one GPU (0 below Ray's 1e-4 unit)."""
    units = int(share * RAY_UNITS)
    return RAY_UNITS // units if units else 0


def gpu_share(actors_per_gpu: int) -> float:
    """The largest share with 4 decimals that gives exactly ``actors_per_gpu`` actors per GPU under
    Flower's pool size and Ray's scheduler, passed as a Python float or as a protobuf float."""
    if not 1 <= actors_per_gpu <= RAY_UNITS:
        raise ValueError(f"actors per GPU must be in [1, {RAY_UNITS}], got {actors_per_gpu}")
    for units in range(RAY_UNITS // actors_per_gpu, 0, -1):
        share = units / RAY_UNITS
        counts = {f(s) for f in (flower_actors_per_gpu, ray_actors_per_gpu) for s in (share, as_float32(share))}
        if counts == {actors_per_gpu}:
            return share
    raise ValueError(f"no share of 4 decimals gives {actors_per_gpu} actors per GPU")


def ray_cpus() -> int | None:
    """The CPUs Ray gave this process's actor (Flower's ``client-resources-num-cpus``), or None
    outside a Ray worker. Ray imported by someone else only: this never starts or imports Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    return max(1, int(cpus)) if cpus else None


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m protofl.task.resources ACTORS_PER_GPU", file=sys.stderr)
        return 2
    print(gpu_share(int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
