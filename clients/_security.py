"""TLS credentials and the bearer token of a client, checked before any channel opens.

TLS options follow `grpc.ssl_channel_credentials` (and tritonclient): `root_certificates` to
trust (None: the system's), and for mutual TLS the client's own `certificate_chain` and
`private_key`. Each is PEM bytes or the path of a PEM file. The token travels as call metadata
(`authorization: Bearer <token>`) on every call, so it works over TLS and, on a trusted network
or behind a TLS-terminating proxy, over plaintext.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import grpc

PEM = Union[bytes, str, os.PathLike]
Metadata = tuple[tuple[str, str], ...]


def channel_credentials(
    credentials: grpc.ChannelCredentials | None,
    *,
    tls: bool,
    root_certificates: PEM | None,
    certificate_chain: PEM | None,
    private_key: PEM | None,
) -> grpc.ChannelCredentials | None:
    """The channel credentials the client's arguments ask for; None: plaintext."""
    pem = {"root_certificates": root_certificates, "certificate_chain": certificate_chain,
           "private_key": private_key}
    given = [name for name, value in pem.items() if value is not None]
    if credentials is not None:
        if tls or given:
            raise ValueError(
                f"give credentials or the TLS options, not both; got credentials and "
                f"{['tls', *given] if tls else given}"
            )
        return credentials
    if (certificate_chain is None) != (private_key is None):
        raise ValueError(
            "certificate_chain and private_key go together (mutual TLS), got only "
            + ("certificate_chain" if private_key is None else "private_key")
        )
    if not tls and not given:
        return None
    return grpc.ssl_channel_credentials(**{name: _pem(name, value) for name, value in pem.items()})


def auth_metadata(token: str | None) -> Metadata:
    """The metadata that carries ``token`` on every call; () without one."""
    if token is None:
        return ()
    if not isinstance(token, str):
        raise TypeError(f"token must be a str, got {type(token).__name__}")
    if not token:
        raise ValueError("token must not be empty, got ''")
    if not all("!" <= c <= "~" for c in token):
        # The message leaves the token out: it may end up in a log.
        raise ValueError(
            f"token must be visible ASCII characters without spaces, got {len(token)} "
            "characters that are not"
        )
    return (("authorization", f"Bearer {token}"),)


def _pem(name: str, value: PEM | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, (str, os.PathLike)):
        return Path(value).read_bytes()
    raise TypeError(f"{name} must be PEM bytes or a file path, got {type(value).__name__}")
