"""What every export shares: its error, the ONNX opset, and the parity gate — ONNX Runtime's
embeddings against PyTorch's, row by row, for image models (`training/export/export.py`) and text
models (`training/export/text_export.py`) alike."""

from __future__ import annotations

import numpy as np

DEFAULT_OPSET = 18
MIN_PARITY_COSINE = 0.9999


class ExportError(RuntimeError):
    """The exported model is invalid or does not match PyTorch."""


def cosine_parity(
    reference: np.ndarray, onnx_out: np.ndarray, min_cosine: float, rows: str, what: str = ""
) -> dict[str, float]:
    """Cosine between each row of PyTorch's `reference` and ONNX Runtime's `onnx_out` (`rows`
    names them: "images", "texts"); ExportError naming `what` was exported when the least is
    below `min_cosine`."""
    cosine = np.sum(reference * onnx_out, axis=1) / np.maximum(
        np.linalg.norm(reference, axis=1) * np.linalg.norm(onnx_out, axis=1), 1e-12
    )
    result = {
        rows: int(len(cosine)),
        "min_cosine": float(cosine.min()),
        "max_abs_diff": float(np.abs(reference - onnx_out).max()),
    }
    if result["min_cosine"] < min_cosine:
        raise ExportError(
            f"{what}ONNX Runtime and PyTorch disagree: min cosine {result['min_cosine']:.6f} < {min_cosine} "
            f"over {len(cosine)} {rows} (worst: row {int(np.argmin(cosine))})"
        )
    return result
