"""A text tower to a verified text model artifact: `text.onnx`, `tokenizer.json`, `manifest.json`.

`export_text_model` is the one way a tower becomes an artifact — a LiT tower trained here
(`training export --text`), the text tower of the user's open_clip weights (`training export
--backbone open_clip:<config>`), or a randomly initialised tower a test needs. The graph reads
CLIP BPE ids (int64, N × context_length, a dynamic batch axis) and returns L2-normalised float32
embeddings; the tokenizer file is the one `core.data.text.TextTokenizer` reads, so the ids the artifact
is checked on are those serving will feed it. Nothing is published unless ONNX Runtime (through
`index.embedder.OnnxTextEmbedder`, serving's own reader) and PyTorch agree on every parity text.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from core.artifacts.layout import file_sha256, staging_directory, utc_now
from core.artifacts.model_manifests import TextModelManifest
from core.cli import verbose
from core.data.text import TEXT_INPUT, TEXT_MODEL_FILE, TOKENIZER_FILE, TextInputError, TextTokenizer
from core.progress import stage
from index.embedder import OnnxTextEmbedder
from training.export.parity import DEFAULT_OPSET, MIN_PARITY_COSINE, cosine_parity
from training.models.text_models import TextEmbeddingNet
from training.models.text_tokenizer import write_clip_bpe

log = logging.getLogger(__name__)

TEXT_OUTPUT = "embeddings"
# A text the exported graph is traced on beside the parity texts: two rows, so the batch axis is
# traced as a batch and not specialised to one.
TRACE_TEXTS = ("a photo of a cat", "the letter a")
# What a tower with no run of its own (open_clip's) is checked on: the kinds of query a catalog
# search gets — objects, attributes, glyph and icon names, digits, punctuation, accents — each a
# few tokens, so they fit any context.
DEFAULT_PARITY_TEXTS = (
    "a photo of a dog",
    "a red car",
    "two cats on a sofa",
    "latin capital letter a",
    "digit seven",
    "greek small letter omega",
    "document open",
    "a diagram of a circuit",
    "blue sky, white clouds",
    "a black-and-white sketch",
    "café",
    "x",
    "an icon of a folder",
    "the number 42",
    "Mountains at SUNSET!",
    "a close-up of a leaf",
)


def export_text_model(
    net: TextEmbeddingNet,
    out_dir: str | Path,
    image_model_id: str,
    source: dict[str, Any],
    parity_texts: Sequence[str],
    evaluation: dict[str, Any] | None = None,
    *,
    opset: int = DEFAULT_OPSET,
    min_cosine: float = MIN_PARITY_COSINE,
) -> Path:
    """Export `net` to the text model artifact `out_dir`, published atomically; returns `out_dir`.

    - `net`: a `TextEmbeddingNet` (e.g. `build_lit_tower(dim)` — random weights are fine for a
      test — or a trained one); its `context_length` is the artifact's.
    - `image_model_id`: the `model_id` of the image model whose space the tower embeds into (what
      `index build --text-model` and the server check it against).
    - `source`: what the tower is, into the manifest as it is: `{"kind": "lit", "run": ...}`,
      `{"kind": "open_clip", "config": ..., "pretrained": <weights>, "sha256": ..., "tag": ...}`.
    - `parity_texts`: texts (at least one) both runtimes embed; every cosine must be at least
      `min_cosine`, else ExportError and nothing is published. A text longer than the context is
      a ValueError (core.data.text.TextInputError) before anything is written.
    - `evaluation`: text → image figures of the tower, into the manifest (None: not measured).

    Writes `text.onnx` (opset `opset`, checked by `onnx.checker`), `tokenizer.json` (CLIP BPE) and
    `manifest.json` (`core.artifacts.model_manifests.TextModelManifest`: `text_model_id` is the sha256 of
    `text.onnx`, first 16 hex digits; the sha256 of each file; the tokenizer; the parity figures).
    """
    texts = list(parity_texts)
    if not texts:
        raise ValueError("export_text_model needs at least one parity text to check ONNX against PyTorch on")
    if not image_model_id:
        raise ValueError("export_text_model needs the image model's id (its manifest's model_id)")
    out = Path(out_dir)
    net = net.eval()
    with staging_directory(out) as staging:
        tokenizer_info = write_clip_bpe(staging / TOKENIZER_FILE)
        tokenizer = TextTokenizer(staging / TOKENIZER_FILE, net.context_length)
        try:
            ids = tokenizer.encode(texts)
        except TextInputError as exc:
            raise TextInputError(f"parity texts: {exc}") from None
        reference = _torch_embeddings(net, ids)
        with stage(f"export: tracing the text tower to ONNX (opset {opset}) and checking the graph"):
            export_text_onnx(net, tokenizer.encode(TRACE_TEXTS), staging / TEXT_MODEL_FILE, opset)
        manifest = text_manifest(
            staging, net, tokenizer, tokenizer_info, reference, image_model_id, source, opset, evaluation
        )
        manifest.write(staging)
        # Serving's own reader: the tokenizer file, the manifest's context length and the graph
        # as a server loads them, so a parity that passes is a parity of what will answer.
        embedded = OnnxTextEmbedder(staging, provider="cpu").embed(texts)
        manifest.parity = cosine_parity(reference, embedded, min_cosine, "texts", "text tower: ")
        manifest.write(staging)
    log.info("exported text model %s to %s (parity %s)", manifest.text_model_id, out, manifest.parity)
    return out


def text_manifest(
    staging: Path,
    net: TextEmbeddingNet,
    tokenizer: TextTokenizer,
    tokenizer_info: dict[str, Any],
    reference: np.ndarray,
    image_model_id: str,
    source: dict[str, Any],
    opset: int,
    evaluation: dict[str, Any] | None,
) -> TextModelManifest:
    """The manifest of the text model staged in `staging` (its parity not yet measured):
    `text_model_id` the sha256 of text.onnx, first 16 hex digits; each file's sha256; the
    tokenizer with its start and end ids."""
    onnx_sha = file_sha256(staging / TEXT_MODEL_FILE)
    start_id, end_id = tokenizer.token_ids("a")[0], tokenizer.token_ids("a")[-1]
    return TextModelManifest(
        text_model_id=onnx_sha[:16],
        image_model_id=image_model_id,
        embedding_dim=int(reference.shape[1]),
        context_length=net.context_length,
        source=source,
        tokenizer={
            **tokenizer_info,
            "file": TOKENIZER_FILE,
            "sha256": file_sha256(staging / TOKENIZER_FILE),
            "start_id": start_id,
            "end_id": end_id,
        },
        files={TEXT_MODEL_FILE: onnx_sha, TOKENIZER_FILE: file_sha256(staging / TOKENIZER_FILE)},
        opset=opset,
        created=utc_now(),
        exporter={"torch": torch.__version__, "onnx": onnx.__version__, "python": platform.python_version()},
        evaluation=evaluation,
    )


def _torch_embeddings(net: TextEmbeddingNet, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return net(torch.from_numpy(ids)).float().numpy()


def export_text_onnx(net: TextEmbeddingNet, example_ids: np.ndarray, path: Path, opset: int) -> None:
    """`net` as one self-contained ONNX file: `input_ids` (N, context_length) int64, batch dynamic."""
    batch = torch.export.Dim("batch", min=1, max=65536)
    torch.onnx.export(
        net,
        (torch.from_numpy(example_ids),),
        str(path),
        input_names=[TEXT_INPUT],
        output_names=[TEXT_OUTPUT],
        opset_version=opset,
        dynamo=True,
        external_data=False,  # one file: the artifact's text.onnx alone
        dynamic_shapes={"input_ids": {0: batch}},
        verbose=verbose(),
    )
    onnx.checker.check_model(str(path), full_check=True)
