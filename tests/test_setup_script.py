"""./setup.sh's environment: a Flower home and local SuperLink ports of each checkout's own."""

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ports(checkout):
    out = subprocess.run(["bash", str(checkout / "setup.sh"), "--ports"], capture_output=True, text=True, check=True)
    return {k: int(v) for k, v in (pair.split("=") for pair in out.stdout.split())}


def test_each_checkout_gets_local_superlink_ports_of_its_own(tmp_path):
    """From the checkout's path: the same each time, apart for two checkouts, the control port 2
    above the HTTP one, both below Linux's ephemeral ports and above Ray's worker ports."""
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        shutil.copy(ROOT / "setup.sh", tmp_path / name)
    one, two, again = ports(tmp_path / "one"), ports(tmp_path / "two"), ports(tmp_path / "one")
    assert one == again and one != two
    for found in (one, two):
        http, control = found["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"], found["FLWR_LOCAL_CONTROL_API_PORT"]
        assert control == http + 2 and 20000 <= http and control <= 32000


def test_activating_the_venv_sets_this_checkouts_home_and_ports_replacing_an_older_block(tmp_path):
    """The block setup.sh writes at the end of .venv/bin/activate, run twice over a venv set up by
    an older setup.sh (its block without ports): one block, with this checkout's values."""
    script = (ROOT / "setup.sh").read_text()
    block = re.search(r'^marker=.*?^ACTIVATE$', script, re.S | re.M).group(0)
    activate = tmp_path / ".venv" / "bin" / "activate"
    activate.parent.mkdir(parents=True)
    activate.write_text('VIRTUAL_ENV=x\n# protofl environment\nexport FLWR_HOME="/elsewhere/.flwr"\n')
    port_lines = re.search(r"^http_port=.*?^control_port=.*?$", script, re.S | re.M).group(0)
    for _ in range(2):
        subprocess.run(["bash", "-c", f"set -e; root=$PWD; {port_lines}\n{block}"], cwd=tmp_path, check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "RAY_"))}
    shown = subprocess.run(["bash", "-c", f"source {activate}; env"], capture_output=True, text=True, env=env,
                           check=True).stdout
    values = dict(line.split("=", 1) for line in shown.splitlines() if line.startswith(("FLWR_", "RAY_")))
    assert values["RAY_worker_niceness"] == "0"  # a simulation's ClientApps at the shell's priority
    kept = subprocess.run(["bash", "-c", f"source {activate}; echo $RAY_worker_niceness"], capture_output=True,
                          text=True, env=env | {"RAY_worker_niceness": "10"}, check=True).stdout.strip()
    assert kept == "10"
    assert activate.read_text().count("# protofl environment") == 1
    assert values["FLWR_HOME"] == f"{tmp_path}/.flwr"
    root_ports = subprocess.run(["bash", "-c", f"root={tmp_path}; {port_lines}; echo $http_port $control_port"],
                                capture_output=True, text=True, check=True).stdout.split()
    assert [values["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"], values["FLWR_LOCAL_CONTROL_API_PORT"]] == root_ports
    assert values["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
