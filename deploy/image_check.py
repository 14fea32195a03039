"""What the images of the docker compose demo must not carry, checked on the built images
(deploy/compose_e2e.sh runs it after every build):

- **no build CA in any layer**: a CA bundle handed to the build (BUILD_CA, deploy/build/*.crt) must not
  be in a layer of the shipped image, not even in one whose files a later layer deletes (``docker
  save`` still ships that layer). compose_e2e.sh puts a canary certificate (deploy/build-ca-canary.pem)
  into deploy/build/ next to the real CA; the canary goes wherever the CA goes, and it must be found in
  no layer and not in the image's configuration (its history), nor any file under the build directory;
- **the runtime user cannot write its Python**: the image's own user is not root, and no file or
  directory of its Python installation (the virtual environment, the interpreter's prefix, every
  entry of ``sys.path``) is writable by it.

    python deploy/image_check.py --canary deploy/build-ca-canary.pem protofl-app:1.42.0 ...

Prints one line per image and exits 1 if any image fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import IO, Iterable

# where deploy/Dockerfile and base.Dockerfile put deploy/build/ (pip-install.sh and any *.crt) in a stage
BUILD_DIRS = ("tmp/build/",)
CHUNK = 1 << 20

# run inside the image as its own user: every path of its Python installation that this user may write
WRITABLE_SCRIPT = r"""
import json, os, sys
roots = {os.path.realpath(p) for p in [sys.prefix, sys.base_prefix, *sys.path] if p and os.path.isdir(p)}
found = []
for root in sorted(roots):
    for directory, dirs, files in os.walk(root):
        for path in [directory, *(os.path.join(directory, f) for f in files)]:
            if not os.path.islink(path) and os.access(path, os.W_OK):
                found.append(path)
print(json.dumps({"uid": os.getuid(), "roots": sorted(roots), "writable": found[:20], "count": len(found)}))
"""


def pem_needles(pem: str) -> list[bytes]:
    """One line from the middle of each certificate's base64 body in ``pem``: a string that occurs in a
    file only if that certificate was copied into it (certificates' first lines share their header)."""
    needles, body = [], None
    for line in pem.splitlines():
        line = line.strip()
        if line.startswith("-----BEGIN CERTIFICATE"):
            body = []
        elif line.startswith("-----END CERTIFICATE") and body is not None:
            if body:
                needles.append(body[len(body) // 2].encode())
            body = None
        elif body is not None and line:
            body.append(line)
    return needles


def contains(stream: IO[bytes], needles: list[bytes]) -> bool:
    """Whether ``stream`` holds any of ``needles``, read in chunks that overlap by a needle's length."""
    overlap = max((len(n) for n in needles), default=0)
    tail = b""
    while chunk := stream.read(CHUNK):
        window = tail + chunk
        if any(n in window for n in needles):
            return True
        tail = window[-overlap:] if overlap else b""
    return False


def scan_layer(layer: IO[bytes], needles: list[bytes]) -> list[str]:
    """What a layer (a tar stream) carries that it must not: files under the build directory, and files
    that contain a needle."""
    findings = []
    with tarfile.open(fileobj=layer, mode="r|") as tar:
        for member in tar:
            name = member.name.lstrip("./")
            if name.startswith(BUILD_DIRS) and name not in (d.rstrip("/") for d in BUILD_DIRS):
                findings.append(f"{name}: under the build directory")
            if member.isfile():
                handle = tar.extractfile(member)
                if handle is not None and contains(handle, needles):
                    findings.append(f"{name}: holds the canary")
    return findings


def scan_saved_image(saved: IO[bytes], needles: list[bytes]) -> tuple[int, list[str]]:
    """(layers scanned, findings) of ``docker save``'s tar stream: every layer, and the image's
    configuration (its history of build commands), for the needles and the build directory."""
    layers, findings = 0, []
    with tarfile.open(fileobj=saved, mode="r|") as outer:
        for member in outer:
            if not member.isfile():
                continue
            handle = outer.extractfile(member)
            head = handle.read(512)
            rest = _Prefixed(head, handle)
            if len(head) == 512 and head[257:262] == b"ustar":  # a layer
                layers += 1
                findings += [f"layer {member.name}: {finding}" for finding in scan_layer(rest, needles)]
            elif contains(rest, needles):  # manifest, configuration (history), repositories
                findings.append(f"{member.name}: holds the canary")
    return layers, findings


class _Prefixed:
    """A stream whose first bytes were already read."""

    def __init__(self, head: bytes, stream: IO[bytes]) -> None:
        self.head, self.stream = head, stream

    def read(self, size: int = -1) -> bytes:
        if self.head:
            if size < 0:
                data, self.head = self.head + self.stream.read(), b""
                return data
            data, self.head = self.head[:size], self.head[size:]
            if len(data) < size:
                data += self.stream.read(size - len(data))
            return data
        return self.stream.read(size)


def check_layers(image: str, needles: list[bytes]) -> tuple[int, list[str]]:
    """scan_saved_image on ``docker save image``, read to its end: the scan stops at the tar's first zero
    block, and docker, still writing the second, would die of SIGPIPE on a closed pipe."""
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE, stderr=errors)
        unread = None
        try:
            found = scan_saved_image(process.stdout, needles)
            while process.stdout.read(CHUNK):
                pass
        except (tarfile.TarError, OSError) as error:  # what docker wrote is no image: did it fail?
            unread = error
        finally:
            process.stdout.close()
            returncode = process.wait(timeout=600)
        if returncode != 0:
            errors.seek(0)
            said = errors.read()[-2000:].decode(errors="replace").strip()
            raise RuntimeError(f"docker save {image} failed (exit {returncode}): {said or 'nothing on stderr'}")
        if unread is not None:
            raise unread
    return found


def image_user(image: str) -> str:
    """The user the image runs as (its USER; empty: root)."""
    done = subprocess.run(["docker", "image", "inspect", "--format", "{{.Config.User}}", image], capture_output=True,
                          text=True, timeout=60, check=True)
    return done.stdout.strip()


def check_python(image: str) -> list[str]:
    """Whether the image runs as root, and what its runtime user can write of its Python installation
    (an image without Python, the edge's, has none to write)."""
    user = image_user(image)
    problems = ["the image runs as root"] if user.split(":")[0] in ("", "root", "0") else []
    done = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", image,
                           "-c", WRITABLE_SCRIPT], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        has_python = "executable file not found" not in done.stderr + done.stdout
        return problems + ([f"could not run python3 in the image: {done.stderr[-500:]}"] if has_python else [])
    report = json.loads(done.stdout)
    if report["count"]:
        problems.append(f"its user (uid {report['uid']}) can write {report['count']} paths of its Python "
                        f"({', '.join(report['roots'])}), e.g. {report['writable'][:5]}")
    return problems


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images", nargs="+")
    parser.add_argument("--canary", type=Path, required=True, help="the certificate that went in with the CA")
    args = parser.parse_args(list(argv) if argv is not None else None)
    needles = pem_needles(args.canary.read_text())
    if not needles:
        parser.error(f"{args.canary} holds no certificate")
    failed = False
    for image in args.images:
        layers, findings = check_layers(image, needles)
        findings += check_python(image)
        failed |= bool(findings)
        verdict = "FAILED: " + "; ".join(findings) if findings else "no build CA in any layer or its history, " \
                                                                     "its user is not root and cannot write its Python"
        print(f"{image} ({layers} layers): {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
