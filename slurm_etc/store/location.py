"""Where job records live: node-local SQLite files, a shared state directory of snapshots.

Coordinators run on compute nodes; users run ``slurm-etc status`` on login nodes, with a
network filesystem (NFS, Lustre, GPFS, ...) between them. SQLite's WAL does not work there
and its locking is unreliable, so a job's live database stays on node-local disk, written
only by its coordinator, and is published into the shared state directory as an atomic
snapshot after every committed change (``snapshot.py``).

The filesystem check is a pure function over the text of ``/proc/self/mountinfo``.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Mapping

from ..errors import InputError

ENV_STATE_DIR = "SLURM_ETC_STATE_DIR"

# Filesystems where SQLite's locking or WAL cannot be trusted: remote, clustered or FUSE.
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb", "smb2", "smb3", "smbfs", "ceph",
    "glusterfs", "beegfs", "afs", "openafs", "9p", "panfs", "wekafs", "pvfs2", "orangefs",
    "ocfs2", "gfs2", "davfs", "ncpfs", "coda", "cvfs", "quobyte", "fuse",
})
# FUSE filesystems that are local (a rootless container's root, lxcfs's /proc views).
LOCAL_FUSE_TYPES = frozenset({"fuse.fuse-overlayfs", "fuse.lxcfs", "fuse.squashfuse"})

_JOB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
_ESCAPE = re.compile(r"\\([0-7]{3})")


class LocationError(InputError, ValueError):
    """A path the store must not use, with why and what to use instead (one line)."""


def check_job_id(job_id: str) -> str:
    """A job id usable as a file name: letters, digits, ``._-``, at most 64, no leading dot.

    Raises:
        LocationError: anything else.
    """
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise LocationError(f"invalid job id {job_id!r}: use 1-64 letters, digits, '.', '_' "
                            "or '-', not starting with '.' or '-'")
    return job_id


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """``(mount point, filesystem type)`` of every line of a ``/proc/self/mountinfo`` text,
    in order (a later mount at the same point shadows an earlier one). Malformed lines are
    skipped; octal escapes (``\\040`` for a space) are decoded."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) <= sep + 1:
            continue
        point = _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        mounts.append((point, fields[sep + 1]))
    return mounts


def filesystem_type(path: str, mountinfo: str) -> str | None:
    """The filesystem type of the mount holding ``path`` (absolute, symlinks resolved),
    from a mountinfo text; None when no mount covers it."""
    best: tuple[int, str] | None = None
    for point, fstype in parse_mountinfo(mountinfo):
        root = point.rstrip("/") or "/"
        inside = root == "/" or path == root or path.startswith(root + "/")
        if inside and (best is None or len(root) >= best[0]):
            best = (len(root), fstype)
    return best[1] if best else None


def is_network_fs(fstype: str | None) -> bool:
    """Whether SQLite must not write on a filesystem of this type."""
    if not fstype:
        return False
    if fstype in LOCAL_FUSE_TYPES:
        return False
    base = fstype.split(".", 1)[0]
    return fstype in NETWORK_FS_TYPES or base in NETWORK_FS_TYPES


def network_fs_refusal(path: str, mountinfo: str) -> str | None:
    """Why a SQLite file at ``path`` must not be written (one line), or None if it may."""
    fstype = filesystem_type(path, mountinfo)
    if not is_network_fs(fstype):
        return None
    return (f"refusing to write the SQLite database {path}: it is on a network filesystem "
            f"({fstype}), where SQLite's locking and WAL do not work and the file can be "
            "corrupted; keep it on node-local disk (the default: $SLURM_TMPDIR or /tmp, "
            "published to the state directory for `slurm-etc status`) or give a server URL "
            "(--db mysql+pymysql://user@host/db or postgresql://user@host/db)")


def _mountinfo() -> str | None:
    try:
        return Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None


def _resolved(path: Path) -> str:
    """``path`` absolute with symlinks resolved, as far as it exists."""
    existing = Path(path).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    rest = Path(path).absolute().relative_to(existing)
    return str(Path(os.path.realpath(existing)) / rest)


def on_network_fs(path: Path, mountinfo: str | None = None) -> bool:
    """Whether ``path`` lies on a network filesystem (unknown mount table: no)."""
    mountinfo = _mountinfo() if mountinfo is None else mountinfo
    return bool(mountinfo) and is_network_fs(filesystem_type(_resolved(path), mountinfo or ""))


def check_writable_location(path: Path, mountinfo: str | None = None) -> None:
    """Refuse a SQLite file on a network filesystem.

    Args:
        path: the database file (it and its directory may not exist yet).
        mountinfo: the mount table; default ``/proc/self/mountinfo`` (unknown: allowed).

    Raises:
        LocationError: the path is on a network filesystem.
    """
    mountinfo = _mountinfo() if mountinfo is None else mountinfo
    if not mountinfo:
        return
    refusal = network_fs_refusal(_resolved(path), mountinfo)
    if refusal:
        raise LocationError(refusal)


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$SLURM_ETC_STATE_DIR``, else ``$XDG_DATA_HOME/slurm-etc/jobs``
    (``~/.local/share/slurm-etc/jobs``): where snapshots are published and read."""
    env = os.environ if env is None else env
    if env.get(ENV_STATE_DIR):
        return Path(env[ENV_STATE_DIR]).expanduser()
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base).expanduser() / "slurm-etc" / "jobs"


def default_local_db(job_id: str, env: Mapping[str, str] | None = None,
                     uid: int | None = None) -> Path:
    """The live database of a job on node-local disk: ``$SLURM_TMPDIR/slurm-etc/<job>.db``,
    else ``<tmp>/slurm-etc-<uid>/jobs/<job>.db`` (``<tmp>``: ``$TMPDIR`` or ``/tmp``)."""
    env = os.environ if env is None else env
    check_job_id(job_id)
    if env.get("SLURM_TMPDIR"):
        return Path(env["SLURM_TMPDIR"]) / "slurm-etc" / f"{job_id}.db"
    uid = os.getuid() if uid is None else uid
    tmp = env.get("TMPDIR") or tempfile.gettempdir()
    return Path(tmp) / f"slurm-etc-{uid}" / "jobs" / f"{job_id}.db"


def user_state_dir(state_dir: Path, uid: int | None = None) -> Path:
    """``<state dir>/<uid>``: where one user's snapshots live. Only that user can write it
    (:func:`open_private_dir`), so nobody publishes a job name there first (Slurm job ids
    are predictable)."""
    return Path(state_dir) / str(os.getuid() if uid is None else uid)


def snapshot_path(state_dir: Path, job_id: str, uid: int | None = None) -> Path:
    """The published snapshot of a job: ``<state dir>/<uid>/<job>.db``."""
    return user_state_dir(state_dir, uid) / f"{check_job_id(job_id)}.db"


# Opening a file to read what someone else may have written: never follow a symlink, never
# block on a FIFO, never leak the descriptor into a child.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_private_dir(path: Path, *, create: bool = True, uid: int | None = None) -> int:
    """A descriptor of the directory ``path``, checked on that descriptor: a directory (not
    a symlink), owned by ``uid`` (default: the real uid), writable by nobody else. Created
    0700 when missing (its parent must exist). Files in it are then opened and renamed
    relative to the descriptor, so swapping the path afterwards changes nothing.

    Raises:
        FileNotFoundError, PermissionError: (``create=False`` only) missing, or not ours to
            open.
        LocationError: not a directory, owned by someone else or writable by group or others.
    """
    uid = os.getuid() if uid is None else uid
    path = Path(path)
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise LocationError(f"cannot create the directory {path}: {exc.strerror}") from None
    try:
        fd = os.open(path, _DIR_FLAGS)
    except (FileNotFoundError, PermissionError) as exc:
        if create:
            raise LocationError(f"cannot open the directory {path}: {exc.strerror}") from None
        raise
    except OSError as exc:
        raise LocationError(f"{path} is not a directory we can use (a symlink or a file is "
                            f"in the way?): {exc.strerror}") from None
    st = os.fstat(fd)
    problem = None
    if st.st_uid != uid:
        problem = f"belongs to uid {st.st_uid}, not to uid {uid}"
    elif stat.S_IMODE(st.st_mode) & 0o022:
        problem = f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem:
        os.close(fd)
        raise LocationError(f"{path} {problem}: anyone could put files there in your name; "
                            "remove it (ask an admin in a shared directory) or choose "
                            "another location")
    return fd


@dataclass(frozen=True)
class OpenedFile:
    """A regular file opened for reading, with the ``fstat`` of that very descriptor: the
    owner and size are those of the bytes read, whatever the path names afterwards."""

    fd: int
    name: str
    owner: int
    size: int

    def read_into(self, out: BinaryIO, limit: int) -> int:
        """Copy the file (at most ``limit`` bytes, else LocationError) from the descriptor
        into ``out``; returns the bytes copied."""
        done = 0
        while True:
            chunk = os.read(self.fd, min(_CHUNK, limit + 1 - done))
            if not chunk:
                return done
            done += len(chunk)
            if done > limit:
                raise LocationError(f"{self.name} grew past {limit} bytes while read")
            out.write(chunk)

    def close(self) -> None:
        os.close(self.fd)


_CHUNK = 1 << 20


def open_owned(name: str, *, dir_fd: int | None = None,
               allowed: Callable[[int], bool] | None = None,
               max_bytes: int | None = None) -> OpenedFile | None:
    """Open ``name`` (relative to ``dir_fd`` when given) without following a symlink and
    check the descriptor: a regular file, an owner ``allowed`` accepts (default: the real
    uid only), at most ``max_bytes``.

    Returns:
        The opened file, or None when its owner is not allowed (closed again, nothing read).

    Raises:
        FileNotFoundError, PermissionError: it does not exist, or the caller may not read it.
        LocationError: a symlink, not a regular file, too large, or unreadable.
    """
    me = os.getuid()
    allowed = allowed or (lambda uid: uid == me)
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except (FileNotFoundError, PermissionError):
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LocationError(f"{name} is a symlink; refusing to follow it") from None
        raise LocationError(f"cannot open {name}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LocationError(f"{name} is not a regular file")
        if not allowed(st.st_uid):
            os.close(fd)
            return None
        if max_bytes is not None and st.st_size > max_bytes:
            raise LocationError(f"{name} is {st.st_size} bytes, more than the {max_bytes} "
                                "a job record may have")
        os.set_blocking(fd, True)
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise
    return OpenedFile(fd, str(name), st.st_uid, st.st_size)


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) owner-only (0700); refuse one that exists but is a
    symlink, is not a directory, or belongs to someone else (another user could have made
    ``/tmp/slurm-etc-<uid>`` first).

    Raises:
        LocationError: the directory cannot be created or is not safely ours.
    """
    path = Path(path)
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise LocationError(f"cannot create the directory {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise LocationError(f"{path} is not a directory (a symlink or file is in the way); "
                            "remove it or choose another location")
    if st.st_uid != os.getuid():
        raise LocationError(f"{path} belongs to uid {st.st_uid}, not to you "
                            f"(uid {os.getuid()}); remove it or choose another location")
    # A directory we create is owner-only; one that was there (e.g. /tmp, a shared project
    # directory) keeps its mode: the files in it are created 0600.
    if not existed and stat.S_IMODE(st.st_mode) & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:
            raise LocationError(f"cannot make {path} owner-only: {exc.strerror}") from None
    return path


def private_file(path: Path, mode: int = 0o600) -> None:
    """Create ``path`` empty with ``mode`` (default owner-only 0600, whatever the umask) if
    it does not exist, so that SQLite (which gives its journal and WAL files the database's
    mode) never widens it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except FileExistsError:
        return
    except OSError as exc:
        raise LocationError(f"cannot create {path}: {exc.strerror}") from None
    try:
        os.fchmod(fd, mode)  # exactly this mode, whatever the umask
    finally:
        os.close(fd)
