"""Refactorings change no number: every method with each of its switches, and the template's
server-side switches, give the round records that tests/fixtures/round_records.json holds, traffic
and dropped replies included (tests/round_records.py says how it was made and how to remake it)."""

import json
import math

import pytest
from round_records import FIXTURE, cases, machine, round_records

pytestmark = pytest.mark.slow

EXPECTED = json.loads(FIXTURE.read_text())
CASES = cases()


# on the machine that made the fixture, floats agree to a float32 rounding (equal bits); on another
# CPU generation a few cases (FedNH's scale-30 cosine head, FedSKC) amplify the last bits of a GEMM
# over three rounds by up to ~2 %: there, floats are checked loosely and everything else exactly
SAME_MACHINE = EXPECTED["machine"] == machine()
REL_TOL = 1e-6 if SAME_MACHINE else 0.05


def differences(got, want, path="", rel_tol=1e-6):
    """Where two records differ: floats to ``rel_tol``, everything else (counts, traffic, the
    sampled clients, what was dropped) exactly."""
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return [] if math.isclose(got, want, rel_tol=rel_tol, abs_tol=1e-9) else [f"{path}: {got!r} != {want!r}"]
    if isinstance(want, dict) and isinstance(got, dict):
        return [d for k in sorted(set(got) | set(want))
                for d in differences(got.get(k), want.get(k), f"{path}.{k}", rel_tol)]
    if isinstance(want, list) and isinstance(got, list) and len(got) == len(want):
        return [d for i, (a, b) in enumerate(zip(got, want)) for d in differences(a, b, f"{path}[{i}]", rel_tol)]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def test_the_fixture_covers_every_case_and_the_comparison_sees_a_change():
    assert sorted(EXPECTED["cases"]) == sorted(CASES)
    record = EXPECTED["cases"]["fedproto"][0]
    assert differences(record, record) == []
    assert differences(record | {"bytes_up": record["bytes_up"] + 1}, record) == [
        f".bytes_up: {record['bytes_up'] + 1} != {record['bytes_up']}"]
    nudged = record | {"train_loss": record["train_loss"] * (1 + 1e-5)}
    assert len(differences(nudged, record)) == 1 and differences(nudged, record, rel_tol=0.05) == []
    assert len(differences(record | {"clients": [0, 1]}, record, rel_tol=0.05)) == 1


@pytest.mark.parametrize("name", sorted(CASES))
def test_three_rounds_give_the_recorded_round_records(name, tmp_path):
    found = differences(round_records(CASES[name], tmp_path), EXPECTED["cases"][name], rel_tol=REL_TOL)
    assert found == [], (
        f"{name}: the round records changed ({len(found)} fields, floats to {REL_TOL}). The fixture was made on "
        f"{EXPECTED['machine']}, this is {machine()}; if the change is meant, remake it: python tests/round_records.py"
    )
