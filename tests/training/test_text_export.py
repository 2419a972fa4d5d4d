"""Text model artifacts (issue 49): `export_text_model` on a random LiT tower — the manifest, the
tokenizer and the graph read back by serving's `OnnxTextEmbedder` equal to the PyTorch tower; a
parity that fails or a text too long publishes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from core.artifacts.layout import file_sha256
from core.artifacts.model_manifests import TextModelManifest
from core.config import from_cli
from core.data.text import TEXT_MODEL_FILE, TOKENIZER_FILE, TextInputError
from index.embedder import OnnxTextEmbedder
from training.__main__ import _parser, main
from training.export import text_export
from training.export.export import ExportConfig, run_export
from training.export.parity import ExportError
from training.export.text_export import export_text_model
from training.models.text_models import LitTowerSpec, TextEmbeddingNet, build_lit_tower
from training.models.text_tokenizer import CLIP_END_ID
from training.runs.train import RESULTS_FILE
from training.text.train_text import RUN_CHECKPOINT

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


# --- `training export --text`: a train-text run ----------------------------------------------


def write_text_run(run: Path, net: TextEmbeddingNet, spec: LitTowerSpec) -> None:
    """A run directory as `training train-text` publishes it (training/text/train_text.py's contract)."""
    run.mkdir(parents=True)
    torch.save(
        {
            "model": net.state_dict(),
            "spec": spec.to_dict(),
            "image_model_id": "feedfacecafebeef",
            "embedding_dim": 24,
            "parity_texts": TEXTS,
            "temperature": 0.05,
            "config": {},
        },
        run / RUN_CHECKPOINT,
    )
    evaluation = {"seen": {"recall_at_k": {"1": 0.5}, "chance_recall_at_k": {"1": 0.1}}}
    (run / RESULTS_FILE).write_text(json.dumps({"evaluation": evaluation}))


def test_export_text_publishes_a_train_text_run(tmp_path, capsys):
    torch.manual_seed(2)
    net = build_lit_tower(24, SMALL)
    write_text_run(tmp_path / "run", net, SMALL)
    out = tmp_path / "text-model"
    assert main(["export", "--text", "--run", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    manifest = TextModelManifest.read(out)
    assert manifest.image_model_id == "feedfacecafebeef" and manifest.context_length == SMALL.context_length
    assert manifest.source["kind"] == "lit" and manifest.source["spec"] == SMALL.to_dict()
    assert manifest.evaluation["seen"]["recall_at_k"] == {"1": 0.5}
    assert manifest.parity["texts"] == len(TEXTS) and manifest.parity["min_cosine"] >= 0.9999
    embedder = OnnxTextEmbedder(out, provider="cpu")
    np.testing.assert_allclose(
        embedder.embed(OTHER_TEXTS), torch_embed(net, embedder.tokenizer.encode(OTHER_TEXTS)), atol=1e-5
    )


def error_of(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err.strip()


def test_export_text_refusals(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no runs/text here: the default run is missing
    assert error_of(["export", "--text"], capsys) == (
        "error: --run runs/text: no checkpoint.pt, not a train-text run; pass --run a directory `python -m training "
        "train-text` published (its --out)"
    )
    assert error_of(["export", "--text", "--backbone", "open_clip:ViT-B-32", "--variants", "fp16"], capsys) == (
        "error: --text exports a train-text run (--run) to --out; --backbone, --variants are for an image model's "
        "export"
    )
    assert error_of(["export", "--text-out", "t"], capsys) == (
        "error: --text-out goes with --backbone open_clip:<config> (its text tower's artifact)"
    )
    assert list(tmp_path.iterdir()) == []


# --- `training export --backbone open_clip:<config> --pretrained FILE` ------------------------

TINY_CLIP = "tiny-clip-test"  # registered with open_clip from a config file, as a user's own would be
TINY_CLIP_CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A tiny open_clip config (its packaged ones are ≥ 100 M parameters) and a randomly
    initialised model of it, whose state dict is the user's weights file."""
    import open_clip

    folder = tmp_path_factory.mktemp("open_clip")
    (folder / f"{TINY_CLIP}.json").write_text(json.dumps(TINY_CLIP_CONFIG))
    open_clip.add_model_config(folder / f"{TINY_CLIP}.json")
    torch.manual_seed(3)
    model = open_clip.create_model(TINY_CLIP, pretrained=None).eval()
    return model, folder


@pytest.fixture
def no_network(monkeypatch):
    """Every socket refused: nothing may reach a hub."""
    import socket

    def refuse(*args, **kwargs):
        raise OSError("network blocked by the test: nothing may reach a hub")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def photo_folder(folder: Path, count: int = 6) -> Path:
    from PIL import Image

    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(count):
        pixels = rng.integers(0, 255, (40 + 7 * i, 52, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
    return folder


@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
def test_open_clip_towers_exported_equal_open_clip(tiny_clip, no_network, tmp_path, capsys, suffix):
    from open_clip.tokenizer import SimpleTokenizer
    from safetensors.torch import save_file

    from core.artifacts.model_manifests import ModelManifest
    from core.data.preprocess import load_image
    from index.embedder import OnnxEmbedder

    model, _ = tiny_clip
    weights = tmp_path / f"open_clip_model{suffix}"
    if suffix == ".safetensors":
        save_file(model.state_dict(), str(weights))
    else:
        torch.save(model.state_dict(), weights)  # open_clip_pytorch_model.bin, as the hub has it
    photos = photo_folder(tmp_path / "photos")
    out = tmp_path / "clip" / "model"
    argv = ["export", "--backbone", f"open_clip:{TINY_CLIP}", "--pretrained", str(weights), "--out", str(out)]
    assert main([*argv, "--parity-catalog", str(photos)]) == 0
    text_out = tmp_path / "clip" / "text-model"  # the default: beside --out
    assert capsys.readouterr().out.split() == [str(out), str(text_out)]
    assert sorted(p.name for p in out.parent.iterdir()) == ["model", "text-model"]  # no staging left

    image = ModelManifest.read(out)
    assert image.backbone == f"open_clip:{TINY_CLIP}" and image.embedding_dim == 32
    assert (image.input.height, image.input.resize, image.input.interpolation) == (32, 32, "bicubic")
    assert image.input.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert image.parity["min_cosine"] >= 0.9999 and image.parity["images"] == 6
    assert image.pretrained["sha256"] and image.config["open_clip"] == TINY_CLIP_CONFIG
    pixels = np.stack([load_image(p, image.input) for p in sorted(photos.iterdir())])
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in (image.input.mean, image.input.std))
    with torch.no_grad():
        expected = model.encode_image((torch.from_numpy(pixels) - mean) / std, normalize=True).numpy()
    np.testing.assert_allclose(OnnxEmbedder(out, provider="cpu").embed(pixels), expected, atol=1e-5)

    text = TextModelManifest.read(text_out)
    assert text.image_model_id == image.model_id and text.context_length == 16 and text.embedding_dim == 32
    assert text.source == {
        "kind": "open_clip",
        "config": TINY_CLIP,
        "pretrained": str(weights),
        "sha256": image.pretrained["sha256"],
        "tag": None,
    }
    assert text.parity["min_cosine"] >= 0.9999 and text.parity["texts"] == 16
    with torch.no_grad():
        expected = model.encode_text(SimpleTokenizer(context_length=16)(OTHER_TEXTS), normalize=True).numpy()
    np.testing.assert_allclose(OnnxTextEmbedder(text_out, provider="cpu").embed(OTHER_TEXTS), expected, atol=1e-5)


def test_open_clip_weights_that_do_not_fit(tiny_clip, tmp_path, capsys):
    from safetensors.torch import save_file

    model, _ = tiny_clip
    state = model.state_dict()
    argv = ["export", "--backbone", f"open_clip:{TINY_CLIP}", "--out", str(tmp_path / "model")]

    def refused(weights: dict[str, torch.Tensor], name: str) -> str:
        save_file(weights, str(tmp_path / name))
        return error_of([*argv, "--pretrained", str(tmp_path / name)], capsys)

    fewer = {k: v for k, v in state.items() if not k.startswith("ln_final.")}
    assert refused({**fewer, "extra.weight": torch.zeros(1)}, "other.safetensors") == (
        f"error: weights do not fit open_clip:{TINY_CLIP}: first missing key 'ln_final.weight' (2 missing), first "
        "unexpected key 'extra.weight' (1 unexpected) — weights of another config? (python -c 'import open_clip; "
        "print(open_clip.list_models())' names them)"
    )
    wider = {**state, "text_projection": torch.zeros(64, 48)}
    assert refused(wider, "wider.safetensors") == (
        f"error: weights do not fit open_clip:{TINY_CLIP}: 'text_projection' is [64, 48] in the file, [64, 32] in "
        "the config — weights of another size of it?"
    )
    (tmp_path / "notes.bin").write_text("not weights\n")
    assert error_of([*argv, "--pretrained", str(tmp_path / "notes.bin")], capsys).startswith(
        f"error: {tmp_path / 'notes.bin'}: not a readable state dict: a text file, not weights"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.bin", "other.safetensors", "wider.safetensors"]


def test_open_clip_option_refusals(tiny_clip, tmp_path, capsys):
    import open_clip

    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"")
    argv = ["export", "--pretrained", str(weights), "--out", str(tmp_path / "model")]
    message = error_of([*argv, "--backbone", "open_clip:ViT-B-23"], capsys)
    assert message.startswith("error: unknown open_clip config 'ViT-B-23'; nearest: ViT-B-32")
    assert message.endswith(
        f"(python -c 'import open_clip; print(open_clip.list_models())' names all {len(open_clip.list_models())})"
    )
    assert error_of([*argv, "--backbone", "open_clip:ViT-B-16-SigLIP"], capsys) == (
        "error: open_clip config 'ViT-B-16-SigLIP': its text tower reads a Hugging Face text model's ids, not "
        "CLIP's BPE ids; the text model artifact carries CLIP's BPE tokenizer only (configs such as ViT-B-32, "
        "ViT-L-14, RN50 or convnext_base read it)"
    )
    assert error_of([*argv, "--backbone", f"open_clip:{TINY_CLIP}", "--pooling", "mean"], capsys) == (
        "error: --pooling: an open_clip image tower pools and sizes its input as its config says "
        f"(open_clip:{TINY_CLIP})"
    )
    assert error_of([*argv, "--backbone", "open_clip:ViT-B-32", "--open-clip-tag", "laion9b"], capsys).startswith(
        "error: --open-clip-tag laion9b: open_clip has no pretrained tag 'laion9b' for ViT-B-32; its tags: openai, "
    )
    assert error_of([*argv, "--backbone", "open_clip:ViT-H-14", "--open-clip-tag", "dfn5b"], capsys) == (
        "error: open_clip:ViT-H-14 (dfn5b) resizes images by 'squash' to 224x224; an input contract resizes the "
        "shorter side and crops a square centre (open_clip's 'shortest')"
    )
    assert error_of([*argv, "--backbone", f"open_clip:{TINY_CLIP}", "--text-out", str(tmp_path / "model")], capsys) == (
        f"error: --text-out {tmp_path / 'model'} is --out: the image and text models are two artifacts"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_open_clip_tag_sets_the_contract():
    from training.models.open_clip_models import open_clip_contract

    laion = open_clip_contract("open_clip:ViT-L-14", "laion2b_s32b_b82k")
    assert (laion.mean, laion.std, laion.height, laion.resize) == ((0.5,) * 3, (0.5,) * 3, 224, 224)
    assert open_clip_contract("open_clip:ViT-L-14").mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))


def test_open_clip_text_parity_failure_publishes_neither_model(tiny_clip, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    class Disagreeing(OnnxTextEmbedder):
        def embed(self, texts):
            return np.roll(super().embed(texts), 1, axis=0)

    monkeypatch.setattr(text_export, "OnnxTextEmbedder", Disagreeing)
    model, _ = tiny_clip
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    out = tmp_path / "clip" / "model"
    argv = ["--backbone", f"open_clip:{TINY_CLIP}", "--pretrained", str(tmp_path / "w.safetensors"), "--out", str(out)]
    with pytest.raises(ExportError, match="text tower: ONNX Runtime and PyTorch disagree"):
        run_export(from_cli(ExportConfig, _parser("export").parse_args(["export", *argv])))
    assert list((tmp_path / "clip").iterdir()) == []  # the image model passed its parity, but is not published
