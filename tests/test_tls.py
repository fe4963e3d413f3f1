"""TLS and mutual TLS with certificates generated here (``cryptography``): a client trusting the
right CA connects; a client trusting another CA, or speaking plaintext, does not; under mTLS a
client without a certificate, or with one from another CA, is refused. Also the CLI flags, and
TLS + bearer tokens together."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ferrum_client import Client, FerrumRpcError

from ferrum_service.executors import ConfigurableModelExecutor

from .support.servers import REPO, InProcessServer, free_port


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(k) -> bytes:
    return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


class CA:
    def __init__(self, cn: str) -> None:
        self.key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.pem = _pem(self.cert)

    def issue(self, cn: str, *, server: bool) -> tuple[bytes, bytes]:
        key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(
                 [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return _pem(b.sign(self.key, hashes.SHA256())), _pem_key(key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other = CA("ferrum test CA"), CA("some other CA")
    srv_cert, srv_key = ca.issue("ferrum-server", server=True)
    cli_cert, cli_key = ca.issue("scheduler", server=False)
    rogue_cert, rogue_key = other.issue("rogue", server=False)
    files = {"ca": ca.pem, "other_ca": other.pem, "server.crt": srv_cert, "server.key": srv_key}
    for n, data in files.items():
        (d / n).write_bytes(data)
    return {"dir": d, "ca": ca.pem, "other_ca": other.pem, "client": (cli_cert, cli_key),
            "rogue": (rogue_cert, rogue_key), "server": (d / "server.crt", d / "server.key")}


def _mock():
    return [ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="mock")]


def _refused(**kw) -> FerrumRpcError:
    with Client(kw.pop("target"), timeout=3, **kw) as c, pytest.raises(FerrumRpcError) as e:
        c.prefill("mock", [1])
    return e.value


def test_tls_right_ca_connects_wrong_ca_and_plaintext_do_not(pki):
    crt, key = pki["server"]
    with InProcessServer(_mock(), tls_cert=str(crt), tls_key=str(key)) as srv:
        with Client(srv.target, root_certificates=pki["ca"]) as c:
            assert c.prefill("mock", [1]).output.output.token_id == 7
            assert c.health() == "SERVING"
        with Client(f"localhost:{srv.server.port}", root_certificates=pki["ca"]) as c:  # DNS SAN
            assert c.info().models[0].model_id == "mock"
        assert _refused(target=srv.target, root_certificates=pki["other_ca"]).code == grpc.StatusCode.UNAVAILABLE
        assert _refused(target=srv.target).code == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
        assert srv.live_caches()["mock"] == 1


def test_mutual_tls_requires_a_client_certificate_from_the_ca(pki):
    crt, key = pki["server"]
    (pki["dir"] / "client_ca").write_bytes(pki["ca"])
    with InProcessServer(_mock(), tls_cert=str(crt), tls_key=str(key),
                         tls_client_ca=str(pki["dir"] / "client_ca")) as srv:
        cert, k = pki["client"]
        with Client(srv.target, root_certificates=pki["ca"], private_key=k, certificate_chain=cert) as c:
            assert c.prefill("mock", [1]).output.output.token_id == 7
        # no client certificate: the handshake fails
        assert _refused(target=srv.target, root_certificates=pki["ca"]).code == grpc.StatusCode.UNAVAILABLE
        # a certificate from another CA: refused too
        rc, rk = pki["rogue"]
        e = _refused(target=srv.target, root_certificates=pki["ca"], private_key=rk, certificate_chain=rc)
        assert e.code == grpc.StatusCode.UNAVAILABLE
        assert srv.live_caches()["mock"] == 1  # only the authenticated caller's cache exists


def test_cli_serves_mutual_tls_with_bearer_tokens(pki, tmp_path):
    crt, key = pki["server"]
    (tmp_path / "tokens").write_text("sched-token\n")
    port = free_port()
    cmd = [sys.executable, "-m", "ferrum_service", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", "0", "--log-format", "json", "--model", "configurable,id=mock,vocab_size=1000,token_sequence=7",
           "--tls-cert", str(crt), "--tls-key", str(key), "--tls-client-ca", str(pki["dir"] / "ca"),
           "--auth-token-file", str(tmp_path / "tokens")]
    log = open(tmp_path / "server.log", "w")
    p = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    cert, k = pki["client"]
    target = f"127.0.0.1:{port}"
    try:
        with Client(target, root_certificates=pki["ca"], private_key=k, certificate_chain=cert,
                    token="sched-token") as c:
            deadline = time.monotonic() + 60
            while True:
                assert p.poll() is None, (tmp_path / "server.log").read_text()
                assert time.monotonic() < deadline, "server not SERVING"
                try:
                    if c.health(timeout=1) == "SERVING":
                        break
                except FerrumRpcError:  # not listening yet
                    pass
                time.sleep(0.1)
            assert c.prefill("mock", [1]).output.output.token_id == 7
        # right certificate, no token: UNAUTHENTICATED (TLS does not replace the token check)
        e = _refused(target=target, root_certificates=pki["ca"], private_key=k, certificate_chain=cert)
        assert e.code == grpc.StatusCode.UNAUTHENTICATED
        # a token but no certificate: the handshake already fails
        assert _refused(target=target, root_certificates=pki["ca"], token="sched-token").code == \
            grpc.StatusCode.UNAVAILABLE
    finally:
        p.terminate()
        assert p.wait(20) == 0
        log.close()
    assert '"mtls": true' in Path(tmp_path / "server.log").read_text()
