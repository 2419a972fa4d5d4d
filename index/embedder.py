"""ONNX Runtime embedder: the model artifact's graph, run on CUDA when present, else CPU."""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from core.artifacts import MODEL_FILE, ArtifactError, read_manifest
from core.config import DEVICES
from core.preprocess import InputContract, rows_per_pass

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def select_providers(prefer: str = "auto", available: Sequence[str] | None = None) -> list[str]:
    """Execution providers in priority order: CUDA first when present and allowed, CPU last."""
    prefer = "gpu" if prefer == "cuda" else prefer  # TODO(issue 24): serving still spells it cuda
    if prefer not in DEVICES:
        raise ValueError(f"provider must be one of {', '.join(DEVICES)}, got {prefer!r}")
    available = list(ort.get_available_providers() if available is None else available)
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
    """Whether a session on these providers (its own, in priority order) has its rows per run
    measured: on CPU; on CUDA a batch is what makes a run fast, and it keeps whole batches."""
    return providers[0] == CPU


def fastest_run_rows(
    run: Callable[[np.ndarray], object], batch: np.ndarray, budget_s: float = 2.0, min_gain: float = 0.03
) -> tuple[int | None, dict[int, float]]:
    """How many rows per `run` call process `batch` fastest: None for the whole batch in one
    call, else the row count; and each candidate's median seconds for the whole batch.

    Candidates are the powers of two below the batch size and the batch itself. Each runs once
    unmeasured (ONNX Runtime plans a shape on its first run), then in rounds, in alternating
    order, for as many rounds as fit in `budget_s` (at least one, at most five). A split must
    beat the whole batch by `min_gain` to be chosen: a noisy machine must not pick one that
    is no faster."""
    total = len(batch)
    candidates = [rows for rows in (2**i for i in range(total.bit_length())) if rows < total] + [total]

    def one_pass(rows: int) -> float:
        started = time.perf_counter()
        for i in range(0, total, rows):
            run(batch[i : i + rows])
        return time.perf_counter() - started

    for rows in candidates:
        one_pass(rows)
    passes: dict[int, list[float]] = {rows: [] for rows in candidates}
    started = time.perf_counter()
    for i in range(5):
        for rows in candidates if i % 2 == 0 else reversed(candidates):
            passes[rows].append(one_pass(rows))
        per_round = (time.perf_counter() - started) / (i + 1)
        if time.perf_counter() - started + per_round > budget_s:
            break
    seconds = {rows: statistics.median(times) for rows, times in passes.items()}
    best = min(seconds, key=seconds.__getitem__)
    if best == total or seconds[best] > (1 - min_gain) * seconds[total]:
        return None, seconds
    return best, seconds


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
        try:
            self.session = ort.InferenceSession(str(model_path), sess_options=options, providers=self.providers)
        except Exception as exc:  # ORT's own types (InvalidProtobuf, Fail, …) for a file it cannot load
            raise ArtifactError(f"{model_path} is damaged: ONNX Runtime cannot load it ({exc})") from exc
        self.side_by_side_session: ort.InferenceSession | None = None
        share = max(1, options.intra_op_num_threads // max(1, runs_at_once))
        if self.session.get_providers()[0] == CPU and share < options.intra_op_num_threads:
            self.side_by_side_session = ort.InferenceSession(
                str(model_path), sess_options=session_options(share, spinning), providers=[CPU]
            )
        self.input_name = self.session.get_inputs()[0].name
        # At most this many rows per ORT run, for the full session and the side-by-side one;
        # None: a batch in one run. See `tune_run_rows`.
        self.run_rows: int | None = None
        self.side_by_side_run_rows: int | None = None
        # Rows one run may hold at most, whatever the tuning says: activation memory (on CUDA a
        # whole batch is what makes a run fast, and device memory is the session's own concern).
        self.max_run_rows: int | None = (
            rows_per_pass(self.contract.height, self.contract.width)
            if measures_run_rows(self.session.get_providers())
            else None
        )
        log.info(
            "loaded model %s with providers %s%s",
            self.model_id,
            self.session.get_providers(),
            f", and a {share}-thread session for runs side by side" if self.side_by_side_session else "",
        )

    def tune_run_rows(self, batch_rows: int, side_by_side_rows: int, budget_s: float = 2.0) -> None:
        """Set `run_rows` and `side_by_side_run_rows` to the rows per run that embed batches of
        `batch_rows` (on the full session) and `side_by_side_rows` (on the other) fastest here,
        measured on random input (`fastest_run_rows`). On a CPU a large batch of a
        convolutional network can run slower per image than a few small runs, its activations
        spilling out of the caches (mobilenet_v2 at 224×224 on two cores: 8.0 ms of CPU an
        image in one run of 32, 7.4 in runs of 4), while a small model pays ORT's cost per run.
        A CUDA session keeps whole batches, unmeasured (`measures_run_rows`)."""
        self.run_rows = self.side_by_side_run_rows = None
        if not measures_run_rows(self.session.get_providers()):
            return
        batch = np.random.default_rng(0).standard_normal((batch_rows, *self.contract.input_shape), dtype=np.float32)
        measured = []

        def fastest(session: ort.InferenceSession, rows: int) -> int | None:
            best, seconds = fastest_run_rows(lambda x: session.run(None, {self.input_name: x}), batch[:rows], budget_s)
            per_run = ", ".join(f"{r}: {t * 1e3:.1f} ms" for r, t in seconds.items())
            measured.append(
                f"{session.get_session_options().intra_op_num_threads}-thread session, "
                f"{rows} rows in runs of {best or rows} ({per_run})"
            )
            return best

        self.run_rows = fastest(self.session, batch_rows)
        if self.side_by_side_session is not None:
            self.side_by_side_run_rows = fastest(self.side_by_side_session, min(side_by_side_rows, batch_rows))
        log.info("rows per ONNX Runtime run, measured: %s", "; ".join(measured))

    def embed(self, batch: np.ndarray, side_by_side: bool = False) -> np.ndarray:
        """L2-normalised float32 embeddings of an NCHW batch; `side_by_side`: other runs are under
        way on other threads (the session with a share of the threads takes it, where there is one)."""
        batch = np.ascontiguousarray(batch, dtype=np.float32)
        expected = self.contract.input_shape
        if batch.ndim != 4 or tuple(batch.shape[1:]) != expected:
            raise ValueError(f"expected a batch of shape (N, {', '.join(map(str, expected))}), got {batch.shape}")
        if batch.shape[0] == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        beside = side_by_side and self.side_by_side_session is not None
        session = self.side_by_side_session if beside else self.session
        rows = min(
            (self.side_by_side_run_rows if beside else self.run_rows) or len(batch), self.max_run_rows or len(batch)
        )
        runs = [session.run(None, {self.input_name: batch[i : i + rows]})[0] for i in range(0, len(batch), rows)]
        out = np.asarray(runs[0] if len(runs) == 1 else np.concatenate(runs), dtype=np.float32)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)
