"""TLS for the gRPC port: the server's certificate and key, and optionally mutual TLS.

With ``tls_client_ca`` set, a client must present a certificate signed by one of those CAs, or
the handshake fails before any RPC runs (gRPC's ``require_client_auth``). The files are read
when the server starts (``Settings`` has checked that they hold PEM); each front-end process
reads them itself, from the same paths. gRPC reports a certificate or key it cannot use only as
a failure to bind, with the reason in its own log: ``bind`` says which settings to look at.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from batchgate.server.config.settings import Settings
from batchgate.server.rules import messages


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """The credentials of the gRPC port, or None when it is plaintext."""
    if settings.tls_cert is None:
        return None
    cert = Path(settings.tls_cert).read_bytes()
    key = Path(settings.tls_key).read_bytes()
    client_ca = None
    if settings.tls_client_ca is not None:
        client_ca = Path(settings.tls_client_ca).read_bytes()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def bind(server: grpc.aio.Server, address: str, settings: Settings) -> int:
    """Add the gRPC port, TLS or plaintext as ``settings`` say; the port bound."""
    credentials = server_credentials(settings)
    if credentials is None:
        return server.add_insecure_port(address)
    try:
        return server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise OSError(messages.TLS_BIND_FAILED(address=address, detail=f" ({exc})")) from exc
