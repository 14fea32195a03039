"""The compose topology as native processes on one machine, without Docker.

Each service runs its command line from the compose files with the entry point of its image.
Only container host names, ``--host`` and ``--port`` values change; relative paths
(``state/``, ``credentials/``) and ``~`` resolve as in the containers, because each service
runs in its own directory, which is also its home (the images' ``/app``), with its own Flower
home. Used by the deployment tests and ``benchmarks/deployment.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import edge
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILES = {
    "base": ROOT / "docker-compose.yml",
    "local": ROOT / "docker-compose.override.yml",  # the SuperLink published on loopback
    "tls": ROOT / "deploy" / "compose.tls.yml",
    "auth": ROOT / "deploy" / "compose.auth.yml",
    "gpu": ROOT / "deploy" / "compose.gpu.yml",
}
BIN = Path(sys.executable).parent  # flower-superlink, flwr ... of this environment
NGINX = shutil.which("nginx") or next((p for p in ["/usr/sbin/nginx"] if os.path.exists(p)), None)  # the edge
MERGED_LISTS = ("volumes", "ports", "depends_on", "tmpfs")  # compose appends these; other lists are replaced


def _merge(base: Any, override: Any, key: str = "") -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for name, value in override.items():
            merged[name] = _merge(base[name], value, name) if name in base else value
        return merged
    if key in MERGED_LISTS and isinstance(base, list) and isinstance(override, list):
        return base + [item for item in override if item not in base]
    return override


def _interpolate(value: Any, environ: Mapping[str, str]) -> Any:
    """Compose's ``${NAME}``, ``${NAME:-default}`` (unset or empty) and ``${NAME-default}`` (unset)
    substitution in every string."""
    if isinstance(value, dict):
        return {key: _interpolate(item, environ) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item, environ) for item in value]
    if isinstance(value, str):
        def substitute(match: re.Match) -> str:
            name, operator, default = match.groups()
            if operator == ":-":
                return environ.get(name) or default
            return environ.get(name, default or "")

        return re.sub(r"\$\{(\w+)(?:(:?-)([^}]*))?\}", substitute, value)
    return value


def load_compose(*variants: str, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """``docker-compose.yml`` with the named override files (``local``, ``tls``, ``auth``, ``gpu``) merged
    in order and ``${...}`` substituted from ``environ``, as ``docker compose -f ... -f ...``
    does for the keys these files use."""
    merged: dict[str, Any] = {}
    for name in ("base", *variants):
        merged = _merge(merged, yaml.safe_load(COMPOSE_FILES[name].read_text()))
    return _interpolate(merged, environ)


def entry_point(service: dict[str, Any]) -> str:
    """The Flower command a service's image runs."""
    image, target = str(service.get("image", "")), service.get("build", {}).get("target")
    if target == "superlink" or image.startswith("flwr/superlink"):
        return "flower-superlink"
    if target == "supernode":  # deploy/Dockerfile's: Flower's SuperNode with protofl's fix
        return "protofl-supernode"
    if image.startswith("flwr/supernode"):
        return "flower-supernode"
    if target == "app" or image.startswith("flwr/superexec"):
        return "flower-superexec"
    raise ValueError(f"no Flower entry point known for image {image!r} / target {target!r}")


def native_command(command: list[str], host: str, port: int | None, addresses: dict[str, str]) -> list[str]:
    """``command`` with ``--host``/``--port`` values and ``service:port`` addresses replaced."""
    native = []
    for previous, token in zip([None, *command], command):
        if previous == "--host":
            token = host
        elif previous == "--port" and port is not None:
            token = str(port)
        native.append(addresses.get(token, token))
    return native


def environment() -> dict[str, str]:
    """This environment's binaries first on PATH, and no per-run dependency installation."""
    return os.environ | {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                         "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}


def flwr(home: Path, args: list[str], timeout: float,
         env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """This environment's ``flwr <args>`` with ``home`` as its Flower home (output captured)."""
    return subprocess.run([str(BIN / "flwr"), *args], env=environment() | dict(env or {}) | {"FLWR_HOME": str(home)},
                          capture_output=True, text=True, timeout=timeout)


def protofl_run(home: Path, args: list[str], timeout: float,
                env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """This environment's ``protofl run <args>`` (`flwr run --stream`, exiting 0 only for a completed
    run) with ``home`` as its Flower home (output captured)."""
    return subprocess.run([str(BIN / "protofl"), "run", *args], env=environment() | dict(env or {}) | {
        "FLWR_HOME": str(home)}, capture_output=True, text=True, timeout=timeout)


def start_managed_superlink(bin_dir: Path, env: Mapping[str, str], cwd: Path | None = None) -> subprocess.Popen:
    """The local SuperLink `flwr run` manages, started as flwr/cli/local_superlink.py starts it: from
    ``bin_dir``'s ``flower-superlink``, on the ports and Flower home ``env`` names, detached, its log
    and database under ``<FLWR_HOME>/local-superlink``. Not waited for."""
    runtime = Path(env["FLWR_HOME"]) / "local-superlink"
    runtime.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [str(bin_dir / "flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
         "--control-api-address", f"127.0.0.1:{env['FLWR_LOCAL_CONTROL_API_PORT']}", "--host", "127.0.0.1",
         "--port", env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"], "--log-file", str(runtime / "superlink.log"),
         "--database", str(runtime / "state.db")],
        cwd=cwd, env=dict(env) | {"FLWR_DISABLE_UPDATE_CHECK": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)


# Startup limits of Flower's and Ray's own, constants a loaded host can miss before a run has started
# (beside CI's other sessions each has been missed, Flower's at a load of 11-13 on 2 cores): Flower's
# 15 s for the SuperLink that `flwr run` starts (flwr/cli/local_superlink.py; `protofl run` starts
# it itself and waits longer), Ray's 30 s for its node to register (ray/_private/node.py), before
# the simulation's first round
SUPERLINK_LIMIT = "Failed to start local SuperLink within"
RAY_NODE_LIMIT = "The current node timed out during startup"


def missed_startup_limits(output: str) -> list[str]:
    """The startup limits above that a run's ``output`` says it missed."""
    return [limit for limit in (SUPERLINK_LIMIT, RAY_NODE_LIMIT) if limit in output]


def start_local_superlink(bin_dir: Path, env: Mapping[str, str], cwd: Path, timeout: float) -> None:
    """The managed local SuperLink of the Flower home and ports ``env`` names, started by ``bin_dir``'s
    protofl as `protofl run` starts it (Flower's own start, waited for up to ``timeout`` s rather than
    Flower's 15): a `flwr run` then finds it running and takes it. Raises if it did not answer."""
    code = ("import sys; from protofl.flower_compat import start_local_superlink; "
            f"sys.exit(start_local_superlink(False, {timeout}))")  # its reason, if any, on stderr, exit 1
    env = dict(env) | {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    started = subprocess.run([str(bin_dir / "python"), "-c", code], cwd=cwd, env=env, capture_output=True,
                             text=True, timeout=timeout + 60)
    if started.returncode:
        raise RuntimeError(f"the local SuperLink did not start: {started.stdout[-3000:]}{started.stderr[-3000:]}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float) -> None:
    """Wait until something accepts TCP connections on ``host:port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f} s")


class NativeDeployment:
    """Starts services as process groups in ``workdir/<service>``; ``stop()`` kills them all."""

    def __init__(self, workdir: Path, env: dict[str, str], credentials: Path | None = None) -> None:
        self.workdir = workdir
        self.env = env
        self.credentials = credentials
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, name: str, command: list[str], netns: str | None = None,
              env: Mapping[str, str] | None = None) -> subprocess.Popen:
        directory = self.workdir / name
        (directory / "state").mkdir(parents=True, exist_ok=True)
        if self.credentials is not None and not os.path.lexists(directory / "credentials"):
            (directory / "credentials").symlink_to(self.credentials)
        prefix = ["ip", "netns", "exec", netns] if netns else []
        log = open(directory / "log.txt", "wb")
        process = subprocess.Popen(
            prefix + command, cwd=directory, stdout=log, stderr=subprocess.STDOUT,
            env=self.env | dict(env or {}) | {"HOME": str(directory), "FLWR_HOME": str(directory / "flwr-home")},
            start_new_session=True,
        )
        log.close()
        self.processes[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.workdir / name / "log.txt").read_text(errors="replace")

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every process group, then SIGKILL what is still there after ``grace``."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for process in self.processes.values():
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            for process in self.processes.values():
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass


def service_command(compose: dict[str, Any], service: str, host: str, port: int | None,
                    addresses: dict[str, str]) -> list[str]:
    """A compose service's full native command line (entry point of its image, then its arguments)."""
    args = native_command(compose["services"][service]["command"], host, port, addresses)
    return [str(BIN / entry_point(compose["services"][service])), *args]


def service_environment(compose: dict[str, Any], service: str) -> dict[str, str]:
    """A compose service's ``environment`` (a mapping, or a list of KEY=VALUE)."""
    environ = compose["services"][service].get("environment") or {}
    if isinstance(environ, list):
        environ = dict(item.split("=", 1) for item in environ)
    return {key: str(value) for key, value in environ.items()}


def start_federation(
    deployment: NativeDeployment,
    compose: dict[str, Any],
    link: tuple[str, int],
    nodes: list[tuple[str, int, str | None]],
    before_nodes: Callable[[], None] = lambda: None,
    node_link: str | None = None,
) -> dict[str, str]:
    """The SuperLink and the ServerApp's SuperExec at ``link`` (host, port); then, for each
    (host, port, network namespace or None) in ``nodes``, SuperNode i and its ClientApp SuperExec;
    the SuperNodes dial ``node_link`` (host:port; default the SuperLink, or an edge in front of it).
    Returns the address replacements used (compose address -> native address)."""
    host, port = link
    addresses = {"superlink:8000": f"{host}:{port}"}
    addresses |= {f"supernode-{i}:9094": f"127.0.0.1:{p}" for i, (_, p, _) in enumerate(nodes, 1)}
    deployment.start("superlink", service_command(compose, "superlink", host, port, addresses))
    wait_for_port(host, port, timeout=60)
    deployment.start("superexec-serverapp", service_command(compose, "superexec-serverapp", host, None, addresses))
    before_nodes()
    for i, (node_host, node_port, netns) in enumerate(nodes, 1):
        node, clientapp = f"supernode-{i}", f"superexec-clientapp-{i}"
        dials = addresses | ({"superlink:8000": node_link} if node_link else {})
        deployment.start(node, service_command(compose, node, node_host, node_port, dials), netns)
        deployment.start(clientapp, service_command(compose, clientapp, node_host, None, addresses), netns,
                         service_environment(compose, clientapp))
    return addresses


def start_edge(deployment: NativeDeployment, link: tuple[str, int], listen: tuple[str, int],
               operator: str = "mtls") -> Path:
    """The edge (deploy/edge.py) as an nginx process on ``listen`` in front of the SuperLink at
    ``link``, with the deployment's credentials; returns its directory (``edge.conf``,
    ``access.log``)."""
    directory = deployment.workdir / "edge"
    directory.mkdir(parents=True, exist_ok=True)
    conf = directory / "edge.conf"
    conf.write_text(edge.render(
        listen=f"{listen[0]}:{listen[1]}", upstream=f"{link[0]}:{link[1]}", upstream_name="localhost",
        credentials=str(deployment.credentials), run_dir=str(directory), operator=operator,
        access_log=str(directory / "access.log"),
    ))
    if NGINX is None:
        raise FileNotFoundError("the edge needs nginx: apt-get install nginx-light")
    deployment.start("edge", [NGINX, "-e", "stderr", "-c", str(conf), "-p", str(directory), "-g", "daemon off;"])
    wait_for_port(*listen, timeout=30)
    return directory


def register_keys(home: Path, keys: list[Path]) -> None:
    """``flwr supernode register`` each public key with the connection "deployment" of ``home``."""
    for key in keys:
        registered = flwr(home, ["supernode", "register", str(key), "deployment"], timeout=60)
        if registered.returncode != 0:
            raise RuntimeError(f"registering {key} failed:\n{registered.stdout}{registered.stderr}")


def start_behind_edge(deployment: NativeDeployment, link: tuple[str, int], public: tuple[str, int],
                      tunnel: tuple[str, int], nodes: list[tuple[str, int, str | None]], operator: Path) -> dict[str, str]:
    """The TLS + SuperNode-auth federation with the SuperLink at ``link``, the edge on ``public``
    (which the SuperNodes dial) and the operator's tunnel (deploy/operator_tunnel.py) on ``tunnel``,
    through which ``operator`` (a Flower home, :func:`cli_home`) registers the SuperNodes' keys.
    Returns the address replacements of a SuperNode's command line (its SuperLink: the edge)."""
    credentials = deployment.credentials

    def edge_tunnel_and_keys() -> None:
        start_edge(deployment, link, public)
        deployment.start("operator-tunnel", [
            sys.executable, str(ROOT / "deploy" / "operator_tunnel.py"), "--edge", f"{public[0]}:{public[1]}",
            "--listen", f"{tunnel[0]}:{tunnel[1]}", "--credentials", str(credentials), "--server-name", "localhost"])
        wait_for_port(*tunnel, timeout=30)
        register_keys(operator, [credentials / f"supernode-{i}.pub" for i in range(1, len(nodes) + 1)])

    addresses = start_federation(deployment, load_compose("tls", "auth"), link, nodes,
                                 before_nodes=edge_tunnel_and_keys, node_link=f"{public[0]}:{public[1]}")
    return addresses | {"superlink:8000": f"{public[0]}:{public[1]}"}


def cli_home(directory: Path, address: str, root_certificates: Path | None = None) -> Path:
    """A Flower home for the ``flwr`` CLI whose default connection, "deployment", is ``address``."""
    directory.mkdir(parents=True, exist_ok=True)
    security = f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true"
    (directory / "config.toml").write_text(
        f'[superlink]\ndefault = "deployment"\n\n[superlink.deployment]\naddress = "{address}"\n{security}\n'
    )
    return directory


def check_fedproto_results(results: dict[str, Any], num_nodes: int) -> None:
    """Raise AssertionError unless ``results`` (results.json) is a 2-round FedProto run on digits in
    which all ``num_nodes`` clients trained and exchanged prototypes, and the personal models learnt."""
    first, second = results["rounds"]
    assert [first["round"], second["round"]] == [1, 2], results["rounds"]
    assert first["clients"] == second["clients"] == list(range(num_nodes)), (first["clients"], second["clients"])
    prototypes_and_mask = 10 * 512 * 4 + 10 + 2 * 128  # float32 C x d prototypes, bool mask, .npy headers
    assert first["bytes_down"] == 0 and second["bytes_down"] == num_nodes * prototypes_and_mask
    assert second["bytes_up"] > num_nodes * 10 * 512 * 4  # each client's prototypes went up
    assert second["personalized_accuracy"] > 0.5, second["personalized_accuracy"]


# --- processes: find and kill what a test or benchmark started (by PID, whole trees) -----


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def children_of(pid: int) -> list[int]:
    """The processes ``pid`` started (not their descendants)."""
    return _children().get(pid, [])


def descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process they started, and those started, ... (each once)."""
    tree = _children()
    everything: list[int] = []
    stack = list(pids)
    while stack:
        pid = stack.pop()
        if pid not in everything:
            everything.append(pid)
            stack.extend(tree.get(pid, []))
    return everything


def pids_with_argument(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (e.g. a test's temporary directory)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


def kill_trees(pids: list[int], grace: float = 5.0, signals=(signal.SIGTERM, signal.SIGKILL)) -> None:
    """SIGTERM each process and its descendants, then SIGKILL what is left after ``grace``
    (``signals=(signal.SIGKILL,)``: a crash, with no chance to clean up)."""
    everything = descendants(pids)
    for sig in signals:
        for pid in everything:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in everything):
            time.sleep(0.1)
