"""The GPU paths, run where a GPU exists (a lent CUDA machine): what selects CUDA, and whether
the numbers it gives match the CPU's. Prints one JSON report (and writes it to --out).

1. Selection: `training.runs.ray_run.resolve_use_gpu` with the machine's GPU count (what Ray Train's
   `use_gpu` gets), `index.embedder.select_providers` with ONNX Runtime's providers, and faiss's
   GPU count where faiss is installed.
2. Training on CUDA: for each backbone, the same initial weights and C×K batch through the model
   and a loss on CPU and on CUDA — loss values and gradients compared — then timed AdamW steps
   on CUDA (the training worker's own step: forward, loss, backward, step).
3. ONNX Runtime: a model exported by this project's exporter, embedded by `OnnxEmbedder` on the
   provider `auto` selects against the CPU provider, where the CUDA provider exists.

    python -m scripts.gpu_check --out gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from training.losses import build_loss
from training.models.models import EmbeddingNet
from training.runs.ray_run import resolve_use_gpu

BACKBONES = ("mobilenet_v2", "resnet50", "vit_small_patch16", "convnext_tiny")
LOSSES = {"raw_vthm": {}, "proxy_anchor": {"num_classes": 16, "embedding_dim": 128}}


def selection() -> dict:
    report: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    gpus = torch.cuda.device_count()
    if gpus:
        report["device"] = torch.cuda.get_device_name(0)
    report["ray_train_use_gpu_auto"] = resolve_use_gpu("auto", gpus)
    try:
        import onnxruntime as ort

        from index.embedder import select_providers

        report["ort"] = ort.__version__
        report["ort_available"] = ort.get_available_providers()
        report["ort_auto_selects"] = select_providers("auto")
    except Exception as exc:  # report what is missing, go on with the rest
        report["ort_error"] = repr(exc)
    try:
        import faiss

        report["faiss_gpus"] = faiss.get_num_gpus()
    except Exception as exc:
        report["faiss_error"] = repr(exc)
    return report


def training_step_parity(backbone: str, loss_name: str, batch: int = 32, side: int = 224) -> dict:
    """Loss and gradient on CPU vs CUDA from identical weights and batch."""
    torch.manual_seed(0)
    model = EmbeddingNet(backbone, 128, image_size=side).train()
    loss_fn = build_loss(loss_name, **LOSSES[loss_name])
    images = torch.rand(batch, 3, side, side)
    labels = torch.arange(batch) // 4 % 16  # C×K: 8 classes × 4 images
    out = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(1)
        m = EmbeddingNet(backbone, 128, image_size=side).to(device).train()
        m.load_state_dict(model.state_dict())
        f = build_loss(loss_name, **LOSSES[loss_name]).to(device)
        f.load_state_dict(loss_fn.state_dict())
        loss = f(m(images.to(device)), labels.to(device))
        loss.backward()
        grads = torch.cat([p.grad.flatten().cpu().double() for p in m.parameters() if p.grad is not None])
        out[device] = (loss.item(), grads)
    cos = float(torch.nn.functional.cosine_similarity(out["cpu"][1], out["cuda"][1], dim=0))
    return {"loss_cpu": out["cpu"][0], "loss_cuda": out["cuda"][0], "grad_cosine": cos}


def timed_steps(backbone: str, batch: int = 64, side: int = 224, steps: int = 20) -> dict:
    torch.manual_seed(0)
    model = EmbeddingNet(backbone, 128, image_size=side).cuda().train()
    loss_fn = build_loss("proxy_anchor", **LOSSES["proxy_anchor"]).cuda()
    optimizer = torch.optim.AdamW([*model.parameters(), *loss_fn.parameters()], lr=1e-4)
    images = torch.rand(batch, 3, side, side, device="cuda")
    labels = (torch.arange(batch, device="cuda") // 4) % 16
    times = []
    for step in range(steps + 3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        if step >= 3:  # warm-up: cuDNN picks its kernels
            times.append(time.perf_counter() - started)
    median = float(np.median(times))
    return {"batch": batch, "ms_per_step": 1e3 * median, "images_per_s": batch / median, "final_loss": loss.item()}


def onnx_runtime(work: Path) -> dict:
    """Export mobilenet_v2 (random weights saved as a user's .pth) with the project's exporter,
    then embed real PNGs with the provider `auto` picks and with the CPU provider."""
    import torchvision
    from PIL import Image

    from index.embedder import OnnxEmbedder
    from training.export.export import ExportConfig, run_export

    torch.manual_seed(0)
    weights = work / "mobilenet_v2.pth"  # a torchvision state dict, as a user's file would be
    torch.save(torchvision.models.mobilenet_v2().state_dict(), weights)
    images = work / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(64):
        Image.fromarray(rng.integers(0, 256, (160, 200, 3), dtype=np.uint8)).save(images / f"{i:03d}.png")
    model = work / "model"
    run_export(
        ExportConfig(out=str(model), backbone="mobilenet_v2", pretrained=str(weights), parity_catalog=str(images))
    )
    from core.data.catalog import read_catalog
    from core.data.preprocess import load_batch

    catalog = read_catalog(images)
    report = {}
    vectors = {}
    for provider in ("auto", "cpu"):
        embedder = OnnxEmbedder(model, provider=provider)
        batch = load_batch(list(catalog.paths), embedder.contract)
        embedder.embed(batch)  # warm-up
        started = time.perf_counter()
        vectors[provider] = embedder.embed(batch)
        report[provider] = {
            "providers": list(embedder.providers),
            "ms_per_image": 1e3 * (time.perf_counter() - started) / len(batch),
        }
    report["min_cosine_auto_vs_cpu"] = float(np.min(np.sum(vectors["auto"] * vectors["cpu"], axis=1)))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--backbones", default=",".join(BACKBONES))
    args = parser.parse_args()
    report = {"selection": selection()}
    print(json.dumps(report["selection"]), flush=True)
    if torch.cuda.is_available():
        for backbone in args.backbones.split(","):
            entry = {}
            for loss in LOSSES:
                try:
                    entry[f"parity_{loss}"] = training_step_parity(backbone, loss)
                except Exception as exc:
                    entry[f"parity_{loss}"] = repr(exc)
            try:
                entry["cuda_steps"] = timed_steps(backbone)
            except Exception as exc:
                entry["cuda_steps"] = repr(exc)
            report[backbone] = entry
            print(backbone, json.dumps(entry), flush=True)
    with tempfile.TemporaryDirectory() as work:
        try:
            report["onnx_runtime"] = onnx_runtime(Path(work))
        except Exception as exc:
            report["onnx_runtime"] = repr(exc)
    print(json.dumps(report.get("onnx_runtime")), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
