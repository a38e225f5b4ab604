"""Writing files all at once: ``write_atomic`` (a temporary, then one rename; devices and FIFOs
in place), the folders on the way (``make_folders``) and each rank's file name under torchrun
(``rank_path``). A shared leaf: the record's ``save()``, the reports and the commands write
through it."""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from typing import Iterable, Union

__all__ = ["check_output_path", "write_atomic", "rank_path", "launcher_rank", "make_folders"]


def check_output_path(path) -> None:
    """Raise ValueError for a path that cannot name a file: one ending in a path separator
    (``newdir/``) asks for a directory, and writing a file named ``newdir`` would surprise."""
    name = os.fspath(path)
    if name.endswith(tuple(s for s in (os.sep, os.altsep) if s)):
        raise ValueError(f"{name!r} ends in a path separator, so it names a directory; expected a "
                         f"file name such as {os.path.join(name, 'report.json')!r}")


def write_atomic(path, text: Union[str, Iterable[str]], *, regular_only: bool = False) -> None:
    """Write ``text`` (a string, bytes, or an iterable of string chunks) to ``path`` all at once.

    For a regular file (or a new one) the text goes to a temporary file in the same directory,
    is flushed to disk, and then replaces the file in one ``os.replace``. If anything fails on
    the way (a chunk iterator raising, a full disk) the temporary file is removed and the file
    is left as it was. The text is written exactly as given (UTF-8, no newline translation).

    A symbolic link is followed: the file it points to is the one replaced (or created, for a
    dangling link), and the link stays a link. A path that exists and is not a regular file
    (a character device such as ``/dev/null``, a FIFO, ``/dev/stdout``) is written in place,
    never renamed over: the whole text is rendered first, then written, and a failed write
    (``ENOSPC`` on ``/dev/full``) raises ``OSError``. A directory raises ``IsADirectoryError``.
    ``regular_only=True`` raises ``OSError`` for such a path instead of opening it: a FIFO with
    no reader would block the open forever (``Ledger(save_to=)`` inside a training step).

    The temporary is named ``.<name>.torchledger-<pid>.<random>.tmp``. A write killed
    outright (SIGKILL, power loss) leaves one behind; the next write to the same file
    removes those whose process is gone. A path ending in a separator raises
    ``IsADirectoryError``.

    Known limitations: the new file gets the old file's permission bits if it existed, else
    the process umask's defaults; ownership and extended attributes are not carried over.
    Stale temporaries are only recognised on POSIX (where a pid can be probed safely).
    """
    path = os.fspath(path)
    try:
        check_output_path(path)
    except ValueError as e:
        raise IsADirectoryError(errno.EISDIR, str(e), path) from None
    chunks = [text] if isinstance(text, (str, bytes, bytearray)) else text
    try:
        st = os.stat(path)                      # follows links: what a write would reach
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        if regular_only:
            raise OSError(errno.EINVAL, f"{path} is {_kind(st.st_mode)}, not a regular file; expected a file "
                                        f"path (a FIFO or device would be written in place, and a FIFO "
                                        f"with no reader blocks)", path)
        _write_in_place(path, chunks)
        return
    target = os.path.realpath(path)             # a link's target is replaced, not the link
    directory = os.path.dirname(target)
    if not os.path.isdir(directory or "."):    # else mkstemp's error names the temporary
        # NB: a dangling link's folder is its target's, not the link's (which exists)
        linked = os.path.islink(path)
        folder = directory if linked else os.path.dirname(path) or directory
        link = f"{path} is a link to {target}, and " if linked else ""
        raise FileNotFoundError(errno.ENOENT, f"{link}the folder {folder} does not exist; create it first "
                                f"(mkdir -p) or write elsewhere", path)
    _remove_stale_temporaries(directory, os.path.basename(target))
    fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(os.path.basename(target))}{os.getpid()}.",
                               suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            for chunk in chunks:
                fh.write(_encode(chunk))
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def make_folders(path, who: str = "write") -> None:
    """Create the folders above file ``path`` that are missing (``mkdir -p``; another process
    making them at the same time is fine). One that cannot be made (a file in the way, no
    permission) raises ``OSError`` naming that folder and ``who`` asked, not a temporary file."""
    folder = os.path.dirname(os.fspath(path))
    if not folder or os.path.isdir(folder):
        return
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise type(e)(e.errno, f"{who}: cannot create the folder {folder} ({e.strerror or e}); "
                               f"expected a folder path that can be made, or an existing folder", folder) from None


def _temp_prefix(name: str) -> str:
    return f".{name}.torchledger-"


def _remove_stale_temporaries(directory: str, name: str) -> None:
    """Remove this tool's temporaries for ``name`` whose writing process no longer exists.

    Only regular files named ``.<name>.torchledger-<pid>.<random>.tmp`` are touched, and
    only when ``<pid>`` is not a live process (a live one, ours included, may be writing).
    Failures are ignored: cleaning up is a courtesy, never a reason to fail the write.
    """
    if os.name != "posix":                  # NB: os.kill(pid, 0) would terminate it on Windows
        return
    prefix = _temp_prefix(name)
    try:
        entries = [e for e in os.scandir(directory or ".")
                   if e.name.startswith(prefix) and e.name.endswith(".tmp")]   # ...<pid>.<random>.tmp
    except OSError:
        return
    for entry in entries:
        pid, dot, rest = entry.name[len(prefix):].partition(".")
        if not (pid.isdigit() and dot and len(rest) > len(".tmp")) or _alive(int(pid)):
            continue
        try:
            if entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    if pid <= 0 or pid == os.getpid():     # not a pid this tool writes, or our own
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):     # someone else's process, or odd
        return True
    return True


def _encode(chunk) -> bytes:
    return bytes(chunk) if isinstance(chunk, (bytes, bytearray)) else chunk.encode("utf-8")


def _write_in_place(path: str, chunks) -> None:
    """Write to a device, FIFO or other non-regular file: no temp file, no rename, no create.

    The text is rendered in full before the file is opened, so a failing renderer writes
    nothing. ``O_WRONLY`` without ``O_CREAT``: should the node vanish meanwhile, this fails
    rather than leave a regular file in its place.
    """
    data = b"".join(_encode(c) for c in chunks)
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            if n <= 0:                          # pragma: no cover - os.write raises instead
                raise OSError(errno.EIO, os.strerror(errno.EIO), path)
            view = view[n:]
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def _mode_for(path: str) -> int:
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def launcher_rank():
    """``(rank, world_size)`` from the environment torchrun (``torch.distributed.run``) sets
    for each of several ranks, else None (one process, or a simulated world in one process)."""
    import os
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return (rank, world) if world > 1 and 0 <= rank < world else None


def rank_path(path, rank: int, world_size: int) -> str:
    """Where rank ``rank`` writes its record, so that ranks never overwrite each other.

    ``{rank}`` in ``path`` becomes the rank (``run/rank{rank}.json``); an existing folder
    gets ``rank{r}.json`` in it; otherwise, with ``world_size > 1``, ``.rank{r}`` goes before
    the extension (``step.json`` -> ``step.rank1.json``); one process keeps ``path`` as it is.
    """
    import os
    path = os.fspath(path)
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if os.path.isdir(path) or path.endswith(tuple(s for s in (os.sep, os.altsep) if s)):
        return os.path.join(path, f"rank{rank}.json")
    if world_size <= 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"
