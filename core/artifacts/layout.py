"""Artifact directories: manifests, atomic publishing, and the index `CURRENT` pointer.

Every stage writes its artifact into a temporary directory beside the target and renames it
into place, so a reader never sees a half-written artifact and a crash leaves the previous
version live.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime as _dt
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
MODEL_FILE = "model.onnx"
INDEX_FILE = "index.faiss"
ITEMS_FILE = "items.parquet"
ID_LOOKUP_FILE = "ids.npy"  # the items' id hashes sorted and their rows: finds an id without reading the items
NEIGHBOURS_FILE = "neighbours.png"  # sample queries and their neighbours, to look at
EMBEDDINGS_FILE = "embeddings.npy"  # the exact vectors indexed, row for row
DELETED_FILE = "deleted.npy"  # rows removed but still in the index (HNSW tombstones), sorted
FILTERS_FILE = "filters.npz"  # the filterable fields' value → rows structure
SHARDS = "shards"  # a sharded index version's folder of shard folders (000/, 001/, ...)
SEGMENTS = "segments"  # a segmented version's (or shard's) folder of segment folders (000000/, ...)
TRAINED_FILE = "trained.faiss"  # a segmented IVF/PQ/SQ version's trained empty index, copied by new segments
CURRENT = "CURRENT"
LOCK_FILE = ".lock"  # flock'd around every switch of CURRENT that checks what it replaces
VERSIONS = "versions"


class ArtifactError(RuntimeError):
    """An artifact directory that is missing, incomplete or inconsistent."""


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_json_atomic(path: str | Path, data: Any) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"no {MANIFEST} in {directory}: not a published artifact")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: invalid JSON ({exc.msg})") from exc


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux renameat2(RENAME_EXCHANGE); False if unsupported."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return result == 0


def publish_directory(staging: Path, target: Path) -> Path:
    """Move a fully written staging directory to `target` in one atomic step.

    An existing target is swapped out atomically (renameat2 exchange) and then removed, so
    readers see either the old or the new directory, never a mix or nothing.
    """
    for child in staging.rglob("*"):
        if child.is_file():
            with open(child, "rb") as f:
                os.fsync(f.fileno())
    if not target.exists():
        os.rename(staging, target)
    elif _exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)
    else:  # pragma: no cover - non-Linux fallback with a brief window
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(target, old)
        os.rename(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(target.parent)
    return target


@contextlib.contextmanager
def staging_directory(target: str | Path) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; publish it there if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.staging-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_directory(staging, target)


# ---------------------------------------------------------------------------------------------
# Index roots: <root>/versions/<version>/ and <root>/CURRENT naming the live one.


def new_version_name(content_id: str) -> str:
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S%f")
    return f"{stamp}-{content_id[:8]}"


def list_versions(root: str | Path) -> list[str]:
    versions = Path(root) / VERSIONS
    if not versions.is_dir():
        return []
    # Hidden entries are staging directories of builds in progress (or killed mid-write).
    return sorted(
        p.name for p in versions.iterdir() if not p.name.startswith(".") and p.is_dir() and (p / MANIFEST).is_file()
    )


def current_version(root: str | Path) -> str | None:
    pointer = Path(root) / CURRENT
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    return name or None


def version_dir(root: str | Path, version: str | None = None) -> Path:
    """The directory of `version`, or of the live version when None."""
    root = Path(root)
    if version is None:
        version = current_version(root)
        if version is None:
            raise ArtifactError(f"{root}: no {CURRENT} pointer; no index has been published here")
    if not version or version.startswith(".") or "/" in version or "\\" in version:
        raise ArtifactError(f"{root}: {version!r} is not a version name")
    path = root / VERSIONS / version
    if not (path / MANIFEST).is_file():
        raise ArtifactError(f"{root}: version {version!r} does not exist or is incomplete")
    return path


def _looks_like(directory: Path) -> str:
    """What an artifact directory that is not an index root seems to be, for an error message."""
    if (directory / MODEL_FILE).is_file():
        return f" (it looks like a model folder: it holds {MODEL_FILE})"
    if (directory / INDEX_FILE).is_file():
        return f" (it looks like one index version: its index root is {directory.parent.parent})"
    if directory.name == VERSIONS and (directory.parent / CURRENT).is_file():
        return f" (it looks like an index root's {VERSIONS}/ folder: the root is {directory.parent})"
    return ""


def check_index_root(root: str | Path) -> None:
    """ArtifactError unless `root` is an index root holding a version or a CURRENT pointer:
    `index list` printed nothing, and a server answered 503 for ever, when pointed at a model
    folder by mistake."""
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"index root not found: {root}")
    if current_version(root) is None and not list_versions(root):
        raise ArtifactError(
            f"{root} holds no index versions{_looks_like(root)}; an index root holds {VERSIONS}/ and "
            f"{CURRENT}, written by `python -m index build --index-root {root}`"
        )


def set_current(root: str | Path, version: str) -> None:
    """Point CURRENT at `version` with one atomic rename."""
    version_dir(root, version)
    root = Path(root)
    tmp = root / f".{CURRENT}.{uuid.uuid4().hex[:8]}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        f.write(version + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / CURRENT)
    _fsync_dir(root)


class StaleParentError(ArtifactError):
    """A version made from the live one lost a race: CURRENT moved on while it was being written."""


@contextlib.contextmanager
def current_lock(root: str | Path) -> Iterator[None]:
    """An exclusive lock on the root's CURRENT for a check-and-switch, between processes (flock)."""
    with open(Path(root) / LOCK_FILE, "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


WRITER_LOCK = ".writer.lock"  # in the index root: flock'd by the one process writing a version
WRITER_WAIT_S = 120.0  # how long a second writer waits its turn before it is refused
_held_writer_locks: dict[tuple[str, int], int] = {}  # (root, thread) → depth: nested steps hold the lock once
_held_writer_guard = threading.Lock()


class WriterBusyError(ArtifactError):
    """Another process has been writing a version of the root for longer than the wait."""


@contextlib.contextmanager
def writer_lock(root: str | Path, wait_s: float = WRITER_WAIT_S) -> Iterator[None]:
    """The root's one writer: read the live version, write a version made from it and publish,
    while no other process does (flock, released by the kernel when its holder dies, kill -9
    included). A second writer waits its turn, up to `wait_s` (`WriterBusyError` naming the
    holder after), rather than publishing from a parent that is no longer live; once it holds
    the lock, staging folders left by writers that died are removed. Re-entrant in a thread (two
    threads of a process take turns, as two processes do)."""
    key = (str(Path(root).resolve()), threading.get_ident())
    with _held_writer_guard:
        depth = _held_writer_locks.get(key, 0)
        if depth:
            _held_writer_locks[key] = depth + 1
    if depth:
        try:
            yield
        finally:
            with _held_writer_guard:
                _held_writer_locks[key] -= 1
        return
    Path(root).mkdir(parents=True, exist_ok=True)
    with open(Path(root) / WRITER_LOCK, "a+") as lock:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    lock.seek(0)
                    holder = lock.read().strip() or "another process"
                    raise WriterBusyError(
                        f"{root}: another writer ({holder}) has held the index root for more than {wait_s:.0f} s; "
                        "try again once it has published"
                    ) from None
                time.sleep(0.05)
        try:
            lock.seek(0)
            lock.truncate()
            lock.write(f"pid {os.getpid()}")
            lock.flush()
            _remove_dead_staging(root)
            with _held_writer_guard:
                _held_writer_locks[key] = 1
            yield
        finally:
            with _held_writer_guard:
                _held_writer_locks.pop(key, None)
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _remove_dead_staging(root: str | Path) -> None:
    """Staging folders under versions/ that no process holds (`held_staging_dir`): left by
    writers that died. A compaction stages without the root's lock, and keeps its folder."""
    versions = Path(root) / VERSIONS
    if versions.is_dir():
        for stale in versions.glob(".staging-*"):
            _remove_unless_held(stale)


def _remove_unless_held(folder: Path) -> bool:
    """Remove `folder` unless a process holds a flock on it (its writer, or a reader that pinned
    it): True when removed. The exclusive flock is held while it goes, so a process that takes
    its own after finds it gone."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(folder, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def _held(folder: Path, operation: int) -> int | None:
    """A descriptor of `folder` holding flock `operation` on it, or None when the folder went (or
    was removed while this waited for the lock: `_remove_unless_held` holds it while it removes)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, operation)
    try:
        if os.path.samestat(os.fstat(fd), os.stat(folder)) and not _emptied(folder):
            return fd
    except FileNotFoundError:
        pass
    os.close(fd)
    return None


def _emptied(folder: Path) -> bool:
    """A version folder whose manifest is gone: pruned (its removal may have stopped short)."""
    return folder.parent.name == VERSIONS and not folder.name.startswith(".") and not (folder / MANIFEST).is_file()


@contextlib.contextmanager
def held_staging_dir(root: str | Path) -> Iterator[Path]:
    """A fresh staging directory inside the index root, flock'd by this process until the block
    ends and removed then (once published it is renamed away). A writer taking the root's lock
    removes only staging folders no process holds: a compaction writes its segments here
    without the root's lock, and one killed (kill -9 too) leaves nothing behind the next writer."""
    for _ in range(PIN_ATTEMPTS):
        staging = index_staging_dir(root)
        fd = _held(staging, fcntl.LOCK_EX)
        if fd is not None:
            break
    else:
        raise ArtifactError(f"{root}: staging folders were removed as fast as they were made")
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(fd)


PIN_ATTEMPTS = 5  # a version pinned (or a staging folder held) as it is removed is sought again


@contextlib.contextmanager
def pinned_version(root: str | Path) -> Iterator[str]:
    """The live version's name, which `prune_versions` leaves in place until the block ends (a
    shared flock on its folder): a compaction reads it without the root's lock while other
    writers publish and prune. CURRENT is read again if it moved on and its version was pruned
    before the pin took."""
    for _ in range(PIN_ATTEMPTS):
        name = current_version(root)
        if name is None:
            raise ArtifactError(f"{root}: no {CURRENT} pointer; no index has been published here")
        fd = _held(Path(root) / VERSIONS / name, fcntl.LOCK_SH)
        if fd is not None:
            break
    else:
        raise ArtifactError(f"{root}: the live version was pruned {PIN_ATTEMPTS} times before it could be read")
    try:
        yield name
    finally:
        os.close(fd)


def publish_version(
    root: str | Path, staging: Path, version: str, make_current: bool = True, parent: str | None = None
) -> Path:
    """Rename a written staging directory into root/versions/<version> and switch CURRENT.
    `parent`: the version it was made from (add, remove), which must still be live — else
    `StaleParentError` and nothing is published: switching would drop whatever the version
    published meanwhile changed (a takedown undone by an add that started before it)."""
    versions = Path(root) / VERSIONS
    versions.mkdir(parents=True, exist_ok=True)
    target = versions / version
    with current_lock(root):
        if parent is not None and (live := current_version(root)) != parent:
            raise StaleParentError(f"{root}: the live version changed from {parent} to {live} meanwhile")
        if target.exists():
            raise ArtifactError(f"version {version} already exists in {root}")
        publish_directory(staging, target)
        if make_current:
            set_current(root, version)
    return target


def index_staging_dir(root: str | Path) -> Path:
    """A fresh staging directory inside the index root (same filesystem, so rename is atomic)."""
    versions = Path(root) / VERSIONS
    versions.mkdir(parents=True, exist_ok=True)
    staging = versions / f".staging-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    return staging


def prune_versions(root: str | Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` versions; the live one is always kept, and so is one a
    compaction is reading (`pinned_version`) until it is done."""
    if keep < 1:
        raise ValueError("keep must be at least 1")
    live = current_version(root)
    versions = list_versions(root)
    doomed = [v for v in versions[:-keep] if v != live]
    return [v for v in doomed if _remove_unless_held(Path(root) / VERSIONS / v)]
