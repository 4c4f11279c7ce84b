"""Throwaway certificates for the TLS tests."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_pki(directory: Path) -> dict[str, Path]:
    """Throwaway certificates, made with the ``openssl`` command: a CA; a server certificate it
    signed for localhost and 127.0.0.1; a client certificate it signed; and a client
    certificate signed by another CA (``rogue_*``), which a server trusting the first refuses.
    Keys are P-256: quick to make. Paths by name: ``ca``, ``server_cert``, ``server_key``,
    ``client_cert``, ``client_key``, ``rogue_cert``, ``rogue_key``."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True,
                       timeout=60)

    def ca(name: str) -> None:
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "2", "-subj", f"/CN=batchgate test {name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout", f"{name}.key", "-out", f"{name}.pem")

    def leaf(name: str, issuer: str, extensions: str) -> None:
        (directory / f"{name}.ext").write_text(extensions)
        run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{issuer}.pem", "-CAkey",
            f"{issuer}.key", "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
            "-out", f"{name}.pem")

    ca("ca")
    ca("rogue-ca")
    leaf("server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                         "extendedKeyUsage=serverAuth\n")
    leaf("client", "ca", "extendedKeyUsage=clientAuth\n")
    leaf("rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    return {
        "ca": directory / "ca.pem",
        "server_cert": directory / "server.pem", "server_key": directory / "server.key",
        "client_cert": directory / "client.pem", "client_key": directory / "client.key",
        "rogue_cert": directory / "rogue.pem", "rogue_key": directory / "rogue.key",
    }
