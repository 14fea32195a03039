"""Development credentials for a TLS deployment with SuperNode authentication.

Writes into ``--out`` (default ``deploy/credentials``), the files that are deployed:

- ``ca.crt``: a self-signed certificate authority (P-384);
- ``server.pem``, ``server.key``: the SuperLink's certificate, signed by that CA, valid for
  ``localhost``, ``127.0.0.1``, ``::1``, ``superlink`` (the compose service) and every ``--san``;
- ``supernode-<i>``, ``supernode-<i>.pub`` for i = 1..``--supernodes``: NIST P-384 key pairs in
  OpenSSH format, as ``flower-supernode --auth-supernode-private-key`` and
  ``flwr supernode register`` read them;
- ``operator.crt``, ``operator.key``: the operator's client certificate, signed by that CA, which
  the edge (``deploy/edge.py``) asks of whoever uses the Control API from outside; it stays on the
  operator's machine (``deploy/operator_tunnel.py`` presents it);
- ``superexec.secret``: a random shared secret with which the ServerApp's SuperExec authenticates
  to the SuperLink's runtime API (``--superexec-auth-secret-file``, experimental in Flower 1.41 and 1.42);

and the CA's private key ``ca.key`` into ``--ca-dir`` (default: ``<out>-ca``, e.g.
``deploy/credentials-ca``, mode 0700), apart from them: no service needs it, and whoever holds it
can issue certificates that every node trusts. A ``ca.key`` that an older version left in
``--out`` is removed.

Private keys are created with mode 0600 (never readable under the umask, not even briefly);
certificates and public keys get 0644. For development only: the private keys are written
unencrypted. Usage:

    python deploy/make_credentials.py --out deploy/credentials --supernodes 2 --san 10.0.0.5
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_SANS = ("localhost", "127.0.0.1", "::1", "superlink")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "protofl development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _subject_alternative_names(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):  # keep order, drop repeats
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _certificate(subject, public_key, issuer, signing_key, days: int, extensions) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signing_key, hashes.SHA384())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``data`` to ``path``, created with its final mode (0600 if ``private``, else 0644);
    a symbolic link at ``path`` is refused, not followed."""
    mode = 0o600 if private else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), mode)
    with os.fdopen(fd, "wb") as handle:
        os.fchmod(fd, mode)  # O_CREAT's mode applies to a new file only (and is narrowed by the umask)
        handle.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_credentials(
    out: Path, sans: list[str], supernodes: int, days: int = 365, ca_dir: Path | None = None
) -> list[Path]:
    """Write the CA, the SuperLink certificate and ``supernodes`` key pairs; return the paths.

    ``ca.key`` goes to ``ca_dir`` (default ``<out>-ca``), everything else to ``out``."""
    base = out if out.name else out.resolve()  # "." has no name to extend
    ca_dir = ca_dir if ca_dir is not None else base.with_name(base.name + "-ca")
    if out.resolve() in (ca_dir.resolve(), *ca_dir.resolve().parents):
        raise ValueError("the CA key must be kept apart from the deployed files: ca_dir must lie outside out")
    out.mkdir(parents=True, exist_ok=True)
    ca_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(ca_dir, 0o700)  # also when it existed
    (out / "ca.key").unlink(missing_ok=True)  # an older version wrote it among the deployed files
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = _name("protofl development CA")
    ca_cert = _certificate(ca_name, ca_key.public_key(), ca_name, ca_key, days, [
        (x509.BasicConstraints(ca=True, path_length=0), True),
        (x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                       encipher_only=False, decipher_only=False), True),
    ])
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = _certificate(_name("superlink"), server_key.public_key(), ca_name, ca_key, days, [
        (x509.BasicConstraints(ca=False, path_length=None), True),
        (_subject_alternative_names([*DEFAULT_SANS, *sans]), False),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
    ])
    written = [out / "ca.crt", ca_dir / "ca.key", out / "server.pem", out / "server.key"]
    _write(written[0], ca_cert.public_bytes(serialization.Encoding.PEM))
    _write(written[1], _pem_key(ca_key), private=True)
    _write(written[2], server_cert.public_bytes(serialization.Encoding.PEM))
    _write(written[3], _pem_key(server_key), private=True)
    operator_key = ec.generate_private_key(ec.SECP384R1())
    operator_cert = _certificate(_name("operator"), operator_key.public_key(), ca_name, ca_key, days, [
        (x509.BasicConstraints(ca=False, path_length=None), True),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False),
    ])
    written += [out / "operator.crt", out / "operator.key"]
    _write(written[-2], operator_cert.public_bytes(serialization.Encoding.PEM))
    _write(written[-1], _pem_key(operator_key), private=True)
    for index in range(1, supernodes + 1):
        node_key = ec.generate_private_key(ec.SECP384R1())
        private, public = out / f"supernode-{index}", out / f"supernode-{index}.pub"
        _write(private, node_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                               serialization.NoEncryption()), private=True)
        _write(public, node_key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                          serialization.PublicFormat.OpenSSH) + b"\n")
        written += [private, public]
    written.append(out / "superexec.secret")
    _write(written[-1], secrets.token_hex(32).encode(), private=True)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "credentials")
    parser.add_argument("--ca-dir", type=Path, default=None,
                        help="where the CA's private key goes, apart from --out (default: <out>-ca)")
    parser.add_argument("--san", action="append", default=[],
                        help="another host name or IP address of the SuperLink (repeatable)")
    parser.add_argument("--supernodes", type=int, default=2, help="how many SuperNode key pairs")
    parser.add_argument("--days", type=int, default=365, help="certificate validity")
    args = parser.parse_args()
    for path in make_credentials(args.out, args.san, args.supernodes, args.days, args.ca_dir):
        print(path)


if __name__ == "__main__":
    main()
