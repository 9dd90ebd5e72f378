"""TLS and basic auth from an exporter-toolkit web configuration file.

The same YAML file node_exporter reads with ``--web.config.file``
(https://github.com/prometheus/exporter-toolkit/blob/master/docs/web-configuration.md)::

    tls_server_config:
      cert_file: server.crt
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # mutual TLS
      client_ca_file: ca.crt
      min_version: TLS12
    http_server_config:
      headers:
        Strict-Transport-Security: max-age=31536000
    basic_auth_users:
      prometheus: $2b$12$...   # bcrypt hash (htpasswd -nBC 12 "" | tr -d ':\\n')

Like exporter-toolkit, unknown keys are errors (a typo must not silently turn
security off), relative paths are relative to the file, and with no
``cert_file`` the server speaks plain HTTP (basic auth then travels in clear
text: a warning is logged). Differences, each a clear start-up error rather
than a silent downgrade: the client auth types that ask for a certificate
without verifying it (``RequestClientCert``, ``RequireAnyClientCert``) have no
equivalent in Python's ``ssl`` module, and ``cipher_suites`` /
``curve_preferences`` use Go names; ``client_allowed_sans`` is not supported.
The file is read once at start-up (restart the exporter to rotate a
certificate).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rankscope.exporter.config import ExporterConfigError

log = logging.getLogger("rankscope.exporter")

TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
UNSUPPORTED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")
TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version",
            "cipher_suites", "curve_preferences", "prefer_server_cipher_suites", "client_allowed_sans"}
UNSUPPORTED_TLS_KEYS = ("cipher_suites", "curve_preferences", "client_allowed_sans")
HTTP_KEYS = {"http2", "headers"}
TOP_KEYS = {"tls_server_config", "http_server_config", "basic_auth_users"}
OPT = "--web-config"


@dataclass
class WebConfig:
    """What the server enforces: an SSL context (None: plain HTTP), users, extra headers."""

    ssl_context: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)   # user -> bcrypt hash
    headers: list[tuple[str, str]] = field(default_factory=list)
    _verified: dict[bytes, bool] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    _dummy: bytes = field(default=b"", repr=False)

    def _dummy_hash(self) -> bytes:
        """A hash of a random password at the cost of a configured one, checked for unknown users."""
        if not self._dummy:
            import os

            import bcrypt

            cost = int(next(iter(self.users.values()))[4:6])
            self._dummy = bcrypt.hashpw(os.urandom(16).hex().encode(), bcrypt.gensalt(cost))
        return self._dummy

    @property
    def auth_required(self) -> bool:
        return bool(self.users)

    def check_authorization(self, header: str | None) -> bool:
        """True if the ``Authorization`` header carries a configured user and password.

        bcrypt is deliberately slow (~0.1-0.3 s per check at cost 10-12), and
        Prometheus sends the same credentials every scrape, so a successful
        check is cached under a SHA-256 of (user, password, hash), as
        exporter-toolkit does. Failures are not cached.
        """
        if not self.users:
            return True
        if not header or not header[:6].lower() == "basic ":
            return False
        try:
            decoded = base64.b64decode(header[6:].strip(), validate=True)
        except (binascii.Error, ValueError):
            return False
        user_b, sep, password = decoded.partition(b":")
        if not sep:
            return False
        user = user_b.decode("utf-8", "replace")
        hashed = self.users.get(user)
        # Check a dummy hash for unknown users too, so timing does not tell
        # which user names exist.
        target = hashed if hashed is not None else self._dummy_hash()
        key = hashlib.sha256(user_b + b"\0" + password + b"\0" + target).digest()
        with self._lock:
            if self._verified.get(key):
                return hashed is not None
        import bcrypt

        try:
            ok = bcrypt.checkpw(password, target)
        except ValueError:
            ok = False
        ok = ok and hashed is not None
        if ok:
            with self._lock:
                if len(self._verified) > 1024:   # bounded: a flood of distinct passwords cannot grow it
                    self._verified.clear()
                self._verified[key] = True
        return ok




def load_web_config(path: Path) -> WebConfig:
    """Parse and validate the file; every problem is an ExporterConfigError naming the option."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ExporterConfigError(f"{OPT}: cannot read {path}: {e.strerror or e}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ExporterConfigError(f"{OPT}: {path} is not valid YAML: {_one_line(e)}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ExporterConfigError(f"{OPT}: {path}: expected a mapping at the top level")
    _no_unknown(doc, TOP_KEYS, "")
    base = path.resolve().parent
    cfg = WebConfig()
    cfg.users = _users(doc.get("basic_auth_users"))
    cfg.headers = _headers(doc.get("http_server_config"))
    tls = doc.get("tls_server_config")
    if tls is not None:
        if not isinstance(tls, dict):
            raise ExporterConfigError(f"{OPT}: tls_server_config must be a mapping")
        cfg.ssl_context = _ssl_context(tls, base)
    if cfg.users and cfg.ssl_context is None:
        log.warning("%s: basic_auth_users without tls_server_config: passwords travel in clear text", OPT)
    return cfg


def _no_unknown(mapping: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in mapping if k not in allowed)
    if unknown:
        raise ExporterConfigError(f"{OPT}: unknown field(s) {', '.join(where + k for k in unknown)} "
                                  f"(allowed: {', '.join(sorted(where + k for k in allowed))})")


def _users(users: Any) -> dict[str, bytes]:
    if users is None:
        return {}
    if not isinstance(users, dict):
        raise ExporterConfigError(f"{OPT}: basic_auth_users must map user names to bcrypt hashes")
    if users:
        try:
            import bcrypt  # noqa: F401  (checked now, not at the first scrape)
        except ImportError:
            raise ExporterConfigError(f"{OPT}: basic_auth_users needs the bcrypt package (pip install bcrypt)") from None
    out = {}
    for user, hashed in users.items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")) or len(hashed) != 60:
            raise ExporterConfigError(f"{OPT}: basic_auth_users.{user}: not a bcrypt hash "
                                      "(make one with: htpasswd -nBC 12 '' | tr -d ':\\n')")
        out[str(user)] = hashed.encode()
    return out


def _headers(http: Any) -> list[tuple[str, str]]:
    if http is None:
        return []
    if not isinstance(http, dict):
        raise ExporterConfigError(f"{OPT}: http_server_config must be a mapping")
    _no_unknown(http, HTTP_KEYS, "http_server_config.")
    if http.get("http2"):
        log.info("%s: http_server_config.http2 is ignored: the exporter speaks HTTP/1.1", OPT)
    headers = http.get("headers") or {}
    if not isinstance(headers, dict):
        raise ExporterConfigError(f"{OPT}: http_server_config.headers must be a mapping")
    out = []
    for name, value in headers.items():
        if any(c in f"{name}{value}" for c in "\r\n"):
            raise ExporterConfigError(f"{OPT}: http_server_config.headers.{name}: line breaks are not allowed")
        out.append((str(name), str(value)))
    return out


def _ssl_context(tls: dict, base: Path) -> ssl.SSLContext | None:
    _no_unknown(tls, TLS_KEYS, "tls_server_config.")
    for key in UNSUPPORTED_TLS_KEYS:
        if tls.get(key):
            raise ExporterConfigError(f"{OPT}: tls_server_config.{key} is not supported by rankscope's exporter")
    cert, key = tls.get("cert_file"), tls.get("key_file")
    auth = tls.get("client_auth_type") or "NoClientCert"
    if not cert and not key:
        # exporter-toolkit: an empty TLS section means plain HTTP.
        return None
    if not cert or not key:
        raise ExporterConfigError(f"{OPT}: tls_server_config needs both cert_file and key_file")
    if auth in UNSUPPORTED_CLIENT_AUTH:
        raise ExporterConfigError(
            f"{OPT}: tls_server_config.client_auth_type {auth} (a certificate that is not verified) is not "
            f"supported; use {' or '.join(CLIENT_AUTH)}")
    if auth not in CLIENT_AUTH:
        raise ExporterConfigError(f"{OPT}: tls_server_config.client_auth_type {auth!r} is not one of "
                                  f"{', '.join(CLIENT_AUTH)}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _version(tls, "min_version", "TLS12")
    if tls.get("max_version"):
        ctx.maximum_version = _version(tls, "max_version", "TLS13")
    try:
        ctx.load_cert_chain(_path(cert, base), _path(key, base))
    except (OSError, ssl.SSLError) as e:
        raise ExporterConfigError(f"{OPT}: tls_server_config.cert_file/key_file: cannot load {cert} / {key}: "
                                  f"{getattr(e, 'strerror', None) or e}") from None
    ctx.verify_mode = CLIENT_AUTH[auth]
    ca = tls.get("client_ca_file")
    if ctx.verify_mode != ssl.CERT_NONE:
        if not ca:
            raise ExporterConfigError(f"{OPT}: tls_server_config.client_auth_type {auth} needs client_ca_file")
        try:
            ctx.load_verify_locations(cafile=_path(ca, base))
        except (OSError, ssl.SSLError) as e:
            raise ExporterConfigError(f"{OPT}: tls_server_config.client_ca_file: cannot load {ca}: "
                                      f"{getattr(e, 'strerror', None) or e}") from None
    return ctx


def _version(tls: dict, key: str, default: str) -> ssl.TLSVersion:
    name = tls.get(key) or default
    if name not in TLS_VERSIONS:
        raise ExporterConfigError(f"{OPT}: tls_server_config.{key} {name!r} is not one of {', '.join(TLS_VERSIONS)}")
    return TLS_VERSIONS[name]


def _path(name: Any, base: Path) -> str:
    p = Path(str(name))
    return str(p if p.is_absolute() else base / p)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
