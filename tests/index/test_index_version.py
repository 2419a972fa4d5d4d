"""index.versions.version.IndexVersion: a published version opened, its files read when first used."""

from __future__ import annotations

import numpy as np
import pytest

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest
from core.artifacts.layout import ArtifactError
from core.data.items import ItemTable
from core.retrieval.vectors import l2_normalized
from index.search.faiss_index import build_index
from index.versions.version import IndexVersion
from index.versions.version_writer import VersionWriter


def publish(root, vectors: np.ndarray, factory: str = "Flat") -> str:
    n = len(vectors)
    with VersionWriter(root, keep=5) as writer:
        writer.write_index(build_index(vectors, factory, {}))
        writer.write_vectors(vectors)
        writer.write_items(ItemTable([f"id{i}" for i in range(n)], None, [f"/{i}.png" for i in range(n)], [{}] * n))
        index_id, version = writer.name_version("0123456789abcdef")
        writer.publish(
            IndexManifest(
                index_id=index_id, version=version, model_id="m", size=n, dimension=vectors.shape[1], factory=factory
            )
        )
    return version


def test_a_version_opened_gives_its_files_and_a_row_s_exact_vector(tmp_path):
    assert IndexVersion.live(tmp_path) is None
    vectors = l2_normalized(np.random.default_rng(0).standard_normal((20, 8)))
    version = publish(tmp_path, vectors)
    opened = IndexVersion.live(tmp_path).load(dim=8)
    assert opened.name == version == opened.manifest.version and opened.manifest.schema_version == 1
    assert opened.index.ntotal == len(opened.items) == len(opened.vectors) == 20
    row = opened.vector(3)
    np.testing.assert_array_equal(row, vectors[3])
    assert not np.shares_memory(row, opened.vectors)  # a copy, not a view into the memory map
    np.testing.assert_allclose(opened.exact_scores(vectors[3]), vectors @ vectors[3], atol=1e-6)
    assert opened.read_index() is not opened.index  # `index add` extends a copy of its own
    with pytest.raises(ArtifactError, match="model dim 16"):
        IndexVersion.open(tmp_path, version).load(dim=16)


def test_a_missing_or_damaged_file_is_named(tmp_path):
    version = publish(tmp_path, l2_normalized(np.random.default_rng(0).standard_normal((5, 4))))
    directory = artifacts.version_dir(tmp_path, version)
    (directory / artifacts.ITEMS_FILE).unlink()
    (directory / artifacts.EMBEDDINGS_FILE).write_bytes(b"\x00garbage")
    opened = IndexVersion.open(tmp_path)
    with pytest.raises(ArtifactError, match="items.parquet is missing"):
        opened.load()
    with pytest.raises(ArtifactError, match="embeddings.npy is damaged"):
        _ = opened.vectors


@pytest.mark.parametrize("factory", ["Flat", "IVF4,PQ4", "HNSW8"])
def test_a_served_index_is_mapped_from_its_file_and_a_copy_of_its_own_can_be_emptied(tmp_path, factory):
    """The index a version searches is memory-mapped (its codes in the page cache, shared by every
    process and version mapping the file), answering as the index read whole does; a copy of its
    own (`mapped=False`) is what may be changed — emptied to copy its training — since faiss
    aborts the process on any change to a mapped index."""
    vectors = l2_normalized(np.random.default_rng(1).standard_normal((400, 8)))
    publish(tmp_path, vectors, factory)
    opened = IndexVersion.live(tmp_path).load(dim=8)
    index_file = str((opened.directory / artifacts.INDEX_FILE).resolve())
    with open("/proc/self/maps") as maps:
        assert index_file in maps.read()
    own = opened.read_index(mapped=False)
    np.testing.assert_array_equal(opened.index.search(vectors[:20], 5)[1], own.search(vectors[:20], 5)[1])
    own.reset()  # a copy of its own: changing it is safe
    assert own.ntotal == 0 and opened.index.ntotal == 400
