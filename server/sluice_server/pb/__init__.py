"""Python stubs for the gRPC contract in proto/sluice/v1/shard.proto.

The stubs are generated from the proto (never edited by hand): by
`scripts/gen-proto` before a wheel is built, and here on first import when a
source checkout has not been generated yet.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _find_proto_root() -> Path | None:
    for root in (_HERE / "proto", _HERE.parents[2] / "proto"):
        if (root / "sluice" / "v1" / "shard.proto").is_file():
            return root
    return None


def generate(out_dir: Path = _HERE) -> None:
    """Runs grpc_tools.protoc over the contract, writing into `out_dir`."""
    from grpc_tools import protoc
    import grpc_tools

    root = _find_proto_root()
    if root is None:
        raise RuntimeError("proto/sluice/v1/shard.proto not found; reinstall sluice")
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{root}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(root / "sluice" / "v1" / "shard.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    for pkg in (out_dir / "sluice", out_dir / "sluice" / "v1"):
        (pkg / "__init__.py").touch()


def _stale() -> bool:
    gen = _HERE / "sluice" / "v1" / "shard_pb2.py"
    root = _find_proto_root()
    if not gen.is_file():
        return True
    return root is not None and (root / "sluice/v1/shard.proto").stat().st_mtime > gen.stat().st_mtime


if _stale():
    generate()

# The generated modules import each other as `sluice.v1.shard_pb2`.
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

shard_pb2 = importlib.import_module("sluice.v1.shard_pb2")
shard_pb2_grpc = importlib.import_module("sluice.v1.shard_pb2_grpc")

__all__ = ["shard_pb2", "shard_pb2_grpc", "generate"]
