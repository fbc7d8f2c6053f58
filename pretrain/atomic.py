"""Atomic file writes: every file the project writes takes its real name only once it is complete."""
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def temporary_name(target: str | os.PathLike) -> Path:
    """Where `target` is written before it is complete: beside it (a rename stays on one file system), hidden,
    and per process (two writers never share one)."""
    target = Path(target)
    return target.with_name(f".{target.name}.tmp{os.getpid()}")


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a rename is durable once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str | os.PathLike, target: str | os.PathLike, durable: bool = False) -> None:
    """Rename the finished file `tmp` onto `target`; durable: its bytes first, then the directory entry, on disk
    (what a checkpoint needs to survive a power cut, not only a crash)."""
    if durable:
        fsync_path(tmp)
    os.replace(tmp, target)
    if durable:
        fsync_path(Path(target).parent)


@contextmanager
def replacing(target: str | os.PathLike, durable: bool = False) -> Iterator[Path]:
    """A temporary path beside `target` for the block to write; published onto `target` when the block ends,
    removed (and `target` left as it was) when it raises."""
    tmp = temporary_name(target)
    try:
        yield tmp
        publish(tmp, target, durable)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomically(target: str | os.PathLike, data: str | bytes, durable: bool = False) -> Path:
    """`data` (text or bytes) as the whole of `target`, which readers see old or new, never in part."""
    target = Path(target)
    with replacing(target, durable) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
    return target


@contextmanager
def publishing_directory(target: str | os.PathLike) -> Iterator[Path]:
    """A new, hidden directory for the block to write the files of the directory `target` into, published together
    when the block ends: renamed onto `target` where there is none yet, else each file renamed into `target` (staged
    inside it, on its file system) beside the files it holds. When the block raises, the staged files are removed and
    `target` is left as it was: the block's files arrive all together or not at all."""
    target = Path(target)
    exists = target.is_dir()
    staging = temporary_name(target / "staging" if exists else target)
    staging.mkdir(parents=True)
    try:
        yield staging
        if exists:
            for path in sorted(staging.iterdir()):
                os.replace(path, target / path.name)
        else:
            os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
