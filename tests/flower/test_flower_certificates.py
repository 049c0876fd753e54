"""The key material of `pflbed flower local --tls --auth` (`flower/certificates.py`): what each certificate and key
holds, checked on the files themselves and by a TLS handshake that verifies the SuperLink as a client would. That
the files are private from their creation is `test_private_files`'s."""

import contextlib
import datetime
import socket
import ssl
import threading
import time

import pytest

pytest.importorskip("cryptography")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from pflbed.flower.certificates import write_certificates, write_node_keys  # noqa: E402


def _common_name(name: x509.Name) -> list[str]:
    return [a.value for a in name.get_attributes_for_oid(NameOID.COMMON_NAME)]


def _handshake(ca, cert, key, server_hostname: str) -> str:
    """The subject CN a client trusting only `ca` accepts from a server presenting `cert` and `key`, for
    `server_hostname` (ssl's own hostname and IP checks; a refusal raises `ssl.SSLCertVerificationError`)."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(ca))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def serve() -> None:
            conn, _ = listener.accept()
            with conn, contextlib.suppress(ssl.SSLError), server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)  # a client that refuses the certificate ends the handshake with an alert

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        try:
            with socket.create_connection(listener.getsockname(), timeout=10) as raw, \
                    client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:  # fmt: skip
                subject = dict(x[0] for x in tls.getpeercert()["subject"])["commonName"]
                tls.send(b".")
        finally:
            server.join(10)
    return subject


@pytest.fixture
def east_of_utc(monkeypatch):
    """A machine whose local time is 9 hours ahead of UTC: a certificate dated in local time would not be valid
    for another 9 hours."""
    monkeypatch.setenv("TZ", "Etc/GMT-9")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_the_superlink_certificate_is_signed_by_the_local_ca_for_this_machine_for_a_day(tmp_path, east_of_utc):
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    files = write_certificates(tmp_path / "certs")
    assert [f.name for f in files] == ["ca.crt", "superlink.pem", "superlink.key"]
    assert all(f.parent == tmp_path / "certs" for f in files)
    ca = x509.load_pem_x509_certificate(files[0].read_bytes())
    cert = x509.load_pem_x509_certificate(files[1].read_bytes())
    key = serialization.load_pem_private_key(files[2].read_bytes(), password=None)  # unencrypted: Flower reads it

    assert _common_name(ca.subject) == _common_name(ca.issuer) == ["pflbed local CA"]
    ca.verify_directly_issued_by(ca)  # self-signed
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length is None

    assert _common_name(cert.subject) == ["127.0.0.1"] and cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.BasicConstraints)  # not itself an authority
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert not san.critical
    assert san.value.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in san.value.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]

    for c in (ca, cert):
        assert before <= c.not_valid_before_utc <= datetime.datetime.now(datetime.UTC)
        assert c.not_valid_after_utc - c.not_valid_before_utc == datetime.timedelta(days=1)
    assert ca.serial_number != cert.serial_number

    assert isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()
    assert cert.public_key().public_numbers() != ca.public_key().public_numbers()  # the CA's key is not handed out


def test_a_client_trusting_the_ca_accepts_the_superlink_by_address_and_by_name_and_no_other(tmp_path):
    """What Flower's SuperNodes do with `--root-certificates ca.crt`: verify the SuperLink's chain and its name."""
    ca, cert, key = write_certificates(tmp_path / "certs")
    assert _handshake(ca, cert, key, "127.0.0.1") == "127.0.0.1"
    assert _handshake(ca, cert, key, "localhost") == "127.0.0.1"
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
        _handshake(ca, cert, key, "example.org")
    other_ca, _, _ = write_certificates(tmp_path / "other")  # another deployment's authority
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        _handshake(other_ca, cert, key, "127.0.0.1")


def test_each_node_has_a_key_pair_of_its_own_in_openssh_formats_on_p384(tmp_path):
    files = write_node_keys(tmp_path / "keys", 3)
    assert [(p.name, q.name) for p, q in files] == [(f"node-{k}", f"node-{k}.pub") for k in range(3)]
    publics = []
    for private, public in files:
        assert private.read_bytes().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
        key = serialization.load_ssh_private_key(private.read_bytes(), password=None)
        pub = serialization.load_ssh_public_key(public.read_bytes())
        assert public.read_bytes().startswith(b"ecdsa-sha2-nistp384 ")
        assert isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP384R1)
        assert pub.public_numbers() == key.public_key().public_numbers()
        publics.append(pub.public_numbers())
    assert len({(n.x, n.y) for n in publics}) == 3
    assert write_node_keys(tmp_path / "none", 0) == [] and (tmp_path / "none").is_dir()
