"""core.artifacts.layout: atomic publishing, manifests and the index CURRENT pointer.

The kill tests run a real writer process and SIGKILL it mid-write: whatever was published
before must still be there, complete and readable.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from core.artifacts import layout as artifacts
from core.artifacts.layout import (
    ArtifactError,
    current_version,
    file_sha256,
    index_staging_dir,
    list_versions,
    new_version_name,
    prune_versions,
    publish_directory,
    publish_version,
    read_manifest,
    set_current,
    staging_directory,
    version_dir,
    write_json_atomic,
)

REPO = Path(__file__).resolve().parents[2]


def write_artifact(directory: Path, tag: str, files: int = 3) -> None:
    for i in range(files):
        (directory / f"part-{i}.bin").write_text(f"{tag}:{i}")
    write_json_atomic(directory / artifacts.MANIFEST, {"tag": tag, "files": files})


def assert_artifact(directory: Path, tag: str, files: int = 3) -> None:
    assert read_manifest(directory) == {"tag": tag, "files": files}
    names = sorted(p.name for p in directory.iterdir())
    assert names == sorted([artifacts.MANIFEST, *(f"part-{i}.bin" for i in range(files))])
    for i in range(files):
        assert (directory / f"part-{i}.bin").read_text() == f"{tag}:{i}"


def siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def add_version(root: Path, name: str, make_current: bool = True) -> Path:
    staging = index_staging_dir(root)
    write_artifact(staging, name)
    return publish_version(root, staging, name, make_current=make_current)


# --- small pieces -------------------------------------------------------------------------------


def test_write_json_atomic(tmp_path):
    path = tmp_path / "m.json"
    write_json_atomic(path, {"b": 1, "a": Path("/x")})
    assert json.loads(path.read_text()) == {"a": "/x", "b": 1}
    assert path.read_text().index('"a"') < path.read_text().index('"b"')  # sorted keys
    write_json_atomic(path, [1, 2])
    assert json.loads(path.read_text()) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]  # no temporary left


def test_read_manifest_errors(tmp_path):
    with pytest.raises(ArtifactError, match="not a published artifact"):
        read_manifest(tmp_path)
    (tmp_path / artifacts.MANIFEST).write_text("{not json")
    with pytest.raises(ArtifactError, match="invalid JSON"):
        read_manifest(tmp_path)


def test_file_sha256(tmp_path):
    data = os.urandom(3 * 1024 + 7)
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f", chunk=1000) == hashlib.sha256(data).hexdigest()


def test_new_version_names_sort_in_creation_order():
    names = []
    for content in ("ffff0000", "0000ffff", "88888888"):
        names.append(new_version_name(content + "rest"))
        time.sleep(0.002)
    assert names == sorted(names)
    assert names[0].endswith("-ffff0000")


# --- staging_directory / publish_directory ---------------------------------------------------


def test_staging_directory_publishes_on_success(tmp_path):
    target = tmp_path / "model"
    with staging_directory(target) as staging:
        assert staging.parent == target.parent and staging != target
        assert not target.exists()  # nothing visible until the block finishes
        write_artifact(staging, "v1")
    assert_artifact(target, "v1")
    assert siblings(target) == []


def test_staging_directory_keeps_old_target_when_block_raises(tmp_path):
    target = tmp_path / "model"
    with staging_directory(target) as staging:
        write_artifact(staging, "old")
    with pytest.raises(RuntimeError, match="boom"), staging_directory(target) as staging:
        write_artifact(staging, "new", files=5)
        raise RuntimeError("boom")
    assert_artifact(target, "old")
    assert siblings(target) == []  # the staging directory was removed
    # BaseException (Ctrl-C) too.
    with pytest.raises(KeyboardInterrupt), staging_directory(target) as staging:
        write_artifact(staging, "new")
        raise KeyboardInterrupt
    assert_artifact(target, "old")
    assert siblings(target) == []


def test_staging_directory_failure_without_old_target_publishes_nothing(tmp_path):
    target = tmp_path / "deep" / "model"
    with pytest.raises(ValueError), staging_directory(target) as staging:
        write_artifact(staging, "x")
        raise ValueError
    assert not target.exists()
    assert list(target.parent.iterdir()) == []


def test_publish_directory_swaps_an_existing_directory(tmp_path):
    target = tmp_path / "t"
    target.mkdir()
    write_artifact(target, "old", files=5)
    (target / "only-in-old").mkdir()
    (target / "only-in-old" / "x").write_text("x")
    staging = tmp_path / ".t.staging"
    staging.mkdir()
    write_artifact(staging, "new", files=2)
    assert publish_directory(staging, target) == target
    assert_artifact(target, "new", files=2)  # no file of the old version survives
    assert not staging.exists()
    assert siblings(target) == []


# --- versions and CURRENT -------------------------------------------------------------------


def test_empty_root(tmp_path):
    assert list_versions(tmp_path) == []
    assert current_version(tmp_path) is None
    with pytest.raises(ArtifactError, match="no CURRENT pointer"):
        version_dir(tmp_path)
    (tmp_path / artifacts.CURRENT).write_text("\n")
    assert current_version(tmp_path) is None


def test_publish_version_and_current(tmp_path):
    root = tmp_path / "index"
    first = add_version(root, "v1")
    assert first == root / artifacts.VERSIONS / "v1"
    assert current_version(root) == "v1"
    assert version_dir(root) == first
    assert_artifact(version_dir(root), "v1")

    add_version(root, "v2", make_current=False)
    assert current_version(root) == "v1"
    assert list_versions(root) == ["v1", "v2"]
    set_current(root, "v2")
    assert current_version(root) == "v2"
    assert (root / artifacts.CURRENT).read_text() == "v2\n"
    assert version_dir(root, "v1") == first
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [artifacts.CURRENT, artifacts.LOCK_FILE, artifacts.VERSIONS]
    )

    staging = index_staging_dir(root)
    write_artifact(staging, "again")
    with pytest.raises(ArtifactError, match="already exists"):
        publish_version(root, staging, "v1")
    assert_artifact(first, "v1")


def test_a_version_made_from_a_parent_no_longer_live_is_not_published(tmp_path):
    root = tmp_path / "index"
    add_version(root, "v1")
    add_version(root, "v2")  # published meanwhile by another process
    staging = index_staging_dir(root)
    write_artifact(staging, "v3")
    with pytest.raises(artifacts.StaleParentError, match="changed from v1 to v2"):
        publish_version(root, staging, "v3", parent="v1")
    assert current_version(root) == "v2" and list_versions(root) == ["v1", "v2"]
    assert publish_version(root, staging, "v3", parent="v2") == root / artifacts.VERSIONS / "v3"
    assert current_version(root) == "v3"


def test_version_dir_errors(tmp_path):
    root = tmp_path
    add_version(root, "v1")
    with pytest.raises(ArtifactError, match="'v9' does not exist"):
        version_dir(root, "v9")
    (root / artifacts.VERSIONS / "half").mkdir()  # no manifest: incomplete
    (root / artifacts.VERSIONS / "half" / "index.faiss").write_bytes(b"")
    with pytest.raises(ArtifactError, match="incomplete"):
        version_dir(root, "half")
    assert list_versions(root) == ["v1"]
    for bad in ("", "../versions/v1", ".staging-x"):
        with pytest.raises(ArtifactError):
            version_dir(root, bad)
    (root / artifacts.CURRENT).write_text("gone\n")  # a pointer at a deleted version
    with pytest.raises(ArtifactError, match="'gone'"):
        version_dir(root)


def test_set_current_refuses_unknown_versions(tmp_path):
    add_version(tmp_path, "v1")
    with pytest.raises(ArtifactError):
        set_current(tmp_path, "v2")
    assert current_version(tmp_path) == "v1"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_list_versions_ignores_staging_directories(tmp_path):
    add_version(tmp_path, "v1")
    staging = index_staging_dir(tmp_path)
    write_artifact(staging, "in-progress")  # manifest written, not yet published
    assert list_versions(tmp_path) == ["v1"]
    assert prune_versions(tmp_path, 1) == []
    assert staging.is_dir()  # a concurrent build's staging directory is not pruned


def test_prune_keeps_newest_and_the_live_one(tmp_path):
    for name in ("v1", "v2", "v3", "v4", "v5"):
        add_version(tmp_path, name, make_current=False)
    set_current(tmp_path, "v2")
    with pytest.raises(ValueError):
        prune_versions(tmp_path, 0)
    assert prune_versions(tmp_path, 2) == ["v1", "v3"]
    assert list_versions(tmp_path) == ["v2", "v4", "v5"]
    assert_artifact(version_dir(tmp_path), "v2")
    assert prune_versions(tmp_path, 1) == ["v4"]
    assert list_versions(tmp_path) == ["v2", "v5"]
    assert prune_versions(tmp_path, 10) == []
    set_current(tmp_path, "v5")
    assert prune_versions(tmp_path, 1) == ["v2"]
    assert list_versions(tmp_path) == ["v5"]


def test_a_held_staging_folder_and_a_pinned_version_outlive_other_writers_turns(tmp_path):
    """A compaction stages and reads without the root's lock: while its process holds them, the
    next writer's turn removes neither its staging folder nor the version it reads; a staging
    folder no process holds is a dead writer's, and goes."""
    for name in ("v1", "v2"):
        add_version(tmp_path, name, make_current=name == "v1")
    dead = index_staging_dir(tmp_path)
    with artifacts.pinned_version(tmp_path) as pinned, artifacts.held_staging_dir(tmp_path) as staging:
        set_current(tmp_path, "v2")
        with artifacts.writer_lock(tmp_path):
            assert staging.is_dir() and not dead.exists()
        assert pinned == "v1" and prune_versions(tmp_path, 1) == []
    assert not staging.exists() and prune_versions(tmp_path, 1) == ["v1"]


# --- real SIGKILL mid-write ---------------------------------------------------------------------

WRITER_PRELUDE = """
import sys, time, itertools
from pathlib import Path
from core.artifacts import layout as artifacts
from core.artifacts.layout import *
ready = Path(sys.argv[1]); target = Path(sys.argv[2])
"""


def start_writer(tmp_path: Path, body: str, target: Path) -> tuple[subprocess.Popen, Path]:
    ready = tmp_path / f"ready-{time.monotonic_ns()}"
    code = WRITER_PRELUDE + textwrap.dedent(body)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(ready), str(target)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE,
    )
    return proc, ready


def kill_when_ready(proc: subprocess.Popen, ready: Path, extra_delay: float = 0.0) -> None:
    deadline = time.monotonic() + 120  # a bound on a hang: the writer starts as fast as Python can
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"writer exited early: {proc.stderr.read().decode()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("writer never became ready")
        time.sleep(0.005)
    time.sleep(extra_delay)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.stderr.close()


BIG_STAGING_WRITER = """
with staging_directory(target) as staging:
    write_json_atomic(staging / artifacts.MANIFEST, {"tag": "new", "files": 3})
    for i in itertools.count():
        (staging / f"part-{i}.bin").write_bytes(b"n" * 65536)
        if i == 40:
            ready.touch()
        if i > 1000:  # never finishes on its own: SIGKILL arrives mid-write
            time.sleep(60)
"""


def test_sigkill_mid_write_leaves_published_target_intact(tmp_path):
    target = tmp_path / "model"
    with staging_directory(target) as staging:
        write_artifact(staging, "old")
    proc, ready = start_writer(tmp_path, BIG_STAGING_WRITER, target)
    kill_when_ready(proc, ready)

    assert_artifact(target, "old")
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".model.staging-")]
    assert len(leftovers) == 1 and len(list(leftovers[0].iterdir())) > 40  # killed mid-write
    # The next run publishes normally despite the debris.
    with staging_directory(target) as staging:
        write_artifact(staging, "next")
    assert_artifact(target, "next")


BIG_INDEX_WRITER = """
staging = index_staging_dir(target)
write_json_atomic(staging / artifacts.MANIFEST, {"tag": "v2", "files": 3})
for i in itertools.count():
    (staging / f"part-{i}.bin").write_bytes(b"n" * 65536)
    if i == 40:
        ready.touch()
    if i > 1000:
        time.sleep(60)
publish_version(target, staging, "v2")
"""


def test_sigkill_mid_index_build_keeps_current_live(tmp_path):
    root = tmp_path / "index"
    add_version(root, "v1")
    proc, ready = start_writer(tmp_path, BIG_INDEX_WRITER, root)
    kill_when_ready(proc, ready)

    assert (root / artifacts.CURRENT).read_text() == "v1\n"
    assert current_version(root) == "v1"
    assert_artifact(version_dir(root), "v1")
    # The killed build's staging directory (manifest already written) is not a version.
    assert list_versions(root) == ["v1"]
    hidden = [p for p in (root / artifacts.VERSIONS).iterdir() if p.name.startswith(".")]
    assert len(hidden) == 1
    with pytest.raises(ArtifactError):
        version_dir(root, hidden[0].name)
    assert prune_versions(root, 1) == []
    add_version(root, "v3")
    assert current_version(root) == "v3" and list_versions(root) == ["v1", "v3"]


REPUBLISH_WRITER = """
for n in itertools.count():
    with staging_directory(target) as staging:
        for i in range(8):
            (staging / f"part-{i}.bin").write_text(f"{n}:{i}")
        write_json_atomic(staging / artifacts.MANIFEST, {"tag": str(n), "files": 8})
    if n == 5:
        ready.touch()
"""


@pytest.mark.parametrize("delay", [0.0, 0.013, 0.05])
def test_sigkill_during_repeated_publishing_never_exposes_a_partial_target(tmp_path, delay):
    target = tmp_path / "model"
    proc, ready = start_writer(tmp_path, REPUBLISH_WRITER, target)
    kill_when_ready(proc, ready, extra_delay=delay)
    manifest = read_manifest(target)
    assert int(manifest["tag"]) >= 5
    assert_artifact(target, manifest["tag"], files=8)


CURRENT_FLIPPER = """
for n in itertools.count():
    set_current(target, "v1" if n % 2 else "v2")
    if n == 50:
        ready.touch()
"""


def test_sigkill_while_switching_current(tmp_path):
    add_version(tmp_path, "v1")
    add_version(tmp_path, "v2")
    proc, ready = start_writer(tmp_path, CURRENT_FLIPPER, tmp_path)
    kill_when_ready(proc, ready, extra_delay=0.02)
    assert (tmp_path / artifacts.CURRENT).read_text() in ("v1\n", "v2\n")
    assert_artifact(version_dir(tmp_path), current_version(tmp_path))
