"""Output folders and files: one guard, checked before any work, and one atomic write."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "atomic_write",
    "atomic_write_text",
    "check_output_file",
    "lock_folder",
    "prepare_output_dir",
    "remove_stale_temporaries",
    "stale_temporary",
]


def read_json(path: Path | Any, hint: str) -> Any:
    """The JSON value of the UTF-8 file ``path`` (a path or a package resource): a FileNotFoundError
    ``"{path} not found: {hint}"`` (``hint``: what was expected there) when it is no file, a ValueError
    naming the file when it is not JSON."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {hint}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def _writable_parent(path: Path, flag: str) -> None:
    """The nearest existing ancestor of ``path`` must be a folder we may write in."""
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {path}: {parent} is a file, so nothing can be written under it")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ValueError(f"{flag} {path}: the folder {parent} is not writable")
            return


def prepare_output_dir(
    path: str | os.PathLike,
    *,
    force: bool = False,
    reuse: bool = False,
    flag: str = "--out",
    ignore: Iterable[str] = (),
    create: bool = True,
    hint: str = "pass --force to overwrite it or pick another",
) -> Path:
    """Check an output folder before any work, and create it.

    Args:
        path: the folder.
        force: accept a non-empty folder (its files may be overwritten; default False).
        reuse: accept a non-empty folder to continue a run in it (default False).
        flag: the option the path came from, for the messages (default ``"--out"``).
        ignore: file names that do not make a folder "non-empty" (e.g. a run manifest).
        create: make the folder (default True).
        hint: what the refusal of a non-empty folder suggests (default: ``--force``).

    Returns:
        ``path`` as a Path. A ValueError says why it is refused: a file, a path under a
        file, an unwritable folder, or a non-empty folder without ``force`` / ``reuse``.
    """
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file; give a folder")
    _writable_parent(path, flag)
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path}: the folder is not writable")
        ignored = set(ignore)
        if not (force or reuse) and any(p.name not in ignored for p in path.iterdir()):
            raise FileExistsError(f"{flag} {path} exists and is not empty; {hint}")
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def check_output_file(path: str | os.PathLike, *, force: bool = False, flag: str = "--out") -> Path:
    """Check an output file before any work: refuses a folder, an existing file without
    ``force``, a path under a file and an unwritable folder (ValueError / FileExistsError)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    if path.exists() and not force:
        raise FileExistsError(f"{flag} {path} exists; pass --force to overwrite it")
    _writable_parent(path, flag)
    return path


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems (and Windows) cannot open a folder
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", **open_kwargs) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on success it is flushed, fsynced and
    renamed over ``path`` and the folder is fsynced, so a crash leaves the old file or the new
    one, never half of one. On an error the temporary file is removed; a failed write (a full
    disk, a file-size limit) is an OSError saying that ``path`` was left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644)
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        kept = "was left as it was" if path.exists() else "was not created"
        raise OSError(err.errno, f"could not write {path} ({err.strerror or err}); it {kept}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_write`)."""
    with atomic_write(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def stale_temporary(name: str, targets: Iterable[str]) -> bool:
    """Whether ``name`` is a temporary file :func:`atomic_write` makes for one of ``targets``
    (``.<target>.<random>.tmp``): what a process killed while writing leaves behind."""
    return any(re.fullmatch(rf"\.{re.escape(t)}\.[A-Za-z0-9_]+\.tmp", name) for t in targets)


def remove_stale_temporaries(folder: str | os.PathLike, targets: Iterable[str]) -> list[Path]:
    """Remove the temporary files of :func:`atomic_write` for ``targets`` in ``folder``; the removed paths.

    Only call it while no process may be writing those files (e.g. holding :func:`lock_folder`).
    """
    targets = list(targets)
    removed = []
    for path in Path(folder).iterdir():
        if path.is_file() and not path.is_symlink() and stale_temporary(path.name, targets):
            path.unlink()
            removed.append(path)
    return removed


@contextlib.contextmanager
def lock_folder(folder: str | os.PathLike, what: str = "a run") -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (the file ``.lock`` in it, kept afterwards) while inside:
    a second process asking for it gets a BlockingIOError at once. The operating system releases
    the lock when the process dies, however it dies."""
    path = Path(folder) / ".lock"
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BlockingIOError(
                f"another process is writing {what} in {folder} (it holds {path}); "
                "wait for it to end or choose another folder"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
