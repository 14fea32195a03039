"""deploy/make_credentials.py: private keys 0600 from their creation, the CA key outside the
deployable directory, certificates that verify."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import make_credentials
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

ROOT = Path(__file__).resolve().parents[1]
SUPERNODES = 2
DEPLOYABLE = {"ca.crt", "server.pem", "server.key", "superexec.secret", "operator.crt", "operator.key"} | {
    f"supernode-{i}{s}" for i in (1, 2) for s in ("", ".pub")}
PRIVATE = ["server.key", "supernode-1", "supernode-2", "superexec.secret", "operator.key"]


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def make(out, **kwargs):
    """make_credentials under umask 0, so that no mode comes from the umask."""
    previous = os.umask(0)
    try:
        return make_credentials.make_credentials(out, ["10.0.0.5"], SUPERNODES, **kwargs)
    finally:
        os.umask(previous)


def test_private_keys_are_0600_and_the_ca_key_is_kept_apart(tmp_path):
    out = tmp_path / "credentials"
    written = make(out)
    ca_dir = tmp_path / "credentials-ca"  # the default: a sibling of out
    assert {p.name for p in out.iterdir()} == DEPLOYABLE  # no ca.key among the files that are deployed
    assert [p.name for p in ca_dir.iterdir()] == ["ca.key"]
    assert set(written) == {out / name for name in DEPLOYABLE} | {ca_dir / "ca.key"}
    assert mode(ca_dir) == 0o700 and mode(ca_dir / "ca.key") == 0o600
    for name in PRIVATE:
        assert mode(out / name) == 0o600, name
    for name in DEPLOYABLE - set(PRIVATE):
        assert mode(out / name) == 0o644, name
    secret = (out / "superexec.secret").read_bytes()
    assert len(secret) == 64 and int(secret, 16)  # 32 random bytes, as hex
    make(tmp_path / "again")
    assert (tmp_path / "again" / "superexec.secret").read_bytes() != secret


def test_ca_dir_option_and_a_ca_key_left_in_out_by_an_older_version(tmp_path):
    out, ca_dir = tmp_path / "credentials", tmp_path / "keep" / "ca"
    out.mkdir()
    (out / "ca.key").write_bytes(b"an old CA key")
    script = [sys.executable, str(ROOT / "deploy" / "make_credentials.py"), "--out", str(out),
              "--ca-dir", str(ca_dir), "--supernodes", str(SUPERNODES)]
    subprocess.run(script, check=True, capture_output=True, timeout=60)
    assert {p.name for p in out.iterdir()} == DEPLOYABLE
    assert mode(ca_dir) == 0o700 and mode(ca_dir / "ca.key") == 0o600
    for inside in (out, out / "ca"):  # a directory that is deployed whole would carry it along
        with pytest.raises(ValueError, match="apart"):
            make(out, ca_dir=inside)


def test_keys_are_0600_from_their_creation_not_by_a_later_chmod(tmp_path, monkeypatch):
    # a chmod, by path or by descriptor, comes after the key is on disk, readable under the umask
    # (here 0): take every way of changing a mode away, so only the mode the file is created with counts
    for name in ("chmod", "fchmod", "lchmod"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, lambda *args, **kwargs: None)
    out = tmp_path / "credentials"
    make(out)
    for path in [out / name for name in PRIVATE] + [tmp_path / "credentials-ca" / "ca.key"]:
        assert mode(path) == 0o600, path


def test_an_existing_key_file_is_narrowed_to_0600(tmp_path):
    out, ca_dir = tmp_path / "credentials", tmp_path / "credentials-ca"
    out.mkdir()
    ca_dir.mkdir(mode=0o755)
    for path in [out / name for name in PRIVATE] + [ca_dir / "ca.key"]:
        path.write_bytes(b"old")
        path.chmod(0o644)  # O_CREAT's mode does not apply to a file that exists
    make(out)
    for path in [out / name for name in PRIVATE] + [ca_dir / "ca.key"]:
        assert mode(path) == 0o600 and path.read_bytes() != b"old", path
    assert mode(ca_dir) == 0o700


def test_a_symlink_planted_as_a_key_is_not_followed(tmp_path):
    out, target = tmp_path / "credentials", tmp_path / "elsewhere"
    out.mkdir()
    target.write_bytes(b"not yours")
    target.chmod(0o644)
    (out / "server.key").symlink_to(target)
    with pytest.raises(OSError):
        make(out)
    assert target.read_bytes() == b"not yours" and mode(target) == 0o644


def test_certificates_verify(tmp_path):
    out = tmp_path / "credentials"
    make(out)
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((tmp_path / "credentials-ca" / "ca.key").read_bytes(), None)
    server_key = serialization.load_pem_private_key((out / "server.key").read_bytes(), None)
    server.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    ca.verify_directly_issued_by(ca)  # self-signed
    assert ca_key.public_key() == ca.public_key() and server_key.public_key() == server.public_key()
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "superlink"} <= set(names.get_values_for_type(x509.DNSName))
    assert {"127.0.0.1", "10.0.0.5"} <= {str(a) for a in names.get_values_for_type(x509.IPAddress)}
    operator = x509.load_pem_x509_certificate((out / "operator.crt").read_bytes())
    operator.verify_directly_issued_by(ca)
    operator_key = serialization.load_pem_private_key((out / "operator.key").read_bytes(), None)
    assert operator_key.public_key() == operator.public_key()
    usage = operator.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]  # a client's, not a server's
    for i in range(1, SUPERNODES + 1):
        private = serialization.load_ssh_private_key((out / f"supernode-{i}").read_bytes(), None)
        public = serialization.load_ssh_public_key((out / f"supernode-{i}.pub").read_bytes())
        assert private.public_key() == public
