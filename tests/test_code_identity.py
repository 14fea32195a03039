"""A simulation's ClientApps run the ServerApp's code, or refuse: Flower's Ray workers import
protofl from the directory the local SuperLink was started in, which may be another checkout's
(docs/troubleshooting.md)."""

import json
import shutil

import pytest
from inprocess import run_in_process

from protofl.federation import checkpoint, code_identity
from protofl.federation.wire import CODE_DIGEST


def test_the_digest_is_the_code_a_process_imported(tmp_path):
    copy = tmp_path / "protofl"
    shutil.copytree(code_identity.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert code_identity.source_digest(copy) == code_identity.running_digest()
    (copy / "strategies" / "fedproto.py").write_text((copy / "strategies" / "fedproto.py").read_text() + "# edited\n")
    edited = code_identity.source_digest(copy)
    assert edited != code_identity.running_digest()

    code_identity.check_same_code({})  # a deployment's instructions carry none
    code_identity.check_same_code({CODE_DIGEST: code_identity.running_digest()})
    with pytest.raises(code_identity.OtherCode, match=f"runs protofl from {code_identity.PACKAGE} .*another checkout"):
        code_identity.check_same_code({CODE_DIGEST: edited})


@pytest.mark.parametrize("method", ["fedavg", "fedproto"])
def test_clients_of_other_code_than_the_servers_stop_the_run_in_round_1(tmp_path, monkeypatch, method):
    """The ServerApp's code differs from its clients' (as when another checkout's SuperLink runs the
    simulation): no client trains, and the run's one line names the cause."""
    monkeypatch.setattr(checkpoint, "running_digest", lambda: "0" * 16)
    run_in_process({"method": method, "num-server-rounds": 1, "output-dir": str(tmp_path), "run-name": "r"})
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert results["stopped"].startswith("round 1: 0 of 3 client updates usable, 2 required. 3 failed: "
                                         "client error: OtherCode: this ClientApp runs protofl from ")
    assert "another checkout or environment" in results["stopped"] and "\n" not in results["stopped"]
