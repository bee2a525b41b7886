"""One security setting, mapped onto confluent-kafka, aiokafka and Faust; refused when inconsistent.

Certificates are real (a throwaway CA from trustme); the TLS contexts are checked by real
handshakes against a local TLS server, and Faust's own mapping onto aiokafka is compared with
ours, so the worker (Faust) and the killswitch (confluent-kafka) cannot drift apart.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import ssl
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from confluent_kafka import KafkaError
from cryptography.hazmat.primitives import serialization

from spanguard.config.kafka_security import KafkaSecurity
from spanguard.config.settings import WorkerSettings
from spanguard.connectors.kafka_clients import ClientErrors, LibrdkafkaLog, faust_credentials
from spanguard.errors import KafkaSecurityError

PASSWORD = "s3cret-never-logged"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1, a client certificate, and another CA."""
    root = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("spanguard-client")
    paths = {
        "ca": root / "ca.pem",
        "server": root / "server.pem",
        "client_cert": root / "client.pem",
        "client_key": root / "client.key",
        "client_key_encrypted": root / "client-encrypted.key",
        "other_ca": root / "other-ca.pem",
    }
    ca.cert_pem.write_to_path(paths["ca"])
    server.private_key_and_cert_chain_pem.write_to_path(paths["server"])
    client.cert_chain_pems[0].write_to_path(paths["client_cert"])
    client.private_key_pem.write_to_path(paths["client_key"])
    key = serialization.load_pem_private_key(client.private_key_pem.bytes(), None)
    paths["client_key_encrypted"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"key-pass"),
        )
    )
    trustme.CA().cert_pem.write_to_path(paths["other_ca"])
    return paths


def sasl_ssl(pki, **overrides) -> KafkaSecurity:
    values = {
        "security_protocol": "SASL_SSL",
        "ssl_ca_location": str(pki["ca"]),
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": "spanguard",
        "sasl_password": PASSWORD,
        **overrides,
    }
    return KafkaSecurity(**values)


# ---------------------------------------------------------------------- mapping


def test_plaintext_is_the_default_and_maps_to_nothing_else():
    security = KafkaSecurity.from_env({})
    assert security.confluent_config() == {"security.protocol": "PLAINTEXT"}
    assert security.aiokafka_kwargs() == {"security_protocol": "PLAINTEXT"}
    assert faust_credentials(security) is None
    assert WorkerSettings.from_sources({}, {}).kafka == security


def described_sasl_ssl(pki) -> dict[str, str]:
    """librdkafka's settings for SCRAM-SHA-512 over TLS as user spanguard, the password aside."""
    return {
        "security.protocol": "SASL_SSL",
        "ssl.ca.location": str(pki["ca"]),
        "ssl.endpoint.identification.algorithm": "https",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "spanguard",
    }


def test_sasl_ssl_from_the_environment_with_the_password_in_a_file(pki, tmp_path):
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    env = {
        "SPANGUARD_KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
        "SPANGUARD_KAFKA_SSL_CA_LOCATION": str(pki["ca"]),
        "SPANGUARD_KAFKA_SASL_MECHANISM": "scram-sha-512",
        "SPANGUARD_KAFKA_SASL_USERNAME": "spanguard",
        "SPANGUARD_KAFKA_SASL_PASSWORD_FILE": str(password_file),
    }
    security = KafkaSecurity.from_env(env)
    assert security.confluent_config() == {**described_sasl_ssl(pki), "sasl.password": PASSWORD}
    kwargs = security.aiokafka_kwargs()
    context = kwargs.pop("ssl_context")
    assert kwargs == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "spanguard",
        "sasl_plain_password": PASSWORD,
    }
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_faust_maps_our_credentials_onto_aiokafka_exactly_as_we_do(pki):
    """Faust's own translation (what the worker's consumers and producers get) equals
    aiokafka_kwargs() for every protocol, so the worker and a direct aiokafka client agree."""
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    cases = [
        sasl_ssl(pki),
        sasl_ssl(pki, sasl_mechanism="PLAIN"),
        sasl_ssl(pki, sasl_mechanism="SCRAM-SHA-256"),
        KafkaSecurity(
            "SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u", sasl_password=PASSWORD
        ),
        KafkaSecurity(
            "SSL",
            ssl_ca_location=str(pki["ca"]),
            ssl_certificate_location=str(pki["client_cert"]),
            ssl_key_location=str(pki["client_key"]),
        ),
    ]
    for security in cases:
        faust_side = dict(credentials_to_aiokafka_auth(faust_credentials(security)))
        ours = security.aiokafka_kwargs()
        assert faust_side.pop("security_protocol") == ours.pop("security_protocol")
        assert isinstance(faust_side.pop("ssl_context", None), ssl.SSLContext | None)
        ours.pop("ssl_context", None)
        assert faust_side == ours, security.security_protocol
    # The password is Faust's to send, never its to show.
    assert PASSWORD not in repr(faust_credentials(sasl_ssl(pki)))


class TlsServer:
    """A real TLS server on 127.0.0.1 (the server certificate from the test CA)."""

    def __init__(self, pki, require_client_cert: bool) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(pki["server"])
        if require_client_cert:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(pki["ca"])
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.peer_certs: list[dict] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls:
                    self.peer_certs.append(tls.getpeercert() or {})
                    tls.sendall(b"ok")
            except (ssl.SSLError, OSError):
                pass

    def handshake(self, context: ssl.SSLContext, host: str = "127.0.0.1") -> bytes:
        with (
            socket.create_connection(("127.0.0.1", self.port), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname=host) as tls,
        ):
            return tls.recv(2)

    def close(self) -> None:
        self.sock.close()


def test_the_tls_context_trusts_the_given_ca_and_only_it(pki):
    server = TlsServer(pki, require_client_cert=False)
    try:
        assert server.handshake(sasl_ssl(pki).ssl_context()) == b"ok"
        untrusted = sasl_ssl(pki, ssl_ca_location=str(pki["other_ca"])).ssl_context()
        with pytest.raises(ssl.SSLCertVerificationError):
            server.handshake(untrusted)
        # Host name checking is on by default and off only when asked.
        with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
            server.handshake(sasl_ssl(pki).ssl_context(), host="kafka.example")
        unchecked = sasl_ssl(pki, ssl_endpoint_identification_algorithm="none")
        assert server.handshake(unchecked.ssl_context(), host="kafka.example") == b"ok"
        assert unchecked.confluent_config()["ssl.endpoint.identification.algorithm"] == "none"
    finally:
        server.close()


def test_mutual_tls_presents_the_client_certificate(pki):
    server = TlsServer(pki, require_client_cert=True)
    try:
        mtls = KafkaSecurity(
            "SSL",
            ssl_ca_location=str(pki["ca"]),
            ssl_certificate_location=str(pki["client_cert"]),
            ssl_key_location=str(pki["client_key"]),
        )
        assert server.handshake(mtls.ssl_context()) == b"ok"
        assert server.peer_certs[-1]["subjectAltName"] == (("DNS", "spanguard-client"),)
        assert mtls.confluent_config() == {
            "security.protocol": "SSL",
            "ssl.ca.location": str(pki["ca"]),
            "ssl.endpoint.identification.algorithm": "https",
            "ssl.certificate.location": str(pki["client_cert"]),
            "ssl.key.location": str(pki["client_key"]),
        }
        without_cert = KafkaSecurity("SSL", ssl_ca_location=str(pki["ca"]))
        with pytest.raises((ssl.SSLError, ConnectionError)):
            server.handshake(without_cert.ssl_context())
            server.handshake(without_cert.ssl_context())  # TLS 1.3: the alert comes on read
    finally:
        server.close()


def test_an_encrypted_key_needs_its_password(pki):
    encrypted = {
        "security_protocol": "SSL",
        "ssl_ca_location": str(pki["ca"]),
        "ssl_certificate_location": str(pki["client_cert"]),
        "ssl_key_location": str(pki["client_key_encrypted"]),
    }
    security = KafkaSecurity(**encrypted, ssl_key_password="key-pass")
    assert security.confluent_config()["ssl.key.password"] == "key-pass"
    assert "key-pass" not in repr(security)
    with pytest.raises(KafkaSecurityError, match=r"wrong ssl\.key\.password"):
        KafkaSecurity(**encrypted, ssl_key_password="not-it")


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"security_protocol": "TLS"}, "security.protocol must be one of"),
        ({"sasl_mechanism": "PLAIN"}, "sasl.mechanism is set but security.protocol is PLAINTEXT"),
        ({"sasl_username": "u"}, "sasl.username is set but security.protocol is PLAINTEXT"),
        (
            {"security_protocol": "SSL", "sasl_mechanism": "SCRAM-SHA-512"},
            "sasl.mechanism is set but security.protocol is SSL",
        ),
        ({"security_protocol": "SASL_SSL"}, "SASL_SSL needs sasl.mechanism"),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI"},
            "needs sasl.mechanism, one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512",
        ),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u"},
            "SASL_SSL needs sasl.password",
        ),
        (
            {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN",
             "sasl_username": "u", "sasl_password": "p", "ssl_ca_location": "CA"},
            "ssl.ca.location is set but security.protocol is SASL_PLAINTEXT",
        ),
        (
            {"security_protocol": "SSL", "ssl_certificate_location": "CERT"},
            "ssl.certificate.location and ssl.key.location go together",
        ),
        (
            {"security_protocol": "SSL", "ssl_key_location": "KEY"},
            "ssl.certificate.location and ssl.key.location go together",
        ),
        (
            {"security_protocol": "SSL", "ssl_key_password": "p"},
            "ssl.key.password is set without ssl.key.location",
        ),
        (
            {"security_protocol": "SSL", "ssl_ca_location": "/nonexistent/ca.pem"},
            "ssl.ca.location: no such file '/nonexistent/ca.pem'",
        ),
        (
            {"security_protocol": "SSL", "ssl_endpoint_identification_algorithm": "dns"},
            "ssl.endpoint.identification.algorithm must be https or none",
        ),
    ],
)  # fmt: skip
def test_inconsistent_settings_are_refused_naming_them(pki, values, message):
    values = {
        k: str(pki[{"CA": "ca", "CERT": "client_cert", "KEY": "client_key"}[v]])
        if v in ("CA", "CERT", "KEY")
        else v
        for k, v in values.items()
    }
    with pytest.raises(KafkaSecurityError, match=re.escape(message)):
        KafkaSecurity(**values)


def test_a_password_and_a_password_file_together_are_refused(tmp_path):
    (tmp_path / "pw").write_text("x")
    env = {
        "SPANGUARD_KAFKA_SASL_PASSWORD": "x",
        "SPANGUARD_KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "pw"),
    }
    with pytest.raises(KafkaSecurityError, match="not both"):
        KafkaSecurity.from_env(env)


def test_flags_win_over_the_environment(pki, tmp_path):
    (tmp_path / "pw").write_text(PASSWORD)
    env = {
        "SPANGUARD_KAFKA_SECURITY_PROTOCOL": "SSL",
        "SPANGUARD_KAFKA_SSL_CA_LOCATION": str(pki["other_ca"]),
    }
    flags = {
        "kafka_security_protocol": "SASL_SSL",
        "kafka_ssl_ca_location": str(pki["ca"]),
        "kafka_sasl_mechanism": "PLAIN",
        "kafka_sasl_username": "flag-user",
        "kafka_sasl_password_file": str(tmp_path / "pw"),
    }
    settings = WorkerSettings.from_sources(flags, env)
    assert settings.kafka.security_protocol == "SASL_SSL"
    assert settings.kafka.ssl_ca_location == str(pki["ca"])
    assert settings.kafka.sasl_password == PASSWORD


def test_passwords_never_in_repr_or_describe(pki, tmp_path):
    security = sasl_ssl(pki)
    settings = WorkerSettings(kafka=security)
    for text in (repr(security), str(security), repr(settings), repr(security.describe())):
        assert PASSWORD not in text
    assert security.describe() == described_sasl_ssl(pki)


@pytest.mark.parametrize("command", [["worker"], ["topics", "create"]])
def test_the_cli_exits_2_with_one_line_before_any_connection(command):
    # No broker listens on port 9: the refusal must come before any connection attempt.
    result = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", *command, "--bootstrap", "127.0.0.1:9",
         "--kafka-security-protocol", "PLAINTEXT", "--kafka-sasl-mechanism", "SCRAM-SHA-512"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"spanguard {command[0]}: bad setting: sasl.mechanism is set but security.protocol is"
        " PLAINTEXT: use SASL_SSL (or SASL_PLAINTEXT)"
    ]


# ---------------------------------------------------------------------- failing fast


def test_client_errors_tell_a_refusal_from_a_broker_that_is_away():
    errors = ClientErrors("kafka:9093")
    errors(KafkaError(KafkaError._TRANSPORT, "connection refused"))
    assert errors.refused is None and errors.unreachable == "connection refused"
    errors(KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error: invalid credentials"))
    assert "refused the credentials (sasl.mechanism, sasl.username" in str(errors.refused)
    cert = ClientErrors("kafka:9093")
    cert(KafkaError(KafkaError._SSL, "SSL handshake failed: certificate verify failed"))
    assert "the broker's certificate is not trusted (ssl.ca.location)" in str(cert.refused)
    alert = ClientErrors("kafka:9093")
    alert(KafkaError(KafkaError._TRANSPORT, "Receive failed: ssl/tls alert bad certificate"))
    assert "refused the client certificate (ssl.certificate.location)" in str(alert.refused)


@contextlib.contextmanager
def librdkafka_lines() -> Iterator[tuple[LibrdkafkaLog, list[logging.LogRecord]]]:
    """A LibrdkafkaLog (one line per minute) and the records it let through."""
    records: list[logging.LogRecord] = []
    logger = logging.getLogger(f"tests.librdkafka.{uuid.uuid4().hex[:8]}")
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        yield LibrdkafkaLog(logger, every=60), records
    finally:
        logger.removeHandler(handler)


def test_librdkafka_lines_repeat_at_most_once_per_interval():
    with librdkafka_lines() as (sink, records):
        for elapsed in (3, 5, 8):  # one failure, retried: only its timing differs
            sink.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#consumer-1",
                     f"SASL authentication error (after {elapsed}ms in state AUTH_REQ)")  # fmt: skip
        # librdkafka's own count of the repeats it suppressed is the same failure too
        sink.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#consumer-1",
                 "SASL authentication error (after 9ms in state AUTH_REQ,"
                 " 1 identical error(s) suppressed)")  # fmt: skip
        sink.log(logging.WARNING, "%s [%s] %s", "FAIL", "rdkafka#consumer-1", "another failure")
    assert [r.getMessage() for r in records] == [
        "FAIL [rdkafka#consumer-1] SASL authentication error (after 3ms in state AUTH_REQ)",
        "FAIL [rdkafka#consumer-1] another failure",
    ]


def test_a_tls_failure_said_again_in_librdkafkas_shorter_form_is_logged_once():
    # As a client refused by an untrusted broker certificate logged it: the first try's line,
    # then the next try's, shorter, with the same OpenSSL error code.
    thread = "[thrd:sasl_ssl://127.0.0.1:56929/bootstrap]: sasl_ssl://127.0.0.1:56929/bootstrap: "
    first = (
        thread + "SSL handshake failed: error:0A000086:SSL routines::certificate verify failed:"
        " broker certificate could not be verified, verify that ssl.ca.location is correctly"
        " configured (after 5ms in state SSL_HANDSHAKE)"
    )
    again = (
        thread
        + "error:0A000086:SSL routines::certificate verify failed (after 3ms in state SSL_HANDSHAKE)"
    )
    other = (
        thread
        + "error:0A000412:SSL routines::sslv3 alert bad certificate (after 2ms in state SSL_HANDSHAKE)"
    )
    with librdkafka_lines() as (sink, records):
        for line in (first, again, other):
            sink.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#consumer-1", line)
    assert [r.getMessage() for r in records] == [
        f"FAIL [rdkafka#consumer-1] {first}",
        f"FAIL [rdkafka#consumer-1] {other}",  # another error: its own line
    ]


def test_to_env_round_trips(pki):
    security = sasl_ssl(pki, ssl_endpoint_identification_algorithm="none")
    assert KafkaSecurity.from_env(security.to_env()) == security
    assert KafkaSecurity().to_env() == {}
