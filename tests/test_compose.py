"""docker-compose.yml and its variants: they parse, every flag they pass exists in the installed
Flower binaries, the topology is consistent, and they publish and mount no more than they must.
deploy/compose_e2e.sh builds and runs them for real (in CI); test_deployment.py runs the same
command lines natively."""

import functools
import io
import os
import re
import subprocess
import sys
import tarfile
from importlib.metadata import version
from pathlib import Path

import compose_e2e
import image_check
import native
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

# as docs/deployment/compose.md combines them: docker-compose.override.yml ("local") publishes the SuperLink on loopback,
# and the auth variant leaves it out (its edge is the only published port)
VARIANTS = [("local",), ("local", "tls"), ("tls", "auth"), ("local", "gpu"), ("tls", "auth", "gpu")]
EDGE_DOCKERFILE = "deploy/edge.Dockerfile"
CREDENTIAL_FILES = {"ca.crt", "server.pem", "server.key"}  # + supernode-<i>, as make_credentials.py writes


BINARIES = ("flower-superlink", "flower-supernode", "protofl-supernode", "flower-superexec")


@functools.cache
def _help_texts() -> dict[str, str]:
    """Each binary's --help, all asked at once (each starts a Python that imports Flower)."""
    asked = {b: subprocess.Popen([str(native.BIN / b), "--help"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True) for b in BINARIES}
    return {b: process.communicate(timeout=60)[0] for b, process in asked.items()}


def known_flags(binary: str) -> frozenset[str]:
    help_text = _help_texts()[binary]
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z-]*", help_text))


def supernodes(compose):
    return sorted(name for name in compose["services"] if name.startswith("supernode-"))


def option(command, flag):
    return command[command.index(flag) + 1] if flag in command else None


@pytest.mark.slow  # the installed binaries' --help, about 3 s the first time
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(v) or "base")
def test_every_flag_exists_in_the_installed_binaries(variant):
    compose = native.load_compose(*variant)
    for name, service in compose["services"].items():
        if service.get("build", {}).get("dockerfile") == EDGE_DOCKERFILE:
            continue  # nginx, configured by deploy/edge.py (tests/test_edge.py)
        binary = native.entry_point(service)
        flags = {token.split("=")[0] for token in service["command"] if token.startswith("--")}
        unknown = flags - known_flags(binary)
        assert not unknown, f"{name}: {binary} has no {sorted(unknown)}"


@pytest.mark.slow  # starts Flower's binaries: about 3 s
def test_a_flag_that_does_not_exist_is_caught():
    assert "--clientappio-api-address" not in known_flags("flower-supernode")  # removed in 1.35
    assert {"--superlink", "--node-config", "--auth-supernode-private-key"} <= known_flags("flower-supernode")
    assert known_flags("protofl-supernode") == known_flags("flower-supernode")  # the same arguments


def test_images_match_the_installed_flower_version():
    # The app image installs protofl's dependencies with -c constraints.txt on top of the image's own
    # flwr, so every default must be the pinned version itself, not only its major.minor: another
    # patch release there would be replaced by the pin inside the image.
    pinned = re.search(r"^flwr==(\S+)$", (ROOT / "constraints.txt").read_text(), flags=re.M).group(1)
    assert pinned == version("flwr")  # the tests run on the version the images get
    compose_files = [ROOT / "docker-compose.yml", *sorted((ROOT / "deploy").glob("compose*.yml"))]
    defaults = {path.name: set(re.findall(r"FLWR_VERSION:-([0-9.]+)", path.read_text())) for path in compose_files}
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    defaults["deploy/Dockerfile"] = set(re.findall(r"ARG FLWR_VERSION=([0-9.]+)", dockerfile))
    defaults["deploy/base.Dockerfile"] = set(
        re.findall(r"ARG FLWR_VERSION=([0-9.]+)", (ROOT / "deploy" / "base.Dockerfile").read_text()))
    defaults["deploy/compose_e2e.sh"] = set(
        re.findall(r"FLWR_VERSION=\$\{FLWR_VERSION:-([0-9.]+)\}", (ROOT / "deploy" / "compose_e2e.sh").read_text()))
    for name in ("firewall_check.py", "image_check.py"):  # their help's and usage's image tags
        defaults[f"deploy/{name}"] = set(re.findall(r"protofl-[a-z-]+/?[a-z-]*:([0-9.]+)",
                                                    (ROOT / "deploy" / name).read_text()))
    for name in ("docker-compose.yml", "deploy/Dockerfile", "deploy/base.Dockerfile", "deploy/compose_e2e.sh"):
        assert defaults[name], f"{name} names no FLWR_VERSION default"
    assert {name: found for name, found in defaults.items() if found - {pinned}} == {}, f"constraints.txt pins {pinned}"
    targets = set(re.findall(r"^FROM \S+ AS (\w+)", dockerfile, flags=re.M))
    for service in native.load_compose("gpu")["services"].values():
        if "build" in service:
            assert service["build"]["target"] in targets
            assert service["build"]["dockerfile"] == "deploy/Dockerfile"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(v) or "base")
def test_topology_each_supernode_has_its_partition_and_its_clientapp(variant):
    compose = native.load_compose(*variant)
    nodes = supernodes(compose)
    assert len(nodes) >= 2
    partition_ids = []
    for i, name in enumerate(nodes, 1):
        command = compose["services"][name]["command"]
        node_config = dict(item.split("=", 1) for item in option(command, "--node-config").split())
        assert int(node_config["num-partitions"]) == len(nodes)
        partition_ids.append(int(node_config["partition-id"]))
        assert option(command, "--superlink") == "superlink:8000" and option(command, "--host") == "0.0.0.0"
        clientapp = compose["services"][f"superexec-clientapp-{i}"]["command"]
        assert option(clientapp, "--runtime-api-address") == f"{name}:{option(command, '--port')}"
    assert sorted(partition_ids) == list(range(len(nodes)))
    superlink = compose["services"]["superlink"]
    assert option(superlink["command"], "--port") == "8000"
    if "auth" in variant:
        assert "ports" not in superlink  # behind the edge
    else:
        assert "127.0.0.1:8000:8000" in superlink["ports"]  # the operator's flwr CLI, on this host
    assert option(superlink["command"], "--database").startswith("state/")
    assert "superlink-state:/app/state" in superlink["volumes"]  # state survives the container
    assert option(compose["services"]["superexec-serverapp"]["command"], "--runtime-api-address") == "superlink:8000"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(v) or "base")
def test_the_superlink_supernodes_and_superexecs_restart_unless_stopped(variant):
    """A crashed SuperLink, SuperNode or SuperExec comes back by itself, however often (not "on-failure:3")."""
    compose = native.load_compose(*variant)
    restarting = [name for name in compose["services"] if name.startswith(("supernode-", "superexec-", "superlink"))]
    assert len(restarting) == 2 * len(supernodes(compose)) + 2  # nodes, their ClientApps', the ServerApp's, the link
    for name in restarting:
        assert compose["services"][name].get("restart") == "unless-stopped", name


def app_stage_creates(directory: str) -> bool:
    """Whether deploy/Dockerfile's app image makes ``directory`` owned by the image's user "app" (made
    as that user, or chowned to it): a named volume mounted there first takes its owner, so the runtime
    user (uid 49999) can write to it."""
    user, escaped = "app", re.escape(directory)  # Flower's images run as "app"
    for line in shipped_layers(dockerfile_stages(ROOT / "deploy" / "Dockerfile"), "app"):
        if line.startswith("USER "):
            user = line.split()[1]
        elif line.startswith("RUN") and re.search(rf"mkdir -p\b[^&;]*\s{escaped}(\s|$)", line):
            if user == "app" or re.search(rf"chown app:app\b[^&;]*\s{escaped}(\s|$)", line):
                return True
    return False


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(v) or "base")
def test_each_clientapp_keeps_its_supernodes_state_dir_on_a_volume_of_its_own(variant):
    """A SuperNode's ClientApps run in its superexec-clientapp-N (process isolation): the node config's
    state-dir must be a named volume of that container, and of no other, so that the partition's
    state survives restarts and re-creations (a resumed run needs it)."""
    compose = native.load_compose(*variant)
    volumes = set(compose["volumes"])
    mounted_by = {volume: [name for name, service in compose["services"].items()
                           if any(entry.split(":")[0] == volume for entry in service.get("volumes", []))]
                  for volume in volumes}
    state_volumes = set()
    for i, name in enumerate(supernodes(compose), 1):
        node_config = dict(item.split("=", 1) for item in option(compose["services"][name]["command"],
                                                                 "--node-config").split())
        state_dir = node_config["state-dir"].strip('"')
        # under the home: /app in the images; in the native runs of these command lines (tests/
        # test_deployment*.py) each service's own directory
        assert state_dir.startswith("~/"), state_dir
        target = "/app" + state_dir[1:]
        clientapp = f"superexec-clientapp-{i}"
        mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in compose["services"][clientapp]["volumes"]}
        assert mounts.get(target) in volumes, (clientapp, target, mounts)  # a named volume, not a host path
        assert mounted_by[mounts[target]] == [clientapp]  # no other container shares it
        state_volumes.add(mounts[target])
        assert app_stage_creates(target), target
    assert len(state_volumes) == len(supernodes(compose))  # one for each node


def test_the_state_volume_check_sees_a_missing_mount_point():
    assert app_stage_creates("/app/protofl-runs") and app_stage_creates("/app/client-state")
    assert not app_stage_creates("/app/client") and not app_stage_creates("/app/state")  # the SuperLink's stage


@pytest.mark.parametrize("variant", [("tls",), ("tls", "auth")], ids="+".join)
def test_tls_variants_use_mounted_credentials_and_never_insecure(variant):
    compose = native.load_compose(*variant)
    dialling = ["superlink", "superexec-serverapp", *supernodes(compose)]
    for name in dialling:
        service = compose["services"][name]
        assert "--insecure" not in service["command"], name
        mounts = [volume.split(":")[1] for volume in service.get("volumes", [])]
        for path in (token for token in service["command"] if token.startswith("credentials/")):
            assert Path(path).name in {*CREDENTIAL_FILES, "superexec.secret"} or re.fullmatch(r"supernode-\d+",
                                                                                          Path(path).name)
            assert any(f"/app/{path}" == m or f"/app/{path}".startswith(m + "/") for m in mounts), (name, path)
    superlink = compose["services"]["superlink"]["command"]
    assert {option(superlink, f) for f in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile")} == {
        f"credentials/{name}" for name in CREDENTIAL_FILES}
    for name in supernodes(compose):
        assert option(compose["services"][name]["command"], "--root-certificates") == "credentials/ca.crt"


def published(service) -> list[tuple[str, str, str]]:
    """(host address, host port, container port) of each ``ports`` entry."""
    entries = []
    for entry in service.get("ports", []):
        parts = str(entry).rsplit(":", 2)
        assert len(parts) == 3, f"{entry!r} publishes on every interface without saying so"
        entries.append(tuple(parts))
    return entries


@pytest.mark.parametrize("variant", [(), ("local",), ("local", "tls"), ("local", "gpu")],
                         ids=lambda v: "+".join(v) or "base")
def test_without_supernode_auth_only_the_superlink_is_published(variant):
    """Whoever reaches the SuperLink can start runs, i.e. run code in every container: without the edge
    only the SuperLink's port is published (by the override file), and nothing else."""
    for name, service in native.load_compose(*variant, environ={})["services"].items():
        ports = published(service)
        if name != "superlink" or "local" not in variant:  # the base file alone publishes nothing
            assert not ports, name
        else:
            assert ports


ALL_VARIANTS = [(), *VARIANTS]
# what a host beyond this one can reach only when the operator says so (docs/deployment/threat-model.md)
PUBLIC_ADDRESS = "SUPERLINK_PUBLIC_ADDRESS"


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=lambda v: "+".join(v) or "base")
def test_nothing_is_published_beyond_loopback_unless_told(variant):
    """Every port of every variant is published on 127.0.0.1 when nothing is set: a Docker-published
    port passes the host's INPUT firewall (ufw) by, so 0.0.0.0 would put it on every network the host
    is on. Only the edge moves, and only with SUPERLINK_PUBLIC_ADDRESS."""
    defaults = native.load_compose(*variant, environ={})["services"]
    assert {address for service in defaults.values() for address, _, _ in published(service)} <= {"127.0.0.1"}
    told = native.load_compose(*variant, environ={PUBLIC_ADDRESS: "10.0.0.5"})["services"]
    for name, service in told.items():
        expected = "10.0.0.5" if name == "edge" else "127.0.0.1"
        assert {address for address, _, _ in published(service)} <= {expected}, name


def test_the_auth_variant_publishes_only_the_edge_and_where_is_chosen():
    services = native.load_compose("tls", "auth", environ={})["services"]
    assert {name: published(service) for name, service in services.items() if published(service)} == {
        "edge": [("127.0.0.1", "9443", "9443")]}  # the SuperLink itself: no host port at all
    chosen = native.load_compose("tls", "auth", environ={PUBLIC_ADDRESS: "10.0.0.5",
                                                          "SUPERLINK_PUBLIC_PORT": "443", "SUPERLINK_PORT": "18000"})
    assert published(chosen["services"]["edge"]) == [("10.0.0.5", "443", "9443")]
    edge = services["edge"]
    assert edge["build"]["dockerfile"] == EDGE_DOCKERFILE and edge["depends_on"] == ["superlink"]


def test_the_native_edge_listens_on_loopback_unless_told(tmp_path):
    """deploy/edge.py's own default, for the edge as a native process (docs/deployment/edge.md)."""
    run_dir = tmp_path / "run"
    command = [sys.executable, str(ROOT / "deploy" / "edge.py"), "--credentials", str(tmp_path), "--run-dir",
               str(run_dir)]
    subprocess.run([*command, "--out", str(tmp_path / "default.conf")], check=True, timeout=60)
    subprocess.run([*command, "--out", str(tmp_path / "told.conf"), "--listen", "10.0.0.5:9443"], check=True,
                   timeout=60)
    assert re.findall(r"^\s*listen (\S+) ssl;", (tmp_path / "default.conf").read_text(), flags=re.M) == [
        "127.0.0.1:9443"]
    assert re.findall(r"^\s*listen (\S+) ssl;", (tmp_path / "told.conf").read_text(), flags=re.M) == [
        "10.0.0.5:9443"]


# tmpfs mounts a hardened service may have: /tmp, and directories of the runtime user (uid 49999) only
OWN_TMPFS = re.compile(r"(/app/\.flwr|/app/\.cache|/var/lib/protofl-edge):uid=49999,gid=49999,mode=0700")


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=lambda v: "+".join(v) or "base")
def test_every_service_runs_without_capabilities_on_a_read_only_root(variant):
    """No capability, no privilege gained through setuid files, a root file system that is read-only
    (writes go to named volumes or to tmpfs); deploy/compose_e2e.sh runs the variants so."""
    for name, service in native.load_compose(*variant, environ={})["services"].items():
        assert service.get("cap_drop") == ["ALL"] and not service.get("cap_add"), name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert service.get("read_only") is True and not service.get("privileged"), name
        assert service.get("user") in (None, "49999", "49999:49999"), name  # the images' user, never root
        tmpfs = service.get("tmpfs", [])
        assert all(entry == "/tmp" or OWN_TMPFS.fullmatch(entry) for entry in tmpfs), (name, tmpfs)
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert not source.startswith(("/", ".")) or volume.endswith(":ro"), (name, volume)  # host paths: read-only


def dockerfile_stages(path: Path) -> dict[str, dict]:
    """A Dockerfile's stages by name (the last one also as ""): the image or stage it starts FROM and its
    instructions, continuation lines joined."""
    instructions = re.sub(r"\\\n", " ", path.read_text())
    stages: dict[str, dict] = {}
    current = None
    for line in instructions.splitlines():
        line = line.strip()
        if line.startswith("FROM "):
            parts = line.split()
            current = {"from": parts[1], "instructions": []}
            stages[parts[3] if len(parts) > 3 and parts[2].upper() == "AS" else f"#{len(stages)}"] = current
        elif current is not None and line and not line.startswith("#"):
            current["instructions"].append(line)
    stages[""] = current
    return stages


def shipped_layers(stages: dict[str, dict], target: str) -> list[str]:
    """The instructions whose layers a target ships: its own and those of the stages it starts FROM
    (not those of stages it only copies from)."""
    chain, stage = [], stages[target]
    while stage is not None:
        chain = stage["instructions"] + chain
        stage = stages.get(stage["from"])
    return chain


SHIPPED = [("Dockerfile", "superlink"), ("Dockerfile", "supernode"), ("Dockerfile", "app"),
           ("base.Dockerfile", ""), ("edge.Dockerfile", "")]


@pytest.mark.parametrize("dockerfile, target", SHIPPED, ids=lambda x: x or "last")
def test_the_build_ca_goes_into_no_shipped_layer(dockerfile, target):
    """deploy/build/ (pip.sh and any *.crt: a proxy's CA) is copied only into build stages that the
    shipped images copy results out of: a file deleted by a later layer stays in the image's history.
    deploy/image_check.py checks the built images' layers (deploy/compose_e2e.sh)."""
    stages = dockerfile_stages(ROOT / "deploy" / dockerfile)
    layers = shipped_layers(stages, target)
    assert layers, target
    copies = [line for line in layers if line.startswith(("COPY", "ADD")) and "--from=" not in line]
    assert not [line for line in copies if "deploy/build" in line], copies
    assert not [line for line in layers if line.startswith(("ARG", "ENV")) and "CA" in line.upper().split("=")[0]]


@pytest.mark.parametrize("variant", [("tls",), ("tls", "auth")], ids="+".join)
def test_each_container_mounts_only_the_credentials_it_needs(variant):
    """No directory of credentials is mounted, the CA key nowhere, a SuperNode's key only into that SuperNode."""
    needs = {"superlink": {"ca.crt", "server.pem", "server.key"}, "superexec-serverapp": {"ca.crt"},
             "edge": {"ca.crt", "server.pem", "server.key"}}
    compose = native.load_compose(*variant, environ={"CREDENTIALS_DIR": "/creds"})
    for name, service in compose["services"].items():
        mounted = {}
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("/creds"):
                assert Path(source).name == Path(target).name and volume.endswith(":ro"), volume
                mounted[Path(source).name] = target
        secret = "auth" in variant and name in ("superlink", "superexec-serverapp")
        expected = needs.get(name, set()) | ({"superexec.secret"} if secret else set())
        if name.startswith("supernode-"):
            expected = {"ca.crt"} | ({name} if "auth" in variant else set())
        assert set(mounted) == expected, name
        assert all(target == f"/app/credentials/{file}" for file, target in mounted.items())


def test_auth_variant_gives_each_supernode_its_own_key():
    compose = native.load_compose("tls", "auth")
    assert "--enable-supernode-auth" in compose["services"]["superlink"]["command"]
    for name in ("superlink", "superexec-serverapp"):  # the exposed runtime API wants the ServerApp's secret
        assert option(compose["services"][name]["command"], "--superexec-auth-secret-file") == \
            "credentials/superexec.secret"
    commands = [compose["services"][name]["command"] for name in supernodes(compose)]
    keys = [option(command, "--auth-supernode-private-key") for command in commands]
    assert keys == [f"credentials/supernode-{i}" for i in range(1, len(keys) + 1)]
    assert "--enable-supernode-auth" not in native.load_compose("tls")["services"]["superlink"]["command"]


def test_gpu_variant_reserves_gpus_for_the_clientapps_only():
    compose = native.load_compose("gpu")
    for name, service in compose["services"].items():
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if name.startswith("superexec-clientapp-"):
            assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
            assert "cu" in service["build"]["args"]["TORCH_INDEX_URL"]
            assert service["build"]["target"] == "app"  # merged into the base build, not replacing it
        else:
            assert not devices, name


def test_override_files_only_touch_services_of_the_base_file():
    base = set(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"])
    for name in ("local", "tls", "auth", "gpu"):
        added = {"edge"} if name == "auth" else set()  # the auth variant's only new service
        assert set(yaml.safe_load(native.COMPOSE_FILES[name].read_text())["services"]) <= base | added, name


def test_build_context_holds_only_what_the_dockerfile_copies():
    rules = (ROOT / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in rules if line.startswith("!")}
    assert "*" in rules  # everything else is left out
    copied = set()
    dockerfiles = ("Dockerfile", "base.Dockerfile", "edge.Dockerfile")
    for line in (line for name in dockerfiles for line in (ROOT / "deploy" / name).read_text().splitlines()):
        if line.startswith("COPY") and "--from=" not in line:  # from the context, not from a stage
            copied |= {token.rstrip("/") for token in line.split()[1:-1] if not token.startswith("--")}
    def within(path: str, directory: str) -> bool:
        return path == directory or path.startswith(directory + "/")

    assert all(any(within(path, entry) for entry in allowed) for path in copied)  # nothing copied is left out
    assert all(any(within(path, entry) for path in copied) for entry in allowed)  # nothing let in is unused


def test_variables_are_substituted_as_compose_does():
    defaults = native.load_compose(environ={})
    default_version = re.search(r"FLWR_VERSION:-([0-9.]+)", (ROOT / "docker-compose.yml").read_text()).group(1)
    assert defaults["services"]["supernode-1"]["image"] == f"protofl-supernode:{default_version}"
    args = defaults["services"]["superexec-serverapp"]["build"]["args"]
    assert args["FLOWER_IMAGES"] == "flwr" and args["TORCH_INDEX_URL"].endswith("/whl/cpu")  # Docker Hub, CPU torch
    node_config = option(defaults["services"]["supernode-1"]["command"], "--node-config")
    assert "num-threads=1" in node_config.split()  # one torch thread per ClientApp unless told
    chosen = native.load_compose(environ={"CLIENT_THREADS": "4", "FLWR_VERSION": "1.42.1"})
    assert "num-threads=4" in option(chosen["services"]["supernode-2"]["command"], "--node-config").split()
    assert chosen["services"]["superexec-serverapp"]["build"]["args"]["FLWR_VERSION"] == "1.42.1"
    local = native.load_compose(environ={"FLOWER_IMAGES": "protofl-local", "TORCH_INDEX_URL": ""})
    for name in ("superlink", "supernode-1", "superexec-clientapp-1"):
        assert local["services"][name]["build"]["args"]["FLOWER_IMAGES"] == "protofl-local", name
    assert local["services"]["superexec-clientapp-1"]["build"]["args"]["TORCH_INDEX_URL"] == ""  # PyPI's torch


# --- deploy/image_check.py: what compose_e2e.sh checks in the built images, on tars made here ---

CANARY = (ROOT / "deploy" / "build-ca-canary.pem").read_text()


def tar_bytes(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def saved_image(*layers: dict[str, bytes], config: bytes = b'{"history": []}') -> io.BytesIO:
    """A tar laid out as ``docker save`` writes one: a directory per layer, the configuration, the manifest."""
    files = {f"{i:064x}/layer.tar": tar_bytes(layer) for i, layer in enumerate(layers)}
    files |= {"config.json": config, "manifest.json": b'[{"Config": "config.json"}]'}
    return io.BytesIO(tar_bytes(files))


def test_the_image_check_finds_the_canary_in_any_layer_even_one_a_later_layer_deletes():
    needles = image_check.pem_needles(CANARY)
    assert len(needles) == 1 and needles[0] in CANARY.encode()
    bundle = b"# public CAs ...\n" + (b"x" * (image_check.CHUNK - 20)) + CANARY.encode()  # across a chunk border
    base = {"usr/bin/python3": b"\x7fELF...", "etc/ssl/certs/ca.pem": b"-----BEGIN CERTIFICATE-----\nMIIB\n"}
    clean = saved_image(base, {"python/venv/lib/site.py": b"import os\n"})
    assert image_check.scan_saved_image(clean, needles) == (2, [])
    # what main's Dockerfiles did: COPY deploy/build/ in one layer, `rm -rf /tmp/build` in the next;
    # and pip-install.sh's merged bundle left in /tmp
    leaked = saved_image(base, {"tmp/build/proxy.crt": CANARY.encode()},
                         {"tmp/build/.wh..wh..opq": b"", "tmp/tmp.Ab12": bundle})
    layers, findings = image_check.scan_saved_image(leaked, needles)
    assert layers == 3
    assert any("tmp/build/proxy.crt: holds the canary" in f for f in findings)
    assert any("tmp/tmp.Ab12: holds the canary" in f for f in findings)
    assert any("tmp/build/proxy.crt: under the build directory" in f for f in findings)
    in_history = saved_image(base, config=b'{"history": [{"created_by": "ARG CA=' + needles[0] + b'"}]}')
    assert image_check.scan_saved_image(in_history, needles)[1] == ["config.json: holds the canary"]


def docker_saved_image(layer: dict[str, bytes]) -> tuple[bytes, int]:
    """(a tar as ``docker save`` ends one, where its second zero block starts). Go's tar writer ends an
    archive with two zero blocks and no record padding; Python's tarfile reads a stream in records of
    20 blocks and stops at the first zero block. A configuration padded with spaces puts the first zero
    block at the end of a record, as protofl-supernode:1.42.0's save has it: the reader never asks for
    the second."""
    layers = {f"{0:064x}/layer.tar": tar_bytes(layer), "manifest.json": b'[{"Config": "config.json"}]'}
    for blocks in range(tarfile.RECORDSIZE // tarfile.BLOCKSIZE):
        padded = tar_bytes(layers | {"config.json": b"{}".ljust(blocks * tarfile.BLOCKSIZE)})
        last = tarfile.open(fileobj=io.BytesIO(padded), mode="r:").getmembers()[-1]
        data_end = -(-(last.offset_data + last.size) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
        if (data_end + tarfile.BLOCKSIZE) % tarfile.RECORDSIZE == 0:
            return padded[:data_end] + bytes(2 * tarfile.BLOCKSIZE), data_end + tarfile.BLOCKSIZE
    raise AssertionError("no padding puts the first zero block at a record's end")


def test_the_image_check_reads_docker_save_to_its_end(tmp_path, monkeypatch):
    """From the CI of c685956 (its compose demo): "docker save protofl-supernode:1.42.0 failed", with no
    word from docker. The scan stopped at the tar's first zero block and closed the pipe while docker
    still had the second to write: docker died of SIGPIPE. A fake docker writes its tar in two parts,
    the second a moment later, and dies as a Go program does on a closed stdout."""
    saved, second_zero_block = docker_saved_image({"usr/bin/python3": b"\x7fELF..."})
    (tmp_path / "saved.tar").write_bytes(saved)
    fake = tmp_path / "docker"
    fake.write_text(f"""#!{sys.executable}
import signal, sys, time
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
data = open({str(tmp_path / "saved.tar")!r}, "rb").read()
sys.stdout.buffer.write(data[:{second_zero_block}]); sys.stdout.buffer.flush()
time.sleep(0.5)
sys.stdout.buffer.write(data[{second_zero_block}:]); sys.stdout.buffer.flush()
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert image_check.check_layers("protofl-supernode:1.42.0", image_check.pem_needles(CANARY)) == (1, [])
    # a docker save that really fails still fails, with what it said
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write('Error: no such image\\n'); sys.exit(1)\n")
    with pytest.raises(RuntimeError, match="no such image"):
        image_check.check_layers("protofl-nothing:1.42.0", [])


# --- deploy/compose_e2e.py: what the demo's logs may and may not show ---

# From the CI of 44890ee (its compose demo): superexec-clientapp-1 started a ClientApp process after
# its claim on the task had expired; supernode-1 answered it 401 and the task ran again, in a new
# process. Frames shortened; supernode-1's lines interleave as compose printed them.
LATE_CLIENTAPP = """\
superexec-clientapp-1_1  | Traceback (most recent call last):
superexec-clientapp-1_1  |   File "/usr/lib/python3.11/threading.py", line 1038, in _bootstrap_inner
supernode-1_1            | \x1b[91mERROR \x1b[0m:     [/v1/runtime/send-task-heartbeat][ApiError:1008] Runtime task-token authentication failed.
superexec-clientapp-1_1  |     self.run()
superexec-clientapp-1_1  |   File "/python/venv/lib/python3.11/site-packages/flwr/supercore/heartbeat.py", line 128, in fn
superexec-clientapp-1_1  |     res = client.SendTaskHeartbeat(req)
superexec-clientapp-1_1  |     raise HTTPStatusError(message, request=request, response=self)
superexec-clientapp-1_1  | httpx.HTTPStatusError: Client error '401 Unauthorized' for url 'http://supernode-1:9094/v1/runtime/send-task-heartbeat'
superexec-clientapp-1_1  | For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/401
superexec-clientapp-1_1  | \x1b[91mERROR \x1b[0m:     Failed to push task output: Client error '401 Unauthorized' for url 'http://supernode-1:9094/v1/runtime/push-task-output'
supernode-1_1            | \x1b[92mINFO \x1b[0m:      Sending: evaluate message (ID: 4f4d53d3)
"""
STREAM = "INFO :      [ROUND 2]\nINFO :      round 2: GM 0.8812 PM 0.9301\n"


def test_the_demo_passes_a_clientapp_process_flower_replaced_after_its_claim_expired():
    assert compose_e2e.log_problems(LATE_CLIENTAPP, STREAM) == ([], 1)
    (container, block), = compose_e2e.tracebacks(LATE_CLIENTAPP)
    assert container == "superexec-clientapp-1_1" and block[-1].startswith("httpx.HTTPStatusError: Client error '401")
    assert not any("supernode-1" in line for line in block[:-1])  # the other container's lines are left out
    assert compose_e2e.log_problems(LATE_CLIENTAPP.replace("clientapp-1_1", "clientapp-1-1"), STREAM) == ([], 1)


# From the CI of d7c750c (its compose demo): the late process's other thread logged its own failed
# push in the middle of its heartbeat thread's traceback, the httpx message's second line with it.
LATE_CLIENTAPP_INTERLEAVED = """\
superexec-clientapp-1_1  | Traceback (most recent call last):
superexec-clientapp-1_1  |   File "/usr/lib/python3.11/threading.py", line 1038, in _bootstrap_inner
superexec-clientapp-1_1  | \x1b[92mINFO \x1b[0m:      Task stopped.
superexec-clientapp-1_1  |     self.run()
superexec-clientapp-1_1  |   File "/python/venv/lib/python3.11/site-packages/flwr/supercore/runtime/runtime_http_client.py", line 88, in SendTaskHeartbeat
superexec-clientapp-1_1  | \x1b[91mERROR \x1b[0m:     Failed to push task output: Client error '401 Unauthorized' for url 'http://supernode-1:9094/v1/runtime/push-task-output'
superexec-clientapp-1_1  | For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/401
superexec-clientapp-1_1  |     return self._unary_unary(
superexec-clientapp-1_1  |     raise HTTPStatusError(message, request=request, response=self)
superexec-clientapp-1_1  | httpx.HTTPStatusError: Client error '401 Unauthorized' for url 'http://supernode-1:9094/v1/runtime/send-task-heartbeat'
superexec-clientapp-1_1  | For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/401
"""


def test_a_late_clientapps_traceback_ends_at_its_error_line_past_its_other_threads_records():
    (container, block), = compose_e2e.tracebacks(LATE_CLIENTAPP_INTERLEAVED)
    assert block[-1].startswith("httpx.HTTPStatusError: Client error '401")
    assert not any("Task stopped" in line or "Failed to push" in line or "information" in line for line in block)
    assert compose_e2e.log_problems(LATE_CLIENTAPP_INTERLEAVED, STREAM) == ([], 1)
    # the same interleaving around any other error is still a failure
    raised = LATE_CLIENTAPP_INTERLEAVED.replace(
        "httpx.HTTPStatusError: Client error '401 Unauthorized' for url 'http://supernode-1:9094/v1/runtime/send-task-heartbeat'",
        "ValueError: shape (10, 512) != (10, 256)")
    problems, late = compose_e2e.log_problems(raised, STREAM)
    assert late == 0 and problems[0].endswith("| ValueError: shape (10, 512) != (10, 256)")


# The CI of 1b1feac failed its demo on "superexec-clientapp-2_1 | KeyboardInterrupt" (the rest of
# that log was not kept): a ClientApp process Flower stopped twice (STOP_SIGNAL in
# deploy/compose_e2e.py). Its shape as Flower 1.42's exit writes it, frames shortened.
STOPPED_CLIENTAPP = """\
superexec-clientapp-2_1  | \x1b[92mINFO \x1b[0m:      Task stopped.
superexec-clientapp-2_1  | Traceback (most recent call last):
superexec-clientapp-2_1  |   File "/python/venv/bin/flwr-clientapp", line 8, in <module>
supernode-2_1            | \x1b[92mINFO \x1b[0m:      Sending: train message (ID: 9c0e11aa)
superexec-clientapp-2_1  |     sys.exit(flwr_clientapp())
superexec-clientapp-2_1  |   File "/python/venv/lib/python3.11/site-packages/flwr/supercore/exit/exit.py", line 104, in flwr_exit
superexec-clientapp-2_1  |     event_future.result(timeout=TELEMETRY_TIMEOUT_SECONDS)
superexec-clientapp-2_1  | KeyboardInterrupt
"""


def test_the_demo_passes_a_clientapp_process_a_second_stop_signal_ended():
    assert compose_e2e.log_problems(STOPPED_CLIENTAPP, STREAM) == ([], 1)
    assert compose_e2e.log_problems(STOPPED_CLIENTAPP + LATE_CLIENTAPP, STREAM) == ([], 2)
    # anywhere else, an interrupt is a failure: no other container's process is Flower's ClientApp
    for container in ("superexec-serverapp_1", "supernode-2_1", "superlink_1"):
        logs = STOPPED_CLIENTAPP.replace("superexec-clientapp-2_1", container)
        problems, stopped = compose_e2e.log_problems(logs, STREAM)
        assert stopped == 0 and problems[0].endswith(f"{container} | KeyboardInterrupt"), container
    # and so is an error whose name merely starts like it
    problems, stopped = compose_e2e.log_problems(
        STOPPED_CLIENTAPP.replace("| KeyboardInterrupt", "| KeyboardInterruptError: no"), STREAM)
    assert stopped == 0 and len(problems) == 1


@pytest.mark.parametrize("failure", [
    # the ClientApp raised: any other error is a failure
    ("superexec-clientapp-1_1  |     raise HTTPStatusError(message, request=request, response=self)",
     "superexec-clientapp-1_1  |     raise ValueError('shape (10, 512) != (10, 256)')\n"
     "superexec-clientapp-1_1  | ValueError: shape (10, 512) != (10, 256)"),
    # a 401 from another node's SuperNode is not this process's expired claim
    ("url 'http://supernode-1:9094/v1/runtime/send-task-heartbeat'",
     "url 'http://supernode-2:9094/v1/runtime/send-task-heartbeat'"),
    # a 401 on the ServerApp's side
    ("superexec-clientapp-1_1", "superexec-serverapp_1"),
    # a 401 from elsewhere than the Runtime API
    ("/v1/runtime/send-task-heartbeat'", "/v1/fleet/pull-messages'"),
    # a 403 is not the expired claim's answer
    ("'401 Unauthorized'", "'403 Forbidden'"),
], ids=["clientapp-raised", "other-supernode", "serverapp", "not-runtime-api", "forbidden"])
def test_the_demo_fails_on_any_other_traceback(failure):
    logs = LATE_CLIENTAPP.replace(*failure)
    assert logs != LATE_CLIENTAPP
    problems, late = compose_e2e.log_problems(logs, STREAM)
    assert late == 0 and len(problems) == 1
    assert problems[0].startswith("superexec-") and problems[0].splitlines()[-1].split(" | ", 1)[1] in logs


def test_the_demo_fails_on_a_reply_the_serverapp_lost():
    """A ClientApp whose claim expired while it ran (not before it started) loses its reply: Flower
    sends an error reply in its place, and the ServerApp logs the failure; the demo must fail."""
    lost = STREAM + ("WARNING :   round 2: a client failed to evaluate: status 2: "
                     "ClientApp crashed or was lost\n")
    problems, late = compose_e2e.log_problems(LATE_CLIENTAPP, lost)
    assert late == 1 and problems == [lost.splitlines()[-1]]
