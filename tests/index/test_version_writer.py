"""index.versions.version_writer.VersionWriter: the one writer of an index version — what it writes the
reader opens, and a failure anywhere before the publish leaves the previous version live and no
staging folder behind."""

from __future__ import annotations

import numpy as np
import pytest

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest
from core.data.items import ItemTable
from core.retrieval.vectors import l2_normalized
from index.search.faiss_index import build_index
from index.versions.version import IndexVersion
from index.versions.version_writer import VersionWriter


def write_version(root, vectors: np.ndarray, parent: str | None = None, fail: bool = False) -> str:
    n = len(vectors)
    with VersionWriter(root, keep=5) as writer:
        writer.write_index(build_index(vectors, "Flat", {}))
        writer.write_vectors(vectors)
        writer.write_deleted(np.zeros(0, np.int64))
        writer.write_items(ItemTable([f"id{i}" for i in range(n)], None, [f"/{i}.png" for i in range(n)], [{}] * n))
        if fail:
            raise RuntimeError("boom")
        index_id, version = writer.name_version()
        manifest = IndexManifest(
            index_id=index_id, version=version, model_id="m", size=n, dimension=vectors.shape[1], factory="Flat"
        )
        writer.publish(manifest, parent=parent)
    return version


def leftovers(root) -> list[str]:
    return [p.name for p in (root / artifacts.VERSIONS).iterdir() if p.name.startswith(".")]


def test_what_the_writer_writes_the_reader_opens(tmp_path):
    vectors = l2_normalized(np.random.default_rng(0).standard_normal((12, 8)))
    version = write_version(tmp_path, vectors)
    opened = IndexVersion.live(tmp_path).load(dim=8)
    assert opened.name == version and version.endswith(opened.manifest.index_id[:8])
    assert opened.manifest.index_id == artifacts.file_sha256(opened.directory / artifacts.INDEX_FILE)[:16]
    assert not (opened.directory / artifacts.DELETED_FILE).exists()  # no tombstones, no file
    np.testing.assert_array_equal(opened.vector(5), vectors[5])
    assert leftovers(tmp_path) == []


def test_a_failure_before_the_publish_leaves_the_previous_version_live(tmp_path):
    vectors = l2_normalized(np.random.default_rng(0).standard_normal((12, 8)))
    first = write_version(tmp_path, vectors)
    with pytest.raises(RuntimeError, match="boom"):
        write_version(tmp_path, vectors[:6], fail=True)
    # A version made from one that is no longer live is refused, and its folder removed too.
    with pytest.raises(artifacts.StaleParentError):
        write_version(tmp_path, vectors[:6], parent="20000101T000000000000-00000000")
    assert artifacts.current_version(tmp_path) == first and artifacts.list_versions(tmp_path) == [first]
    assert leftovers(tmp_path) == []
