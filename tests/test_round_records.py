"""Refactorings change no number: every method with each of its own switches, a family's switches
on the family's template method, and the template's server-side switches give the round records
that tests/fixtures/round_records.json holds, traffic and dropped replies included, on the Message
API, the default Flower front; and on the legacy front, a method of each family, the methods whose
uploads and state differ most, and the switches that change which messages go out
(tests/round_records.py says how the fixture was made and how to remake it)."""

import json
import math

import pytest
from inprocess import TEMPLATE_METHODS
from round_records import FIXTURE, cases, round_records

pytestmark = pytest.mark.slow

EXPECTED = json.loads(FIXTURE.read_text())
CASES = cases()
# The fronts are a template: each case's numbers are the method's, whichever front carries them (every
# case gave identical records on both when the Message front landed). The legacy front runs the plain
# case of a method of each family (TEMPLATE_METHODS), of those whose server state, uploads or
# broadcasts differ most (FedAMP's models, FedGen's generator, FedPAC's head weights, Ditto's personal
# model, FedSA's anchors, FedCoSR's body, FedKD's factors), and the switches that change the messages.
LEGACY_CASES = (*TEMPLATE_METHODS, "fedamp", "fedgen", "fedpac", "ditto", "fedsa", "fedcosr", "fedkd",
                "evaluation-message=evaluate", "fraction-fit=0.5,evaluate-clients=all")


# The runs are float64 (tests/round_records.py), what protofl sends on the wire float32, rounded
# from the same float64 values on every CPU. What differs from one CPU's kernels to another's is
# float64 reordering (u = 1.1e-16), grown through three rounds of training: float32 records (u =
# 6e-8) differed across CPUs by up to 5 % in three rounds, 2^29 times that is 1e-10; the diverging
# runs (losses of 1e3-1e5) grow it most. Floats are compared to REL_TOL (ABS_TOL near zero), 100
# times the largest difference seen between this fixture and the same runs with AVX2's and with
# SSE4.1/ATen-default kernels (7.8e-8, a diverging FedSA run's loss; 1e-12 or less elsewhere), and
# everything else (counts, accuracies, traffic, the sampled clients, what was dropped) exactly.
REL_TOL, ABS_TOL = 1e-6, 1e-9


def differences(got, want, path="", *, rel_tol=REL_TOL, abs_tol=ABS_TOL):
    """Where two records differ: floats to ``rel_tol`` or ``abs_tol``, everything else (counts,
    traffic, the sampled clients, what was dropped) exactly."""
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return [] if math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol) else [f"{path}: {got!r} != {want!r}"]
    if isinstance(want, dict) and isinstance(got, dict):
        return [d for k in sorted(set(got) | set(want))
                for d in differences(got.get(k), want.get(k), f"{path}.{k}", rel_tol=rel_tol, abs_tol=abs_tol)]
    if isinstance(want, list) and isinstance(got, list) and len(got) == len(want):
        return [d for i, (a, b) in enumerate(zip(got, want))
                for d in differences(a, b, f"{path}[{i}]", rel_tol=rel_tol, abs_tol=abs_tol)]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def test_the_fixture_covers_every_case_and_the_comparison_sees_a_change():
    assert set(LEGACY_CASES) <= set(CASES)
    missing = sorted(set(CASES) - set(EXPECTED["cases"]))
    assert not missing, f"no round records for {missing}: record them with python tests/round_records.py --missing"
    assert sorted(EXPECTED["cases"]) == sorted(CASES)
    record = EXPECTED["cases"]["fedproto"][0]
    assert differences(record, record) == []
    assert differences(record | {"bytes_up": record["bytes_up"] + 1}, record) == [
        f".bytes_up: {record['bytes_up'] + 1} != {record['bytes_up']}"]
    nudged = record | {"train_loss": record["train_loss"] * (1 + 1e-5)}
    assert differences(nudged, record) == [f".train_loss: {nudged['train_loss']!r} != {record['train_loss']!r}"]
    assert differences(record | {"train_loss": record["train_loss"] * (1 + 1e-7)}, record) == []
    assert differences(nudged, record, rel_tol=1e-4) == []
    assert len(differences(record | {"clients": [0, 1]}, record)) == 1


@pytest.mark.parametrize("name, front", [(name, "message") for name in sorted(CASES)]
                         + [(name, "legacy") for name in LEGACY_CASES])
def test_three_rounds_give_the_recorded_round_records(name, front, tmp_path):
    """The recorded records from the Message API, and from Flower's legacy front for LEGACY_CASES
    (only clocks may differ)."""
    if name not in EXPECTED["cases"]:
        pytest.fail(f"{name}: no round records yet; record them with python tests/round_records.py --missing")
    found = differences(round_records(CASES[name] | {"flower-api": front}, tmp_path), EXPECTED["cases"][name])
    assert found == [], (
        f"{name} on the {front} front: the round records changed ({len(found)} fields, floats to {REL_TOL} or "
        f"{ABS_TOL}): {found[:5]}; if the change is meant, remake them: python tests/round_records.py"
    )
