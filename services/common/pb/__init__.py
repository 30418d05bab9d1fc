"""gRPC stubs, generated from ``proto/`` on first import and whenever a .proto is newer.

The stubs are build output (git-ignored, never edited by hand). Generating them here
means every entry point, test and container works from a fresh checkout without a
separate build step; the write is atomic so concurrent first imports are safe.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_DIR = PACKAGE_DIR.parents[2] / "proto"
PROTOS = ("weights.proto", "admin.proto")


def _stale(proto: Path) -> bool:
    generated = [PACKAGE_DIR / f"{proto.stem}{suffix}" for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return any(not path.exists() or path.stat().st_mtime < proto.stat().st_mtime for path in generated)


def build() -> None:
    from grpc_tools import protoc

    protos = [PROTO_DIR / name for name in PROTOS]
    if not any(_stale(proto) for proto in protos):
        return
    include = str(Path(protoc.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory(dir=PACKAGE_DIR) as tmp:
        # Map proto/ onto this package's import path so generated modules import each other correctly.
        args = [
            "protoc",
            f"-I{include}",
            f"-Iservices/common/pb={PROTO_DIR}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            # Stubs typing the messages' fields for pyright: the .py files build the classes at import time from a
            # serialized descriptor, which a type checker cannot read.
            f"--pyi_out={tmp}",
        ]
        if protoc.main(args + [f"services/common/pb/{proto.name}" for proto in protos]) != 0:
            raise RuntimeError(f"protoc failed on {[str(p) for p in protos]}")
        for generated in (Path(tmp) / "services" / "common" / "pb").glob("*.py*"):
            os.replace(generated, PACKAGE_DIR / generated.name)
    importlib.invalidate_caches()


build()

from services.common.pb import admin_pb2, admin_pb2_grpc, weights_pb2, weights_pb2_grpc  # noqa: E402

__all__ = ["admin_pb2", "admin_pb2_grpc", "build", "weights_pb2", "weights_pb2_grpc"]
