"""core.artifacts.manifests, model_manifests and index_manifest: typed model and index manifests read
what the stages have always written."""

from __future__ import annotations

import json

import pytest

from core.artifacts.index_manifest import IndexManifest, QualityReport
from core.artifacts.layout import MANIFEST, ArtifactError, write_json_atomic
from core.artifacts.manifests import SCHEMA_VERSION
from core.artifacts.model_manifests import ModelManifest
from core.data.preprocess import InputContract

MODEL = {
    "model_id": "0123456789abcdef",
    "backbone": "simple_cnn",
    "embedding_dim": 64,
    "pooling": "avg",
    "loss": None,
    "training_data": {"catalog": "glyphs", "splits": {"test": "/data/test.csv"}},
    "evaluation": None,
    "input": InputContract(height=28, width=28, channels=1).to_dict(),
    "output": {"name": "embeddings", "l2_normalized": True},
    "opset": 18,
    "created": "2026-01-01T00:00:00+00:00",
    "exporter": {"torch": "2.5"},
    "config": {"train": None},
    "parity": {"images": 16, "min_cosine": 0.99999},
}

INDEX = {
    "index_id": "fedcba9876543210",
    "version": "20260101T000000000000-fedcba98",
    "model_id": "0123456789abcdef",
    "model_dir": "/runs/model",
    "factory": "IVF8,Flat",
    "metric": "inner_product",
    "normalized": True,
    "size": 100,
    "dimension": 64,
    "search_params": {"nprobe": 8},
    "built_on": "cpu",
    "build_seconds": 1.5,
    "embed_seconds": 1.0,
    "created": "2026-01-01T00:00:00+00:00",
    "catalog": "/data/test.csv",
    "rows": {"catalog": 102, "indexed": 100, "skipped": {"missing": 2}},
    "quality": {
        "sample_size": 100,
        "ann_k": 10,
        "labelled": True,
        "ann_recall_at_k": 0.97,
        "probe_source": "leave-one-out sample of the catalog",
        "probe_recall_at_k": {"1": 0.8, "2": 0.9},
        "exact_recall_at_k": {"1": 0.81},
    },
    "quality_gate": {"passed": True, "forced": False, "reasons": []},
    "config": {"factory": "IVF8,Flat"},
    "parent_version": "20251231T000000000000-00000000",
}


@pytest.mark.parametrize(("cls", "data"), [(ModelManifest, MODEL), (IndexManifest, INDEX)])
def test_a_manifest_without_a_schema_version_is_version_1_and_writes_back_its_keys(tmp_path, cls, data):
    write_json_atomic(tmp_path / MANIFEST, {**data, "written_by_a_later_stage": {"kept": True}})
    manifest = cls.read(tmp_path)
    assert manifest.schema_version == 1
    manifest.write(tmp_path)
    written = json.loads((tmp_path / MANIFEST).read_text())
    assert written == {**data, "written_by_a_later_stage": {"kept": True}, "schema_version": SCHEMA_VERSION}
    assert cls.read(tmp_path) == manifest


def test_typed_fields():
    model = ModelManifest.from_dict(MODEL)
    assert model.input.input_shape == (1, 28, 28) and model.test_split == "/data/test.csv"
    assert ModelManifest.from_dict({**MODEL, "training_data": None}).test_split is None
    index = IndexManifest.from_dict(INDEX)
    assert index.quality.probe_recall_at_1 == 0.8 and index.rows.skipped_total == 2
    assert index.indexed_rows == 100 and index.search_params == {"nprobe": 8}
    # Fields without a value are not written: a plain build has no parent.
    built = IndexManifest.from_dict({k: v for k, v in INDEX.items() if k != "parent_version"})
    assert "parent_version" not in built.to_dict() and built.parent_version is None
    # A pretrained export writes its empty training fields as nulls, and no parity until measured.
    bare = ModelManifest.from_dict({k: v for k, v in MODEL.items() if k != "parity"}).to_dict()
    assert bare["loss"] is None and bare["training_data"] is not None and "parity" not in bare
    unlabelled = QualityReport(sample_size=3, ann_k=2, ann_recall_at_k=1.0, labelled=False, probe_source="none")
    assert (
        QualityReport.from_dict(unlabelled.to_dict()) == unlabelled and "probe_recall_at_k" not in unlabelled.to_dict()
    )


@pytest.mark.parametrize(
    ("cls", "data", "field"),
    [
        (ModelManifest, {k: v for k, v in MODEL.items() if k != "model_id"}, "'model_id' is missing"),
        (ModelManifest, {**MODEL, "embedding_dim": "64"}, "'embedding_dim' must be int"),
        (ModelManifest, {**MODEL, "embedding_dim": True}, "'embedding_dim' must be int"),
        (ModelManifest, {**MODEL, "input": {"height": 0, "width": 28}}, "'input' is not an input contract"),
        (IndexManifest, {**INDEX, "size": None}, "'size' must be int"),
        (
            IndexManifest,
            {**INDEX, "quality": {**INDEX["quality"], "ann_recall_at_k": "high"}},
            "'quality.ann_recall_at_k'",
        ),
        (
            IndexManifest,
            {**INDEX, "quality": {**INDEX["quality"], "probe_interval_at_k": {"1": [0.7]}}},
            r"'quality.probe_interval_at_k.1' must be \[low, high\]",
        ),
        (IndexManifest, {**INDEX, "rows": {"catalog": 1}}, "'rows.indexed' is missing"),
        (IndexManifest, {**INDEX, "schema_version": SCHEMA_VERSION + 1}, "'schema_version'"),
        (IndexManifest, [INDEX], "must be a JSON object"),
    ],
)
def test_a_manifest_that_fails_validation_names_the_file_and_the_field(tmp_path, cls, data, field):
    write_json_atomic(tmp_path / MANIFEST, data)
    with pytest.raises(ArtifactError, match=field) as caught:
        cls.read(tmp_path)
    assert str(tmp_path / MANIFEST) in str(caught.value)
