"""The build pins (build-constraints.txt) against the runtime pins (constraints.txt): stubs generated
by a grpcio-tools newer than the installed grpcio raise at import, which broke a clean install once
a grpcio-tools release came out ahead of the pinned grpcio."""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _pins(name: str) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{name}: {line} is not an exact pin"
            pins[req.name.lower()] = Version(spec.version)
    return pins


def test_stub_generator_not_newer_than_runtime_grpcio() -> None:
    build, run = _pins("build-constraints.txt"), _pins("constraints.txt")
    assert build["grpcio-tools"] <= run["grpcio"], (
        f"build-constraints.txt's grpcio-tools {build['grpcio-tools']} is newer than constraints.txt's "
        f"grpcio {run['grpcio']}: the admin stubs it generates will not import"
    )
    assert "setuptools" in build


def test_makefile_installs_with_both() -> None:
    install = next(line for line in (ROOT / "Makefile").read_text().splitlines() if "-e '.[test]'" in line)
    assert "-c constraints.txt" in install and "--build-constraint build-constraints.txt" in install
