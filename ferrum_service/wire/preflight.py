"""Checks ``serve`` runs before it loads any model, so that a busy port or a bad TLS or token file
fails in a second with one clear line (exit 2) instead of after minutes of loading, as a traceback.

* Every file setting (TLS certificate, key and CA bundles, token files, KV peer TLS files) must
  be readable; ``--tls-cert`` and ``--tls-key`` go together, and ``--tls-client-ca`` needs them;
  the certificate and key must load as a pair (PEM, the key matching the certificate).
* The gRPC and metrics ports must be free on ``--host`` (port 0 = any free port: not checked).
"""

from __future__ import annotations

import errno
import socket
import ssl
from typing import Any

from ..core.settings import SettingError, setting

#: Settings that name a file the server reads.
FILE_SETTINGS = ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file", "admin_token_file", "kv_peer_token_file",
                 "kv_peer_ca", "kv_peer_cert", "kv_peer_key", "hub_token_file")


def _flag(name: str) -> str:
    return setting(name).flag or name


def check_files(st: dict[str, Any]) -> None:
    """SettingError naming the setting for a file that cannot be read or a TLS pair that does not load."""
    for name in FILE_SETTINGS:
        path = st.get(name)
        if not path:
            continue
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise SettingError(f"{_flag(name)} {path}: cannot read it ({e.strerror or e})") from None
    if bool(st.get("tls_cert")) != bool(st.get("tls_key")):
        raise SettingError("--tls-cert and --tls-key go together")
    if st.get("tls_client_ca") and not st.get("tls_cert"):
        raise SettingError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    for cert, key in (("tls_cert", "tls_key"), ("kv_peer_cert", "kv_peer_key")):
        if st.get(cert) and st.get(key):
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(st[cert], st[key])
            except (ssl.SSLError, OSError) as e:
                raise SettingError(f"{_flag(cert)} {st[cert]} / {_flag(key)} {st[key]}: not a PEM certificate "
                                   f"and its private key ({e})") from None
    for name in ("tls_client_ca", "kv_peer_ca"):
        if st.get(name):
            try:
                ssl.create_default_context(cafile=st[name])
            except (ssl.SSLError, OSError) as e:
                raise SettingError(f"{_flag(name)} {st[name]}: not a PEM CA bundle ({e})") from None


def check_ports(st: dict[str, Any]) -> None:
    """SettingError naming the setting for a port another process holds on ``--host``."""
    host = st["host"]
    for name in ("port", "metrics_port"):
        port = st[name]
        if not port:
            continue
        try:
            family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind (TIME_WAIT is no owner)
                s.bind((host, port))
        except OSError as e:
            why = "in use by another process" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise SettingError(f"{_flag(name)} {port} on {host}: cannot listen there ({why})") from None


def check(st: dict[str, Any]) -> None:
    """Both checks (see the module doc)."""
    check_files(st)
    check_ports(st)


__all__ = ["FILE_SETTINGS", "check", "check_files", "check_ports"]
