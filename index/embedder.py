"""ONNX Runtime embedder: the model artifact's graph, run on CUDA when present, else CPU."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from index.artifacts import MODEL_FILE, ArtifactError, read_manifest
from index.preprocess import InputContract

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def select_providers(prefer: str = "auto", available: Sequence[str] | None = None) -> list[str]:
    """Execution providers in priority order: CUDA first when present and allowed, CPU last."""
    if prefer not in ("auto", "cpu", "cuda"):
        raise ValueError(f"provider must be auto, cpu or cuda, got {prefer!r}")
    available = list(ort.get_available_providers() if available is None else available)
    if prefer == "cuda" and CUDA not in available:
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
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads or min(os.cpu_count() or 1, 8)
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class OnnxEmbedder:
    """Embeds preprocessed NCHW batches with a published model artifact.

    `runs_at_once` > 1: the caller makes that many runs at once, so a second CPU session of the
    same model, with the intra-op threads shared out among them, takes the runs made while others
    are under way (`embed(..., side_by_side=True)`): runs sharing one multi-threaded session
    fight over its one intra-op pool, while runs on their own share of the threads do not — on
    two cores, 16% more mobilenet_v2 queries/s than sharing the pool — yet a run made alone
    still gets every thread. Only kept where the two sessions differ: CPU, and more intra-op
    threads than a share."""

    def __init__(
        self,
        model_dir: str | Path,
        provider: str = "auto",
        intra_op_threads: int | None = None,
        spinning: bool = True,
        runs_at_once: int = 1,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.manifest = read_manifest(self.model_dir)
        model_path = self.model_dir / MODEL_FILE
        if not model_path.is_file():
            raise ArtifactError(f"{self.model_dir}: {MODEL_FILE} is missing")
        self.contract = InputContract.from_dict(self.manifest["input"])
        self.model_id: str = self.manifest["model_id"]
        self.dim: int = int(self.manifest["embedding_dim"])
        self.providers = select_providers(provider)
        options = session_options(intra_op_threads, spinning)
        self.session = ort.InferenceSession(str(model_path), sess_options=options, providers=self.providers)
        self.side_by_side_session: ort.InferenceSession | None = None
        share = max(1, options.intra_op_num_threads // max(1, runs_at_once))
        if self.session.get_providers()[0] == CPU and share < options.intra_op_num_threads:
            self.side_by_side_session = ort.InferenceSession(
                str(model_path), sess_options=session_options(share, spinning), providers=[CPU]
            )
        self.input_name = self.session.get_inputs()[0].name
        log.info(
            "loaded model %s with providers %s%s",
            self.model_id,
            self.session.get_providers(),
            f", and a {share}-thread session for runs side by side" if self.side_by_side_session else "",
        )

    def embed(self, batch: np.ndarray, side_by_side: bool = False) -> np.ndarray:
        """L2-normalised float32 embeddings of an NCHW batch; `side_by_side`: other runs are under
        way on other threads (the session with a share of the threads takes it, where there is one)."""
        batch = np.ascontiguousarray(batch, dtype=np.float32)
        expected = self.contract.input_shape
        if batch.ndim != 4 or tuple(batch.shape[1:]) != expected:
            raise ValueError(f"expected a batch of shape (N, {', '.join(map(str, expected))}), got {batch.shape}")
        if batch.shape[0] == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        session = (side_by_side and self.side_by_side_session) or self.session
        (out,) = session.run(None, {self.input_name: batch})
        out = np.asarray(out, dtype=np.float32)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)
