"""A throwaway CA and certificates signed by it (openssl), for TLS tests on loopback."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path, names: Mapping[str, str]) -> Path:
    """``d/ca.crt`` (+ key), and for each name ``d/<name>.crt`` / ``.key`` with that subjectAltName
    (e.g. ``DNS:kvroute`` or ``IP:127.0.0.1``), valid two days. Returns ``d``."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvroute-test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    for name, san in names.items():
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)  # fmt: skip
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return d
