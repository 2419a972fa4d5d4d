"""Query embedding for the server: the model's ONNX Runtime sessions and their run sizes.

A server makes several runs at once (batch streams, or unbatched queries), and on a CPU the
rows per run that embed a batch fastest depend on the model and the machine, so serving keeps
a pool of sessions and measures its run sizes at load; `index` embeds catalogs with the one
session of `OnnxEmbedder`, which this class builds on.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from index.embedder import CPU, OnnxEmbedder, load_session, measures_run_rows, session_options

if TYPE_CHECKING:
    import onnxruntime as ort

log = logging.getLogger(__name__)

MEASURE_BUDGET_S = 10.0  # the run-size measurement's wall-clock cap, by default (--run-rows-budget-s)
PROGRESS_LOG_S = 2.0  # a measurement this slow logs its steps
ROUNDS = 5  # measured rounds at most


class OverBudget(Exception):
    """The run-size measurement ran past its wall-clock deadline (a busy machine, a large model)."""


Progress = Callable[[str], None]  # told what the measurement is doing, as it goes


def candidate_run_rows(total: int) -> list[int]:
    """The run sizes measured for batches of `total` rows: powers of two below it, and itself."""
    return [rows for rows in (2**i for i in range(total.bit_length())) if rows < total] + [total]


def fastest_run_rows(
    run: Callable[[np.ndarray], object],
    batch: np.ndarray,
    budget_s: float = 2.0,
    min_gain: float = 0.03,
    deadline: float | None = None,
    progress: Progress | None = None,
) -> tuple[int | None, dict[int, float]]:
    """How many rows per `run` call process `batch` fastest: None for the whole batch in one
    call, else the row count; and each candidate's median seconds for the whole batch.

    Candidates are the powers of two below the batch size and the batch itself. Each runs once
    unmeasured (ONNX Runtime plans a shape on its first run), then in rounds, in alternating
    order, for as many rounds as fit in `budget_s` (at least one, at most five). A split must
    beat the whole batch by `min_gain` to be chosen: a noisy machine must not pick one that
    is no faster. `deadline` (a `time.monotonic()` value) bounds all of it, the unmeasured runs
    included: past it, `OverBudget`. `progress` hears of each step."""
    total = len(batch)
    candidates = candidate_run_rows(total)
    steps = len(candidates) + ROUNDS  # a first run of each, then the rounds (fewer when they take long)

    def one_pass(rows: int) -> float:
        started = time.perf_counter()
        for i in range(0, total, rows):
            if deadline is not None and time.monotonic() > deadline:
                raise OverBudget
            run(batch[i : i + rows])
        return time.perf_counter() - started

    for step, rows in enumerate(candidates, 1):
        if progress is not None:
            progress(f"first runs of {rows} rows ({step} of {steps})")
        one_pass(rows)
    passes: dict[int, list[float]] = {rows: [] for rows in candidates}
    started = time.perf_counter()
    for i in range(ROUNDS):
        if progress is not None:
            progress(f"timing round {i + 1} ({len(candidates) + i + 1} of {steps})")
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


class QueryEmbedder(OnnxEmbedder):
    """The model's sessions for queries, and the rows per run each embeds fastest.

    `runs_at_once` > 1: the caller makes that many runs at once, so a second CPU session of the
    same model, with the intra-op threads shared out among them, takes the runs made while others
    are under way (`embed(..., side_by_side=True)`): runs sharing one multi-threaded session
    fight over its one intra-op pool, while runs on their own share of the threads do not (the
    serving benchmark measures the difference, docs/benchmarks.md) — yet a run made alone
    still gets every thread. Only kept where the two sessions differ: CPU, and more intra-op
    threads than a share."""

    takes_encoded_images = False  # the server decodes, in its own threads, what this embeds

    def __init__(self, model_dir: str | Path, *args: Any, runs_at_once: int = 1, **kwargs: Any) -> None:
        # The session's options are OnnxEmbedder's own (provider, intra_op_threads, spinning).
        super().__init__(model_dir, *args, **kwargs)
        self.side_by_side_session: ort.InferenceSession | None = None
        threads = self.options.intra_op_num_threads
        share = max(1, threads // max(1, runs_at_once))
        if self.session.get_providers()[0] == CPU and share < threads:
            self.side_by_side_session = load_session(self.model_path, session_options(share, self.spinning), [CPU])
            log.debug("model %s: a %d-thread session for runs side by side", self.model_id, share)
        # At most this many rows per ORT run, for the full session and the side-by-side one;
        # None: a batch in one run. See `tune_run_rows`.
        self.run_rows: int | None = None
        self.side_by_side_run_rows: int | None = None

    def tune_run_rows(
        self,
        batch_rows: int,
        side_by_side_rows: int,
        budget_s: float = 2.0,
        total_budget_s: float = MEASURE_BUDGET_S,
        progress: Progress | None = None,
    ) -> None:
        """Set `run_rows` and `side_by_side_run_rows` to the rows per run that embed batches of
        `batch_rows` (on the full session) and `side_by_side_rows` (on the other) fastest here,
        measured on random input (`fastest_run_rows`). On a CPU a large batch of a
        convolutional network can run slower per image than a few small runs, its activations
        spilling out of the caches (docs/benchmarks.md, serving), while a small model pays ORT's
        cost per run.
        A CUDA session keeps whole batches, unmeasured (`measures_run_rows`).

        The measurement holds up the server's start: all of it, first runs included, gets
        `total_budget_s` of wall-clock time, past which both sessions keep whole batches (what
        `--run-rows 0` asks; `max_run_rows` still bounds a run), with a warning. `progress`
        hears of each step; a step is logged once the measurement has taken a few seconds."""
        self.run_rows = self.side_by_side_run_rows = None
        if not measures_run_rows(self.session.get_providers()):
            return
        batch = np.random.default_rng(0).standard_normal((batch_rows, *self.contract.input_shape), dtype=np.float32)
        sessions = [(self.session, batch_rows)]
        if self.side_by_side_session is not None:
            sessions.append((self.side_by_side_session, min(side_by_side_rows, batch_rows)))
        started = time.monotonic()
        deadline = started + total_budget_s
        logged = started
        measured = []

        def fastest(number: int, session: ort.InferenceSession, rows: int) -> int | None:
            def step(what: str) -> None:
                nonlocal logged
                text = f"measuring batch sizes: session {number} of {len(sessions)}, {what}"
                if progress is not None:
                    progress(text)
                if time.monotonic() - logged >= PROGRESS_LOG_S:  # a slow measurement says what it does
                    logged = time.monotonic()
                    log.info("%s; %.0f s so far, at most %g s", text, logged - started, total_budget_s)

            run = lambda x: session.run(None, {self.input_name: x})  # noqa: E731
            best, seconds = fastest_run_rows(run, batch[:rows], budget_s, deadline=deadline, progress=step)
            per_run = ", ".join(f"{r}: {t * 1e3:.1f} ms" for r, t in seconds.items())
            measured.append(
                f"{session.get_session_options().intra_op_num_threads}-thread session, "
                f"{rows} rows in runs of {best or rows} ({per_run})"
            )
            return best

        try:
            found = [fastest(number, session, rows) for number, (session, rows) in enumerate(sessions, 1)]
        except OverBudget:
            log.warning(
                "measuring rows per ONNX Runtime run took over %g s (a busy machine?): whole batches instead, "
                "as --run-rows 0; set --run-rows to choose, or --run-rows-budget-s to measure longer",
                total_budget_s,
            )
            return
        self.run_rows = found[0]
        if len(found) > 1:
            self.side_by_side_run_rows = found[1]
        log.info("rows per ONNX Runtime run, measured in %.1f s: %s", time.monotonic() - started, "; ".join(measured))

    def set_run_rows(self, run_rows: int | None, side_by_side_run_rows: int | None) -> None:
        self.run_rows, self.side_by_side_run_rows = run_rows, side_by_side_run_rows

    def embed(self, batch: np.ndarray, side_by_side: bool = False) -> np.ndarray:
        """L2-normalised float32 embeddings of an NCHW batch; `side_by_side`: other runs are under
        way on other threads (the session with a share of the threads takes it, where there is one)."""
        if side_by_side and self.side_by_side_session is not None:
            return self.embed_on(self.side_by_side_session, batch, self.side_by_side_run_rows)
        return self.embed_on(self.session, batch, self.run_rows)
