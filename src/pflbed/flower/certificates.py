"""Key material for a local deployment: self-signed TLS (`pflbed flower local --tls`: a certificate authority and
a SuperLink certificate for 127.0.0.1 / localhost signed by it, valid for a day) and SuperNode authentication keys
(`--auth`: one EC key pair per node, in the OpenSSH formats Flower reads). For real deployments, use certificates
from your own authority and keys each site generates itself (docs/guide/flower.md)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pflbed.private_files import private_dir, write_private_bytes


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def write_certificates(path: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, SuperLink certificate, SuperLink key) written as PEM files into `path` (a 0700 directory;
    the key created 0600, never readable by others even for a moment: `private_files`)."""
    private_dir(path)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("pflbed local CA")).issuer_name(_name("pflbed local CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(san, critical=False).sign(ca_key, hashes.SHA256()))  # fmt: skip
    files = path / "ca.crt", path / "superlink.pem", path / "superlink.key"
    files[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_private_bytes(files[2], key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))  # fmt: skip
    return files


def write_node_keys(path: Path, nodes: int) -> list[tuple[Path, Path]]:
    """(private key, public key) of each of `nodes` SuperNodes, written into `path` as `node-<k>` and
    `node-<k>.pub` (OpenSSH formats; NIST P-384, a curve Flower accepts); the directory 0700, private keys 0600
    from their creation."""
    private_dir(path)
    files = []
    for k in range(nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        private, public = path / f"node-{k}", path / f"node-{k}.pub"
        write_private_bytes(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                       serialization.NoEncryption()))  # fmt: skip
        public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                         serialization.PublicFormat.OpenSSH))  # fmt: skip
        files.append((private, public))
    return files
