"""Regenerate the protobuf and gRPC modules from the `.proto` files beside this one.

    python -m batchgate.protos.generate           # rewrite protos/*_pb2*.py and *.pyi
    python -m batchgate.protos.generate --check   # exit 1, naming the files, if they are stale

The repository root is the include root, so the descriptors are named `protos/xxx.proto` (the
names the native front end compiles too). protoc's output is then rewritten in two ways: the
modules import each other as `batchgate.protos.xxx`, and they register into batchgate's own
descriptor pool (`batchgate.protos.registry.POOL`) rather than protobuf's default one, which
tritonclient's copies of the same `inference.*` messages occupy.
Output depends on the grpcio-tools version (its protoc stamps the protobuf version into each
module), so regenerate with the version the project pins.
"""

from __future__ import annotations

import argparse
import re
import filecmp
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent

# Relative to REPO_ROOT: they name the descriptors and the generated import paths.
PROTO_FILES = ("protos/model_config.proto", "protos/inference.proto", "protos/wire.proto",
               "protos/handover.proto")
# model_config.proto, wire.proto and handover.proto define no service; giving them to the gRPC plugin would
# only add empty modules.
SERVICE_PROTO_FILES = ("protos/inference.proto",)

GENERATED_FILES = (
    "protos/model_config_pb2.py",
    "protos/model_config_pb2.pyi",
    "protos/inference_pb2.py",
    "protos/inference_pb2.pyi",
    "protos/inference_pb2_grpc.py",
    "protos/wire_pb2.py",
    "protos/wire_pb2.pyi",
    "protos/handover_pb2.py",
    "protos/handover_pb2.pyi",
)


class ProtocError(RuntimeError):
    """protoc rejected the `.proto` files; it has printed why on stderr."""


def _run_protoc(args: list[str]) -> None:
    well_known_types = resources.files("grpc_tools") / "_proto"
    argv = ["grpc_tools.protoc", f"-I{REPO_ROOT}", f"-I{well_known_types}", *args]
    if protoc.main(argv) != 0:
        raise ProtocError(f"protoc failed: {' '.join(argv[1:])}")


# protoc's module names (`from protos import x_pb2`, 'protos.x_pb2') in the batchgate namespace.
_IMPORT = re.compile(r"^from protos import ", re.MULTILINE)
_MODULE_NAME = re.compile(r"'protos\.(\w+_pb2)'")
_DEFAULT_POOL = "_descriptor_pool.Default().AddSerializedFile("
_IMPORTS_END = "# @@protoc_insertion_point(imports)\n"


def _namespaced(text: str, rel: str) -> str:
    """protoc's output for `rel`, importing `batchgate.protos` and registering in its pool."""
    text = _IMPORT.sub("from batchgate.protos import ", text)
    text = _MODULE_NAME.sub(r"'batchgate.protos.\1'", text)
    if rel.endswith("_pb2.py"):
        if text.count(_DEFAULT_POOL) != 1 or text.count(_IMPORTS_END) != 1:
            raise ProtocError(f"{rel}: protoc's output no longer has the lines this rewrites")
        text = text.replace(_DEFAULT_POOL, "_registry.POOL.AddSerializedFile(")
        text = text.replace(_IMPORTS_END,
                            _IMPORTS_END + "from batchgate.protos import registry as _registry\n")
    return text


def generate(out_dir: Path) -> None:
    """Write the generated modules under `out_dir` (`out_dir/protos/...`)."""
    (out_dir / "protos").mkdir(parents=True, exist_ok=True)
    _run_protoc([f"--python_out={out_dir}", f"--pyi_out={out_dir}", *PROTO_FILES])
    _run_protoc([f"--grpc_python_out={out_dir}", *SERVICE_PROTO_FILES])
    for rel in GENERATED_FILES:
        path = out_dir / rel
        path.write_text(_namespaced(path.read_text(encoding="utf-8"), rel), encoding="utf-8")


def stale_files() -> list[str]:
    """Generated files that are missing or differ from a fresh generation, repo-relative."""
    with tempfile.TemporaryDirectory(prefix="protos-check-") as tmp:
        fresh_root = Path(tmp)
        generate(fresh_root)
        stale = []
        for rel in GENERATED_FILES:
            committed = REPO_ROOT / rel
            fresh = fresh_root / rel
            if not committed.is_file() or not filecmp.cmp(committed, fresh, shallow=False):
                stale.append(rel)
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchgate.protos.generate", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="generate into a temporary folder and exit 1 if the committed modules differ",
    )
    args = parser.parse_args(argv)

    try:
        return _check() if args.check else _generate()
    except ProtocError as exc:
        print(exc, file=sys.stderr)
        return 1


def _check() -> int:
    stale = stale_files()
    if stale:
        print(
            "stale generated protobuf modules: "
            + ", ".join(stale)
            + "\nrun `python -m batchgate.protos.generate` and commit the result",
            file=sys.stderr,
        )
        return 1
    print("generated protobuf modules are up to date")
    return 0


def _generate() -> int:
    generate(REPO_ROOT)
    for rel in GENERATED_FILES:
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
