"""Text model artifacts (issue 49): `export_text_model` on a random LiT tower — the manifest, the
tokenizer and the graph read back by serving's `OnnxTextEmbedder` equal to the PyTorch tower; a
parity that fails or a text too long publishes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from core.artifacts import file_sha256
from core.manifests import TextModelManifest
from core.text import TEXT_MODEL_FILE, TOKENIZER_FILE, TextInputError
from index.embedder import OnnxTextEmbedder
from training import text_export
from training.export import ExportError
from training.text_export import export_text_model
from training.text_models import LitTowerSpec, TextEmbeddingNet, build_lit_tower
from training.text_tokenizer import CLIP_END_ID

SMALL = LitTowerSpec(context_length=16, width=64, heads=2, layers=2)
TEXTS = ["latin capital letter a", "DIGIT ONE", "a red  circle", "document-open", "ß ü é"]
OTHER_TEXTS = ["greek small letter alpha", "x", "the quick brown fox jumps over"]


def torch_embed(net: TextEmbeddingNet, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return net.eval()(torch.from_numpy(ids)).numpy()


@pytest.fixture(scope="module")
def lit_export(tmp_path_factory) -> tuple[TextEmbeddingNet, Path]:
    torch.manual_seed(0)
    net = build_lit_tower(48, SMALL)
    out = tmp_path_factory.mktemp("lit") / "text-model"
    assert export_text_model(net, out, "0123456789abcdef", {"kind": "lit", "run": "r"}, TEXTS, {"seen": {}}) == out
    return net, out


def test_lit_export_round_trips_through_serving_embedder(lit_export):
    net, out = lit_export
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", TEXT_MODEL_FILE, TOKENIZER_FILE]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no staging left behind
    manifest = TextModelManifest.read(out)
    assert manifest.text_model_id == file_sha256(out / TEXT_MODEL_FILE)[:16]
    assert manifest.image_model_id == "0123456789abcdef"
    assert (manifest.embedding_dim, manifest.context_length, manifest.opset) == (48, 16, 18)
    assert manifest.files == {name: file_sha256(out / name) for name in (TEXT_MODEL_FILE, TOKENIZER_FILE)}
    assert manifest.tokenizer["kind"] == "clip-bpe" and manifest.tokenizer["end_id"] == CLIP_END_ID
    assert manifest.source == {"kind": "lit", "run": "r"} and manifest.evaluation == {"seen": {}}
    assert manifest.parity["texts"] == len(TEXTS) and manifest.parity["min_cosine"] >= 0.9999

    embedder = OnnxTextEmbedder(out, provider="cpu")
    # Texts it was not checked on, in batches of other sizes than the parity's and the trace's.
    for texts in (OTHER_TEXTS, OTHER_TEXTS[:1], TEXTS + OTHER_TEXTS):
        ids = embedder.tokenizer.encode(texts)
        assert (ids[:, 0] == manifest.tokenizer["start_id"]).all()
        reference = torch_embed(net, ids)
        np.testing.assert_allclose(embedder.embed(texts), reference, atol=1e-5)
    assert json.loads((out / "manifest.json").read_text())["schema_version"] == 1


def test_tokenizer_ids_equal_open_clip(lit_export):
    from open_clip.tokenizer import SimpleTokenizer

    _, out = lit_export
    embedder = OnnxTextEmbedder(out, provider="cpu")
    expected = SimpleTokenizer(context_length=SMALL.context_length)(TEXTS).numpy()
    np.testing.assert_array_equal(embedder.tokenizer.encode(TEXTS), expected)


def test_failed_parity_publishes_nothing(tmp_path, monkeypatch):
    class Disagreeing(OnnxTextEmbedder):
        def embed(self, texts):  # another text's embedding for each: what a broken graph answers
            return np.roll(super().embed(texts), 1, axis=0)

    monkeypatch.setattr(text_export, "OnnxTextEmbedder", Disagreeing)
    torch.manual_seed(1)
    with pytest.raises(ExportError, match=r"text tower: ONNX Runtime and PyTorch disagree: min cosine .* over 5 texts"):
        export_text_model(build_lit_tower(32, SMALL), tmp_path / "text", "abc", {"kind": "lit"}, TEXTS)
    assert list(tmp_path.iterdir()) == []


def test_refuses_parity_text_longer_than_context(tmp_path):
    long_text = " ".join(["word"] * 40)
    with pytest.raises(TextInputError, match=r"parity texts: text 1: the text is 42 tokens .* at most 16"):
        export_text_model(build_lit_tower(32, SMALL), tmp_path / "text", "abc", {"kind": "lit"}, ["a", long_text])
    with pytest.raises(ValueError, match="at least one parity text"):
        export_text_model(build_lit_tower(32, SMALL), tmp_path / "text", "abc", {"kind": "lit"}, [])
    assert list(tmp_path.iterdir()) == []
