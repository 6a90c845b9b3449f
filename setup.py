"""Generates the admin API's Python stubs from protos/ with grpcio-tools whenever the package is
built or installed (editable installs too): they are build outputs, not committed code."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTOS = ROOT / "protos" / "kvroute" / "v1"
OUT = "extproc/admin/proto"  # the generated modules' package: extproc.admin.proto


def generate_protos() -> None:
    from grpc_tools import protoc  # build requirement (pyproject.toml [build-system])

    files = sorted(p.name for p in PROTOS.glob("*.proto"))
    # -I maps protos/kvroute/v1 onto the package path, so the stubs import each other as
    # extproc.admin.proto.<name>_pb2; the proto package (kvroute.v1) stays what clients see.
    args = ["protoc", f"-I{OUT}={PROTOS}", f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={ROOT}", f"--grpc_python_out={ROOT}", f"--pyi_out={ROOT}",
            *(f"{OUT}/{f}" for f in files)]  # fmt: skip
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(files)}")


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
