"""Whether a host firewall rule in the INPUT chain (where ufw puts its rules) keeps other machines
from a port Docker publishes, measured: the README's threat model says it does not, and that rules for
published ports belong in Docker's DOCKER-USER chain. Run as root on a host with dockerd:

    python deploy/firewall_check.py [--image protofl-local/flower:1.42.0]

"Another machine" is a network namespace joined to this host by a veth pair. A container publishes a
port (python3 -m http.server in ``--image``) and the namespace connects to it; first, as the control, to a
plain process of the host on the same port, without and with the INPUT rule below (refused with it). Then:

1. published on 0.0.0.0, no rule: connects;
2. the same, with ``iptables -I INPUT -p tcp --dport P -j DROP``: connects all the same (Docker
   DNATs the connection to the container in PREROUTING, so it is forwarded, never INPUT);
3. the same, with ``iptables -I DOCKER-USER -p tcp -m conntrack --ctorigdstport P -j DROP`` too: refused;
4. published on 127.0.0.1 (compose's default here), no rule: not reachable.

Prints one line per case and exits 1 if any outcome differs from the above. Everything it adds (the
container, the rules, the namespace and its veth) it removes.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
import uuid

CONNECT = ("import socket, sys\n"
           "try:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close(); print('connected')\n"
           "except OSError as err:\n    print(type(err).__name__)")


def sh(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=check)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default="protofl-local/flower:1.42.0", help="an image with python3")
    args = parser.parse_args()
    tag = uuid.uuid4().hex[:6]
    namespace, veth, subnet = f"pffw{tag}", f"pffw{tag}h", f"10.214.{int(tag, 16) % 250 + 1}"
    host, outside = f"{subnet}.1", f"{subnet}.2"
    port = free_port()
    container, rules, failed = None, [], False
    try:
        sh("ip", "netns", "add", namespace)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        sh("ip", "addr", "add", f"{host}/24", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        sh("ip", "-n", namespace, "addr", "add", f"{outside}/24", "dev", "eth0")
        sh("ip", "-n", namespace, "link", "set", "eth0", "up")

        def start(address: str) -> str:
            started = sh("docker", "run", "-d", "--rm", "-p", f"{address}:{port}:8000", "--entrypoint", "python3",
                         args.image, "-m", "http.server", "8000").stdout.strip()
            for _ in range(50):  # until it answers on the host's loopback (docker-proxy, then the server)
                probe = sh("python3", "-c", CONNECT, "127.0.0.1", str(port), check=False).stdout.strip()
                if probe == "connected":
                    break
                time.sleep(0.2)
            return started

        def from_outside() -> str:
            return sh("ip", "netns", "exec", namespace, "python3", "-c", CONNECT, host, str(port),
                      check=False).stdout.strip()

        def rule(chain: str, *match: str) -> None:
            sh("iptables", "-I", chain, "-p", "tcp", *match, "-j", "DROP")
            rules.append((chain, *match))

        # the control: the same INPUT rule does keep the namespace from a service of the host itself
        listener = socket.create_server(("0.0.0.0", port))
        cases = [("a host process on 0.0.0.0 (not Docker), no rule", from_outside(), "connected")]
        rule("INPUT", "--dport", str(port))
        cases.append((f"a host process + INPUT -p tcp --dport {port} -j DROP", from_outside(), "not connected"))
        sh("iptables", "-D", "INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP")
        rules.clear()
        listener.close()

        container = start("0.0.0.0")
        cases.append(("published on 0.0.0.0, no rule", from_outside(), "connected"))
        rule("INPUT", "--dport", str(port))
        cases.append((f"+ INPUT -p tcp --dport {port} -j DROP (as ufw deny)", from_outside(), "connected"))
        rule("DOCKER-USER", "-m", "conntrack", "--ctorigdstport", str(port))
        cases.append((f"+ DOCKER-USER --ctorigdstport {port} -j DROP", from_outside(), "not connected"))
        for chain, *match in reversed(rules):
            sh("iptables", "-D", chain, "-p", "tcp", *match, "-j", "DROP")
        rules.clear()
        sh("docker", "rm", "-f", container)
        container = start("127.0.0.1")
        cases.append(("published on 127.0.0.1, no rule", from_outside(), "not connected"))
        for case, outcome, expected in cases:
            ok = outcome == "connected" if expected == "connected" else outcome != "connected"
            failed |= not ok
            print(f"{'ok  ' if ok else 'FAIL'} {case}: from {outside} to {host}:{port}: {outcome}")
    finally:
        for chain, *match in reversed(rules):
            sh("iptables", "-D", chain, "-p", "tcp", *match, "-j", "DROP", check=False)
        if container:
            sh("docker", "rm", "-f", container, check=False)
        sh("ip", "netns", "del", namespace, check=False)  # takes its veth pair
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
