"""ONNX Runtime embedder: the model artifact's graph, run on CUDA when present, else CPU."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from core.artifacts.layout import MANIFEST, MODEL_FILE, ArtifactError
from core.artifacts.model_manifests import ModelManifest, TextModelManifest
from core.config import DEVICES
from core.data.preprocess import InputContract, rows_per_pass
from core.data.text import TEXT_INPUT, TEXT_MODEL_FILE, TOKENIZER_FILE, TextTokenizer

if TYPE_CHECKING:
    import onnxruntime as ort

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def onnxruntime() -> ModuleType:
    """ONNX Runtime, imported on first use rather than with this module: importing it starts a
    native thread and maps the library, which a process that imports the server but never loads
    a model (`serve --processes N`'s supervisor, `serving.workers`) has no use for."""
    import onnxruntime

    return onnxruntime


def select_providers(prefer: str = "auto", available: Sequence[str] | None = None) -> list[str]:
    """Execution providers in priority order: CUDA first when present and allowed, CPU last."""
    if prefer not in DEVICES:
        raise ValueError(f"provider must be one of {', '.join(DEVICES)}, got {prefer!r}")
    available = list(onnxruntime().get_available_providers() if available is None else available)
    if prefer == "gpu" and CUDA not in available:
        raise RuntimeError(
            "CUDA provider requested but ONNX Runtime has no CUDAExecutionProvider (install onnxruntime-gpu)"
        )
    if prefer != "cpu" and CUDA in available:
        return [CUDA, CPU]
    return [CPU]


def session_options(intra_op_threads: int | None = None, spinning: bool = True) -> ort.SessionOptions:
    """Full graph optimisation, bounded threads. `spinning=False` stops idle intra-op threads
    from busy-waiting for the next run: right for a server whose gRPC and decode threads need
    the same cores between batches, wrong for a batch job that runs back to back."""
    ort = onnxruntime()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads or min(os.cpu_count() or 1, 8)
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def measures_run_rows(providers: Sequence[str]) -> bool:
    """Whether a session on these providers (its own, in priority order) splits a batch into
    runs of a bounded, measured size: on CPU; on CUDA a batch is what makes a run fast, and it
    keeps whole batches."""
    return providers[0] == CPU


def load_session(path: Path, options: ort.SessionOptions, providers: list[str]) -> ort.InferenceSession:
    """An ONNX Runtime session of a model artifact's graph; ArtifactError naming the file when ONNX
    Runtime cannot load it."""
    try:
        return onnxruntime().InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as exc:  # ORT's own types (InvalidProtobuf, Fail, …) for a file it cannot load
        raise ArtifactError(f"{path} is damaged: ONNX Runtime cannot load it ({exc})") from exc


class OnnxEmbedder:
    """Embeds preprocessed NCHW batches with a published model artifact: one ONNX Runtime
    session, what embedding a catalog needs. Serving's pool of sessions and its measured run
    sizes build on it (`serving.search.query_embedder.QueryEmbedder`)."""

    def __init__(
        self,
        model_dir: str | Path,
        provider: str = "auto",
        intra_op_threads: int | None = None,
        spinning: bool = True,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.manifest = ModelManifest.read(self.model_dir)
        self.model_path = self.model_dir / MODEL_FILE
        if not self.model_path.is_file():
            raise ArtifactError(f"{self.model_dir}: {MODEL_FILE} is missing")
        self.contract: InputContract = self.manifest.input
        self.model_id: str = self.manifest.model_id
        self.dim: int = self.manifest.embedding_dim
        self.providers = select_providers(provider)
        self.spinning = spinning  # kept for any further session of the same model
        self.options = session_options(intra_op_threads, spinning)
        self.session = load_session(self.model_path, self.options, self.providers)
        self.input_name = self.session.get_inputs()[0].name
        # Rows one run may hold at most: activation memory (on CUDA a whole batch is what makes
        # a run fast, and device memory is the session's own concern).
        self.max_run_rows: int | None = (
            rows_per_pass(self.contract.height, self.contract.width)
            if measures_run_rows(self.session.get_providers())
            else None
        )
        log.info("loaded model %s with providers %s", self.model_id, self.session.get_providers())

    def embed(self, batch: np.ndarray) -> np.ndarray:
        """L2-normalised float32 embeddings of an NCHW batch."""
        return self.embed_on(self.session, batch, None)

    def embed_on(self, session: ort.InferenceSession, batch: np.ndarray, run_rows: int | None) -> np.ndarray:
        """`embed` with `session` (this model's), in runs of at most `run_rows` (None: the
        batch) and never more than `max_run_rows`."""
        batch = np.ascontiguousarray(batch, dtype=np.float32)
        expected = self.contract.input_shape
        if batch.ndim != 4 or tuple(batch.shape[1:]) != expected:
            raise ValueError(f"expected a batch of shape (N, {', '.join(map(str, expected))}), got {batch.shape}")
        if batch.shape[0] == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        rows = min(run_rows or len(batch), self.max_run_rows or len(batch))
        runs = [session.run(None, {self.input_name: batch[i : i + rows]})[0] for i in range(0, len(batch), rows)]
        out = np.asarray(runs[0] if len(runs) == 1 else np.concatenate(runs), dtype=np.float32)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)


class OnnxTextEmbedder:
    """Embeds texts with a text model artifact (`training export --text`): its tokenizer, then
    one ONNX Runtime session of its `text.onnx`, L2-normalised like the image model's output."""

    def __init__(
        self,
        text_dir: str | Path,
        provider: str = "auto",
        intra_op_threads: int | None = None,
        spinning: bool = True,
    ) -> None:
        self.text_dir = Path(text_dir)
        if not (self.text_dir / MANIFEST).is_file():
            raise ArtifactError(f"text model directory {self.text_dir} has no {MANIFEST}")
        self.manifest = TextModelManifest.read(self.text_dir)
        self.text_model_id = self.manifest.text_model_id
        self.image_model_id = self.manifest.image_model_id
        self.dim = self.manifest.embedding_dim
        self.model_path = self.text_dir / TEXT_MODEL_FILE
        for name in (TEXT_MODEL_FILE, TOKENIZER_FILE):
            if not (self.text_dir / name).is_file():
                raise ArtifactError(f"{self.text_dir}: {name} is missing")
        try:
            self.tokenizer = TextTokenizer(self.text_dir / TOKENIZER_FILE, self.manifest.context_length)
        except ValueError as exc:
            raise ArtifactError(str(exc)) from exc
        self.providers = select_providers(provider)
        options = session_options(intra_op_threads, spinning)
        self.session = load_session(self.model_path, options, self.providers)
        log.info("loaded text model %s with providers %s", self.text_model_id, self.session.get_providers())

    def embed_ids(self, ids: np.ndarray) -> np.ndarray:
        """L2-normalised float32 embeddings of token ids (N, context_length)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[1] != self.manifest.context_length:
            raise ValueError(f"expected token ids of shape (N, {self.manifest.context_length}), got {ids.shape}")
        if len(ids) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        out = np.asarray(self.session.run(None, {TEXT_INPUT: ids})[0], dtype=np.float32)
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """L2-normalised float32 embeddings of `texts`; core.data.text.TextInputError for one it cannot embed."""
        return self.embed_ids(self.tokenizer.encode(texts))
