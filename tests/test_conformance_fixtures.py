"""Every conformance fixture holds what the authors' code computed in float64 (the math, not one
CPU's float32 rounding: tests/conformance/common.py) and names the commit that computed it."""

import re

import numpy as np
import pytest
from conformance.common import FIXTURES, load_fixture, save_fixture

pytestmark = pytest.mark.conformance

NAMES = sorted(path.stem for path in FIXTURES.glob("*.npz"))


@pytest.mark.parametrize("name", NAMES)
def test_a_fixture_holds_float64_outputs_and_its_snapshot(name):
    fixture = load_fixture(name)
    floats = {k: v.dtype for k, v in fixture.outputs.items() if v.dtype.kind == "f"}
    assert set(floats.values()) <= {np.dtype(np.float64)}, floats  # (fedskc-partition: indices only)
    assert re.fullmatch(r"[0-9a-f]{40}", fixture.snapshot.commit) and "/" in fixture.snapshot.repository


def test_a_float32_output_is_refused(tmp_path):
    fixture = load_fixture(NAMES[0])
    with pytest.raises(TypeError, match="not computed in float64: \\['x'\\]"):
        save_fixture("x", fixture.snapshot, "", "", {}, {"x": np.zeros(2, np.float32)}, directory=tmp_path)
