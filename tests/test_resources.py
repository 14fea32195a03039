"""The GPU share that packs N ClientApps per GPU: Flower's pool size and Ray's scheduler agree on N."""

import subprocess
import sys
import time

import pytest

from protofl.task.resources import as_float32, flower_actors_per_gpu, gpu_share, ray_actors_per_gpu


def test_a_protobuf_float_turns_a_share_of_a_tenth_into_nine_flower_actors():
    assert as_float32(0.1) == 0.10000000149011612 and as_float32(0.25) == 0.25
    assert (flower_actors_per_gpu(0.1), ray_actors_per_gpu(0.1)) == (10, 10)  # as written
    assert (flower_actors_per_gpu(as_float32(0.1)), ray_actors_per_gpu(as_float32(0.1))) == (9, 10)  # as sent
    assert flower_actors_per_gpu(as_float32(0.2)) == 4 and flower_actors_per_gpu(as_float32(0.09)) == 11
    assert ray_actors_per_gpu(0.3333) == 3 and ray_actors_per_gpu(as_float32(0.3333)) == 3  # 3332 units: 3
    assert ray_actors_per_gpu(0.00005) == 0  # below Ray's unit of 1e-4


def test_gpu_share_is_the_largest_four_decimal_share_that_gives_n_actors():
    # hand-checked: floor(10^4 / N) / 10^4, except where its float32 gives one actor less in flwr
    # (0.2 -> 0.200000003 -> int(4.99999) = 4; 0.1 -> int(9.99999) = 9)
    expected = {1: 1.0, 2: 0.5, 3: 0.3333, 4: 0.25, 5: 0.1999, 6: 0.1666, 7: 0.1428, 8: 0.125, 9: 0.1111,
                10: 0.0999, 11: 0.0909, 12: 0.0833, 16: 0.0625}
    assert {n: gpu_share(n) for n in expected} == expected
    for n in range(1, 65):
        share = gpu_share(n)
        for sent in (share, as_float32(share)):
            assert flower_actors_per_gpu(sent) == ray_actors_per_gpu(sent) == n
        larger = round(share + 0.0001, 4)  # the largest: one step up, some count is not n
        assert any(f(s) != n for f in (flower_actors_per_gpu, ray_actors_per_gpu) for s in (larger, as_float32(larger)))
    with pytest.raises(ValueError, match="actors per GPU"):
        gpu_share(0)


def test_the_module_prints_the_share():
    run = subprocess.run([sys.executable, "-m", "protofl.task.resources", "10"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and run.stdout == "0.0999\n"


@pytest.mark.slow
def test_ray_schedules_n_actors_of_the_share_on_one_gpu_and_not_one_more():
    ray = pytest.importorskip("ray")

    @ray.remote
    class Actor:
        def ready(self) -> bool:
            return True

    ray.init(num_cpus=16, num_gpus=1, include_dashboard=False, log_to_driver=False)  # a pretend GPU
    try:
        for n in (3, 7, 10):
            share = as_float32(gpu_share(n))  # what `flwr run --federation-config` hands to Ray
            actors = [Actor.options(num_cpus=1, num_gpus=share).remote() for _ in range(n + 1)]
            ready, pending = ray.wait([a.ready.remote() for a in actors], num_returns=n, timeout=40)
            assert len(ready) == n
            assert ray.available_resources().get("GPU", 0.0) < share  # no room left for the last one
            assert ray.wait(pending, timeout=1)[0] == []
            for actor in actors:
                ray.kill(actor)
            deadline = time.monotonic() + 20
            while ray.available_resources().get("GPU", 0.0) < 1.0 and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        ray.shutdown()
