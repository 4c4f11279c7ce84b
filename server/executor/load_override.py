"""A load's own config and files (Triton's RepositoryModelLoad parameters), checked and written.

``LoadOverride`` is what one load brings instead of the repository's: a ``ModelConfig`` that
replaces ``config.pbtxt``, and files that replace the whole model folder. Each file's path comes
through :func:`file_path`, which keeps it inside a version folder or ``warmup/``;
:func:`write_files` writes them into a new private folder, which the repository removes when
the version they made stops being served.

Knows nothing of gRPC or protocol messages: the control plane turns a request's parameters into
a ``LoadOverride``; errors are ``batchgate.batcher.errors`` exceptions.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from batchgate.batcher.errors import InvalidRequest, LoadError, ResourceExhausted, quoted
from batchgate.protos import model_config_pb2
from batchgate.server.config.model_config import CONFIG_FILENAME
from batchgate.server.executor.warmup import WARMUP_FOLDER

# The longest file name Linux file systems take, in bytes.
MAX_NAME_BYTES = 255
# What a load's files may hold: version folders (numbers without leading zeros, as in Triton)
# and the warm-up data folder, which are what a load reads.
_VERSION_FOLDER = re.compile(r"[1-9][0-9]*")
_FILE_FOLDERS = f"<version>/... or {WARMUP_FOLDER}/..."


@dataclasses.dataclass(frozen=True)
class LoadOverride:
    """What one load brings instead of the repository's own.

    ``config`` replaces ``config.pbtxt`` as a whole. ``files`` (paths from :func:`file_path`
    -> contents), when there are any, are the whole model folder: the repository's folder is
    not read, and need not exist. Files come with a config: the folder has no other."""

    config: model_config_pb2.ModelConfig | None = None
    files: Mapping[PurePosixPath, bytes] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.files and self.config is None:
            raise InvalidRequest(
                "a load's files need its config too: they replace the model's folder, whose "
                f"{CONFIG_FILENAME} the config parameter stands for (as in Triton)")
        paths = set(self.files)
        for path in paths:
            for parent in path.parents:
                if parent in paths:
                    raise InvalidRequest(
                        f"file {quoted(str(parent))} of the load is also a folder of "
                        f"{quoted(str(path))}")


def file_path(text: str) -> PurePosixPath:
    """The path a load's file is written to, inside the model folder: ``<version>/...`` or
    ``warmup/...``, with no absolute, empty, ``.`` or ``..`` part; InvalidRequest otherwise."""
    parts = text.split("/")
    plain = all(
        part not in ("", ".", "..")
        and "\x00" not in part
        and "\\" not in part
        and len(part.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES
        for part in parts
    )
    inside = len(parts) >= 2 and (
        _VERSION_FOLDER.fullmatch(parts[0]) is not None or parts[0] == WARMUP_FOLDER)
    if not (plain and inside):
        raise InvalidRequest(
            f"a load's file must be a path inside the model folder, {_FILE_FOLDERS} (no "
            f"absolute, empty, '.' or '..' parts, no '\\' or NUL, parts of at most "
            f"{MAX_NAME_BYTES} bytes), got {quoted(text)}")
    return PurePosixPath(*parts)


def write_files(root: Path, name: str, files: Mapping[PurePosixPath, bytes]) -> Path:
    """A new private folder under ``root`` holding ``name/<path>`` for each of ``files``
    (blocking). LoadError (ResourceExhausted when the disk is full) if one cannot be written."""
    folder = Path(tempfile.mkdtemp(dir=root))  # mode 0700
    relative = None
    try:
        for relative, data in sorted(files.items()):
            path = folder / name / relative
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Every name was checked (file_path) and this process made every folder: no link
            # can be in the way, and O_NOFOLLOW | O_EXCL say so again.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
    except OSError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        message = (f"model {quoted(name)}: cannot write the load's file "
                   f"{quoted(f'file:{relative}')}: {exc.strerror}")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ResourceExhausted(message) from None
        raise LoadError(message) from None
    return folder


def as_sent(message: str, model_dir: Path) -> str:
    """``message`` with the paths under ``model_dir`` (where a load's files were written) as
    the client named them: ``file:<path>``."""
    return message.replace(f"{model_dir}/", "file:").replace(str(model_dir), "the load's files")
