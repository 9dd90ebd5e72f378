"""Security drill (issue 9, drill 9): TLS, mutual TLS and basic auth from an
exporter-toolkit web configuration file, against a real exporter process, and
label-value escaping through a real Monitor.

Certificates come from a throw-away CA generated here with ``cryptography``;
passwords are bcrypt-hashed with the ``bcrypt`` package (cost 4: fast tests,
the same code path as cost 12).
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import os
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.exporter_proc import ExporterProcess
from tests.helpers.jobs import REPO

USER, PASSWORD = "prometheus", "s3cret pass:with colon"


# -- a test PKI ---------------------------------------------------------------
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert) -> None:
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_ca(directory: Path, name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    _write(directory / name, key, cert)
    return key, cert


def make_leaf(directory: Path, name: str, ca, server: bool):
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write(directory / name, key, cert)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d, "ca")
    make_leaf(d, "server", ca, server=True)
    make_leaf(d, "client", ca, server=False)
    rogue = make_ca(d, "rogue-ca")
    make_leaf(d, "rogue-client", rogue, server=False)
    return d


def web_config(path: Path, **doc) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def client_context(pki: Path, cert: str | None = None, max_version=None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if cert:
        ctx.load_cert_chain(str(pki / f"{cert}.crt"), str(pki / f"{cert}.key"))
    if max_version:
        ctx.maximum_version = max_version
    return ctx


def get(url: str, ctx: ssl.SSLContext | None = None, auth: tuple[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _ready_on_401(exp: ExporterProcess, ctx=None) -> bool:
    """A server that demands credentials is up when it answers 401."""
    return get(f"{exp.base}/healthz", ctx)[0] == 401


# -- the drills ---------------------------------------------------------------
def test_basic_auth_over_tls(pki: Path, tmp_path: Path):
    """Expectation: over TLS verified against the test CA, a scrape without
    credentials or with a wrong password gets 401 (with a Basic challenge), the
    right user and password get the metrics; plain HTTP to the TLS port gets no
    metrics."""
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    cfg = web_config(tmp_path / "web.yml",
                     tls_server_config={"cert_file": str(pki / "server.crt"), "key_file": str(pki / "server.key"),
                                        "min_version": "TLS12"},
                     http_server_config={"headers": {"X-Content-Type-Options": "nosniff"}},
                     basic_auth_users={USER: hashed})
    ctx = client_context(pki)
    with ExporterProcess(tmp_path / "metrics", ["--web-config", str(cfg)], scheme="https",
                         ready=lambda e: _ready_on_401(e, ctx)) as exp:
        # A client that connects and never starts the handshake must not stall
        # the others: the handshake runs in the connection's own thread.
        idle = socket.create_connection(("127.0.0.1", exp.port))
        status, body = get(exp.url, ctx)
        idle.close()
        assert status == 401, body
        req = urllib.request.Request(exp.url)
        try:
            urllib.request.urlopen(req, timeout=10, context=ctx)
        except urllib.error.HTTPError as e:
            assert e.headers["WWW-Authenticate"].startswith("Basic ")
            assert e.headers["X-Content-Type-Options"] == "nosniff"
        assert get(exp.url, ctx, (USER, "wrong"))[0] == 401
        assert get(exp.url, ctx, ("intruder", PASSWORD))[0] == 401
        for _ in range(3):   # the cached success path too
            status, body = get(exp.url, ctx, (USER, PASSWORD))
            assert status == 200
            names = {f.name for f in text_string_to_metric_families(body.decode())}
            assert "rankscope_exporter_info" in names
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/metrics", timeout=5).read()
        # the server survived the plain-HTTP attempt
        assert get(exp.url, ctx, (USER, PASSWORD))[0] == 200


def test_mutual_tls(pki: Path, tmp_path: Path):
    """Expectation: with RequireAndVerifyClientCert, a client without a
    certificate and a client whose certificate another CA signed are refused
    in the handshake; a client certificate from the configured CA scrapes."""
    cfg = web_config(tmp_path / "web.yml",
                     tls_server_config={"cert_file": "server.crt", "key_file": "server.key",
                                        "client_auth_type": "RequireAndVerifyClientCert",
                                        "client_ca_file": "ca.crt"})
    # relative paths resolve against the file's directory, as in exporter-toolkit
    (tmp_path / "web.yml").rename(pki / "web-mtls.yml")
    cfg = pki / "web-mtls.yml"
    good = client_context(pki, "client")
    with ExporterProcess(tmp_path / "metrics", ["--web-config", str(cfg)], scheme="https",
                         ready=lambda e: get(f"{e.base}/healthz", good)[0] == 200) as exp:
        assert get(exp.url, good)[0] == 200
        for ctx in (client_context(pki), client_context(pki, "rogue-client")):
            with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
                get(exp.url, ctx)
        assert get(exp.url, good)[0] == 200


def test_min_version_enforced(pki: Path, tmp_path: Path):
    """Expectation: min_version TLS13 refuses a client limited to TLS 1.2."""
    cfg = web_config(tmp_path / "web.yml",
                     tls_server_config={"cert_file": str(pki / "server.crt"), "key_file": str(pki / "server.key"),
                                        "min_version": "TLS13"})
    ctx = client_context(pki)
    with ExporterProcess(tmp_path / "metrics", ["--web-config", str(cfg)], scheme="https",
                         ready=lambda e: get(f"{e.base}/healthz", ctx)[0] == 200) as exp:
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            get(exp.url, client_context(pki, max_version=ssl.TLSVersion.TLSv1_2))
        assert get(exp.url, ctx)[0] == 200


@pytest.mark.parametrize("doc, expected", [
    ({"basic_auth_users": {"u": "plaintext"}}, "basic_auth_users.u: not a bcrypt hash"),
    ({"tls_server_config": {"cert_file": "/nonexistent.crt", "key_file": "/nonexistent.key"}},
     "tls_server_config.cert_file/key_file"),
    ({"tls_server_config": {"cert_file": "a.crt"}}, "needs both cert_file and key_file"),
    ({"tls_server_confg": {}}, "unknown field(s) tls_server_confg"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "client_auth_type": "RequireAnyClientCert"}},
     "client_auth_type RequireAnyClientCert"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "min_version": "SSL3"}}, "min_version 'SSL3'"),
])
def test_bad_web_config_is_a_start_up_error(tmp_path: Path, doc: dict, expected: str):
    """Expectation: a web configuration mistake stops the exporter at start-up
    (exit 2) with one line naming --web-config and the field; no traceback."""
    cfg = web_config(tmp_path / "web.yml", **doc)
    proc = subprocess.run([sys.executable, "-m", "rankscope.exporter", "--port", "1", "--dir", str(tmp_path / "m"),
                           "--no-nvml", "--web-config", str(cfg)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--web-config" in proc.stderr and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


LABEL_PROGRAM = r"""
import sys
from rankscope.monitor import Monitor
m = Monitor(run=sys.argv[1], exporter="off")
note = m.gauge("drill_note", "A label value with every character that needs escaping.", labels=("note",))
note.set(1.0, note=sys.argv[2])
with m.step(samples=1) as s:
    s.observe(loss=0.5)
m.close()
"""


def test_label_values_are_escaped(tmp_path: Path):
    """Expectation: a run id containing a quote and a backslash, and a label
    value containing a quote, a backslash and a newline, written by a real
    Monitor and served by a real exporter, parse back to the same strings with
    prometheus_client's parser, in both exposition formats."""
    run = 'drill "quoted" \\ back\\slash'
    note = 'line one\nline "two" \\ end'
    metrics_dir = tmp_path / "metrics"
    env = {**os.environ, "RANKSCOPE_METRICS_DIR": str(metrics_dir), "PYTHONPATH": str(REPO)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    subprocess.run([sys.executable, "-c", LABEL_PROGRAM, run, note], cwd=REPO, env=env, check=True, timeout=120)
    with ExporterProcess(metrics_dir) as exp:
        text = get(exp.url)[1].decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        steps = [s for s in families["rankscope_steps"].samples if s.name == "rankscope_steps_total"]
        assert [s.labels["run"] for s in steps] == [run]
        notes = families["rankscope_user_drill_note"].samples
        assert [(s.labels["note"], s.labels["run"]) for s in notes] == [(note, run)]
        assert [s.labels["run"] for s in families["rankscope_rank_state"].samples if s.value == 1] == [run]
        # OpenMetrics, negotiated by Accept
        req = urllib.request.Request(exp.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert "openmetrics" in resp.headers["Content-Type"]
            from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

            om = {f.name: f for f in om_parse(resp.read().decode())}
        assert [s.labels["note"] for s in om["rankscope_user_drill_note"].samples] == [note]
