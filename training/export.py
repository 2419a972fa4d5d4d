"""ONNX export of a trained run, verified against PyTorch before it is published.

The exported graph takes scaled pixels (N×C×H×W float32 in [0, 1]) with a dynamic batch axis
and returns L2-normalised embeddings; the input contract goes into the manifest, which every
downstream stage reads. The export fails, and nothing is published, if ONNX Runtime and PyTorch
disagree on real images.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from index.artifacts import (
    MANIFEST,
    MODEL_FILE,
    ArtifactError,
    file_sha256,
    staging_directory,
    utc_now,
    write_json_atomic,
)
from index.catalog import read_catalog
from index.embedder import OnnxEmbedder
from index.preprocess import InputContract
from training.data import load_images
from training.models import EmbeddingNet
from training.train import CHECKPOINT_FILE, RESULTS_FILE

log = logging.getLogger(__name__)

DEFAULT_OPSET = 18
MIN_PARITY_COSINE = 0.9999


class ExportError(RuntimeError):
    """The exported model is invalid or does not match PyTorch."""


@dataclass
class ExportConfig:
    run: str = "runs/train"
    out: str = "runs/model"
    opset: int = DEFAULT_OPSET
    parity_images: int = 256
    min_cosine: float = MIN_PARITY_COSINE

    def __post_init__(self) -> None:
        if not (Path(self.run) / CHECKPOINT_FILE).is_file():
            raise ValueError(f"{self.run}: no {CHECKPOINT_FILE}; pass a training run directory")
        if self.parity_images <= 0:
            raise ValueError("parity_images must be positive")


def load_trained_model(run: Path) -> tuple[EmbeddingNet, dict, InputContract]:
    state = torch.load(run / CHECKPOINT_FILE, map_location="cpu", weights_only=False)
    cfg = state["config"]
    model = EmbeddingNet(cfg["backbone"], cfg["embedding_dim"], cfg["pooling"])
    model.load_state_dict(state["model"])
    return model.eval(), cfg, InputContract.from_dict(state["contract"])


def export_onnx(model: EmbeddingNet, contract: InputContract, path: Path, opset: int) -> None:
    example = torch.rand(2, *contract.input_shape)
    batch = torch.export.Dim("batch", min=1, max=65536)
    torch.onnx.export(
        model,
        (example,),
        str(path),
        input_names=["images"],
        output_names=["embeddings"],
        opset_version=opset,
        dynamo=True,
        external_data=False,  # one self-contained file: the artifact is model.onnx alone
        dynamic_shapes={"x": {0: batch}},
    )
    onnx.checker.check_model(str(path), full_check=True)


def parity_check(model: EmbeddingNet, model_dir: Path, images: np.ndarray, min_cosine: float) -> dict[str, float]:
    """Cosine between ONNX Runtime and PyTorch embeddings for every image."""
    with torch.no_grad():
        reference = model(torch.from_numpy(images)).numpy()
    onnx_out = OnnxEmbedder(model_dir, provider="cpu").embed(images)
    cosine = np.sum(reference * onnx_out, axis=1) / (
        np.linalg.norm(reference, axis=1) * np.linalg.norm(onnx_out, axis=1)
    )
    result = {
        "images": int(len(images)),
        "min_cosine": float(cosine.min()),
        "max_abs_diff": float(np.abs(reference - onnx_out).max()),
    }
    if result["min_cosine"] < min_cosine:
        raise ExportError(
            f"ONNX Runtime and PyTorch disagree: min cosine {result['min_cosine']:.6f} < "
            f"{min_cosine} over {len(images)} images"
        )
    return result


def run_export(cfg: ExportConfig) -> Path:
    run = Path(cfg.run)
    model, train_cfg, contract = load_trained_model(run)
    results = _read_json(run / RESULTS_FILE)
    parity_catalog = run / "splits" / "test.csv"
    out = Path(cfg.out)
    with staging_directory(out) as staging:
        export_onnx(model, contract, staging / MODEL_FILE, cfg.opset)
        model_id = file_sha256(staging / MODEL_FILE)[:16]
        manifest = {
            "model_id": model_id,
            "backbone": train_cfg["backbone"],
            "embedding_dim": train_cfg["embedding_dim"],
            "pooling": train_cfg["pooling"],
            "input": contract.to_dict(),
            "output": {"name": "embeddings", "l2_normalized": True},
            "loss": {"name": train_cfg["loss"], "options": train_cfg["loss_options"]},
            "training_data": {
                "catalog": train_cfg["catalog"] or "embedded glyph set",
                "splits": {p.stem: str(p.resolve()) for p in sorted((run / "splits").glob("*.csv"))},
            },
            "evaluation": {
                "test": results.get("trained"),
                "untrained_test": results.get("untrained"),
                "val_recall_at_1": results.get("val_recall_at_1"),
                "best_epoch": results.get("best_epoch"),
            },
            "opset": cfg.opset,
            "created": utc_now(),
            "exporter": {"torch": torch.__version__, "onnx": onnx.__version__, "python": platform.python_version()},
            "config": {"train": train_cfg, "export": {k: v for k, v in vars(cfg).items()}},
        }
        write_json_atomic(staging / MANIFEST, manifest)
        if parity_catalog.is_file():
            catalog = read_catalog(parity_catalog)
            step = max(1, len(catalog) // cfg.parity_images)
            sample = catalog.subset(range(0, len(catalog), step)[: cfg.parity_images])
            images = load_images(sample, contract, max_bad_fraction=1.0).images
        else:
            images = np.random.default_rng(0).random((cfg.parity_images, *contract.input_shape), dtype=np.float32)
        manifest["parity"] = parity_check(model, staging, images, cfg.min_cosine)
        write_json_atomic(staging / MANIFEST, manifest)
    log.info("exported model %s to %s (parity %s)", model_id, out, manifest["parity"])
    return out


def _read_json(path: Path) -> dict:
    import json

    if not path.is_file():
        raise ArtifactError(f"{path} is missing")
    return json.loads(path.read_text(encoding="utf-8"))
