"""`training train-text`: a text tower trained into a locked image model's space (LiT).

Locked-image text Tuning (Zhai et al., CVPR 2022): the image model — an exported model artifact,
`--model` — stays as it is. Its embeddings of the catalog's images are computed once, by the ONNX
Runtime embedder index and serving use (so the tower learns the space queries are searched in),
and a text tower (`training/models/text_models.py`: open_clip's `TextTransformer`, CLIP's BPE ids) learns
to put each image's caption near them under a symmetric InfoNCE loss with a learned temperature
(`training/losses/image_text.py`).

Data. The seen classes are the image model's own training classes (its manifest's
`training_data` splits `train` and `val`), or `--catalog`'s. An image's caption is its
`--caption-field` column or, by default, its label's name (`label_caption`: a glyph's Unicode
character name, "LATIN CAPITAL LETTER A"; any other label with '-' and '_' as spaces, an icon's
"document open"). A seeded `--heldout-fraction` of each seen class's images (the glyph set: some
of its fonts) never reaches text training. The unseen classes are the image model's test split
(or `--unseen-catalog`): neither tower trained on them, and their names were never read.

Batches. Captions are mostly class-level, many images sharing one. A step takes `--batch-size`
distinct captions and one image of each (`DistinctCaptionBatches`), so every in-batch negative is
another caption's image; with two images of one caption in a batch, the loss would push each away
from the caption they share.

Evaluation, before the first epoch and after each: text → image Recall@K (`core.retrieval.metrics`). Each
distinct caption of a gallery's images queries it by exact inner product; a hit is an image of the
caption's class among the K nearest. `seen`: the seen classes' captions against their held-out
images; `unseen`: the unseen classes' captions against their images. Beside each, the Recall@K a
random ranking has on that gallery (`chance_recall_at_k`). The tower published is the last
epoch's: no figure selects it, so both are honest.

Ray Train runs the steps (`TorchTrainer`, one worker: a few million parameters over cached vectors
gain nothing from DDP) with a checkpoint per epoch through `ray.train.report`. `--resume` continues
a stopped run from its work directory beside `--out`, the cached embeddings included.

The run directory (`--out`) is what `training export --text` reads; `load_text_run(run)` returns it
as a `TextRun` (the tower built and loaded, and what its manifest needs):

- `checkpoint.pt` (`RUN_CHECKPOINT`), a `torch.save` dict with the keys `RUN_KEYS`:
  `model` — the `TextEmbeddingNet`'s state_dict, for `build_lit_tower(embedding_dim, LitTowerSpec(**spec))`;
  `spec` — `LitTowerSpec.to_dict()`; `image_model_id`, `embedding_dim` — the locked image model's
  (`ModelManifest`); `parity_texts` — up to `PARITY_TEXTS` captions, seen then unseen, for the
  export's parity check; `temperature` — the learned one; `config` — the resolved `TrainTextConfig`.
- `results.json`: `evaluation` (`{"seen": …, "unseen": …}`, each `recall_at_k`, `chance_recall_at_k`,
  `captions`, `images`, `classes`, and `reading`: one line reading R@1 against chance, which
  `train-text` prints beside its figures; `unseen` absent without unseen classes), `history` (a row per
  epoch, the first before training), `image_model`, `train_images`, `train_captions`,
  `train_seconds`, `use_gpu`, `resumed`.
- `config.json`: the resolved options.
- `captions/{train,heldout,unseen}.csv`: the catalogs trained and measured on, with a `caption` column.
- `text_training.png` (unless `--no-plots`): loss and Recall@K per epoch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.artifacts.layout import staging_directory, utc_now, write_json_atomic
from core.artifacts.model_manifests import ModelManifest
from core.config import to_jsonable
from training.losses.image_text import ImageTextContrastiveLoss
from training.models.text_models import LitTowerSpec, TextEmbeddingNet, build_lit_tower
from training.runs.checkpoints import CHECKPOINT_FILE, resume_point, save_checkpoint
from training.runs.ray_run import fit_on_ray, work_directory
from training.runs.telemetry import EpochClock, epoch_logger
from training.runs.train import RESULTS_FILE, START_EPOCH
from training.runs.trainable import Trainable
from training.text.text_config import TrainTextConfig
from training.text.text_data import DATA_FILE, TEXTS_FILE, DistinctCaptionBatches, TextData, check_model, prepare_data
from training.text.text_evaluation import gallery_evaluation, recall_columns, text_to_image_recall

log = logging.getLogger(__name__)

RUN_CHECKPOINT = "checkpoint.pt"
RUN_KEYS = ("model", "spec", "image_model_id", "embedding_dim", "parity_texts", "temperature", "config")
PARITY_TEXTS = 64
PLOT_FILE = "text_training.png"


def build_optimizer(
    cfg: TrainTextConfig, net: torch.nn.Module, loss_fn: torch.nn.Module, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW, the tower with weight decay and the temperature without (decay would pull it
    towards 1); a linear warm-up, then a cosine to 0 at the last step."""
    optimizer = torch.optim.AdamW(
        [
            {"params": list(net.parameters()), "weight_decay": cfg.weight_decay, "name": "tower"},
            {"params": list(loss_fn.parameters()), "weight_decay": 0.0, "name": "temperature"},
        ],
        lr=cfg.lr,
    )
    warm = min(cfg.warmup_steps, max(0, total_steps - 1))
    span = max(1, total_steps - warm)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - warm, span) / span))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_one_epoch(
    trainable: Trainable, data: TextData, batches: DistinctCaptionBatches, epoch: int, device: torch.device
) -> tuple[list[float], float]:
    """One epoch of distinct-caption steps: each step's loss, and the seconds it took."""
    model, loss_fn, optimizer, scheduler = trainable.model, trainable.loss_fn, trainable.optimizer, trainable.scheduler
    ids = torch.from_numpy(data.token_ids)
    images = torch.from_numpy(data.train_embeddings)
    model.train()
    started, losses = time.perf_counter(), []
    for texts, rows in batches.epoch(epoch):
        loss = loss_fn(model(ids[texts].to(device)), images[rows].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - started


def epoch_text(metrics: dict[str, Any], epochs: int, eta_s: float) -> str:
    """One log line per epoch."""
    recall = " ".join(f"{k.replace('_recall_at_', ' R@')}={v:.3f}" for k, v in metrics.items() if "_recall_at_" in k)
    return (
        f"text epoch {metrics['epoch'] + 1}/{epochs} loss={metrics['loss']:.4f} T={metrics['temperature']:.4f} "
        f"{recall} eta {eta_s:.0f}s"
    )


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The Ray Train worker: distinct-caption steps, text → image Recall@K and a checkpoint a
    epoch."""
    import ray.train
    import ray.train.torch

    cfg = TrainTextConfig(**config["train"])
    data = TextData.load(Path(config["data"]))
    device = ray.train.torch.get_device()
    torch.manual_seed(cfg.seed)
    net = build_lit_tower(data.embedding_dim, cfg.spec).to(device)
    loss_fn = ImageTextContrastiveLoss(cfg.temperature).to(device)
    steps = cfg.steps_per_epoch or math.ceil(len(data.train_texts) / cfg.batch_size)
    batches = DistinctCaptionBatches(data.train_texts, cfg.batch_size, steps, cfg.seed)
    optimizer, scheduler = build_optimizer(cfg, net, loss_fn, cfg.epochs * steps)
    trainable = Trainable(ray.train.torch.prepare_model(net), loss_fn, optimizer, scheduler)
    start_epoch, record = resume_point(trainable, device)
    clock = EpochClock(cfg.epochs, start_epoch)

    def report(metrics: dict[str, Any]) -> None:
        import tempfile

        metrics.update(recall_columns(text_to_image_recall(trainable.model, data, cfg.ks, device)))
        record.history.append(metrics)
        if metrics["epoch"] != START_EPOCH:  # the untrained tower's row is chance: the history keeps it
            epoch_logger().info(epoch_text(metrics, cfg.epochs, clock.eta_seconds(metrics["epoch"])))
        with tempfile.TemporaryDirectory() as tmp:
            save_checkpoint(Path(tmp) / CHECKPOINT_FILE, trainable, record, metrics["epoch"])
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))

    if start_epoch == 0:
        report({"epoch": START_EPOCH})  # an untrained tower: the chance a trained one must beat
    for epoch in range(start_epoch, cfg.epochs):
        losses, seconds = train_one_epoch(trainable, data, batches, epoch, device)
        report(
            {
                "epoch": epoch,
                "loss": float(np.mean(losses)),
                "lr": scheduler.get_last_lr()[0],
                "temperature": loss_fn.temperature,
                "captions_per_s": len(losses) * batches.batch_size / max(seconds, 1e-9),
            }
        )


def run_text_training(cfg: TrainTextConfig) -> Path:
    """Embed the images with the locked model, train the tower on Ray Train, publish the run."""
    manifest = check_model(cfg.model)
    cfg = dataclasses.replace(
        cfg, **{n: str(Path(v).resolve()) for n in ("model", "catalog", "unseen_catalog") if (v := getattr(cfg, n))}
    )
    out = Path(cfg.out).resolve()
    work = work_directory(cfg, out)
    if cfg.resume and (work / DATA_FILE).is_file():
        data, texts = TextData.load(work / DATA_FILE), json.loads((work / TEXTS_FILE).read_text())
    else:
        try:
            data, texts, _ = prepare_data(cfg, manifest, work)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)  # nothing to resume: a refused input leaves nothing behind
            raise
    log.debug(  # the demo's screen is full; results.json and the command's summary carry these counts
        "text tower for %s: %d training images, %d distinct texts; galleries %s",
        manifest.model_id,
        len(data.train_texts),
        len(texts),
        ", ".join(f"{n} {len(g.labels)} images / {len(g.query_texts)} captions" for n, g in data.galleries.items()),
    )
    # No checkpoint score (the last epoch's tower is published) and no metrics port (Ray's own).
    result, use_gpu, train_seconds = fit_on_ray(
        train_loop_per_worker,
        {"train": to_jsonable(cfg), "data": str(work / DATA_FILE)},
        name="train-text",
        work=work,
        num_workers=1,  # a few million parameters over cached vectors gain nothing from DDP
        device=cfg.device,
        max_failures=cfg.max_failures,
    )
    if result.checkpoint is None:
        raise RuntimeError("text training finished without a checkpoint")
    with result.checkpoint.as_directory() as d:
        last = torch.load(Path(d) / CHECKPOINT_FILE, map_location="cpu", weights_only=False)
    publish_text_run(out, cfg, manifest, data, texts, last, work, {"train_seconds": train_seconds, "use_gpu": use_gpu})
    shutil.rmtree(work, ignore_errors=True)
    return out


def publish_text_run(
    out: Path,
    cfg: TrainTextConfig,
    manifest: ModelManifest,
    data: TextData,
    texts: list[str],
    last: dict[str, Any],
    work: Path,
    fit: dict[str, Any],
) -> None:
    """The run directory published from the last checkpoint: the tower and what its export needs
    (`RUN_KEYS`), the captioned catalogs, the plot, and `results.json` with each gallery's
    evaluation (`fit`: how the fit ran)."""
    net = build_lit_tower(data.embedding_dim, cfg.spec)
    net.load_state_dict(last["model"])
    temperature = 1.0 / min(math.exp(float(last["loss"]["logit_scale"])), 100.0)
    evaluation = gallery_evaluation(net, data, cfg.ks)
    seen_texts = [texts[i] for i in dict.fromkeys(data.galleries["seen"].query_texts.tolist())]
    unseen_texts = (
        [texts[i] for i in dict.fromkeys(data.galleries["unseen"].query_texts.tolist())]
        if "unseen" in data.galleries
        else []
    )
    with staging_directory(out) as staging:
        torch.save(
            {
                "model": last["model"],
                "spec": cfg.spec.to_dict(),
                "image_model_id": manifest.model_id,
                "embedding_dim": data.embedding_dim,
                "parity_texts": (seen_texts + unseen_texts)[:PARITY_TEXTS],
                "temperature": temperature,
                "config": to_jsonable(cfg),
            },
            staging / RUN_CHECKPOINT,
        )
        shutil.copytree(work / "captions", staging / "captions")
        write_json_atomic(staging / "config.json", to_jsonable(cfg))
        if cfg.plots:
            from training.runs.plots import plot_loss_and_recall

            plot_loss_and_recall(last["history"], staging / PLOT_FILE)
        write_json_atomic(
            staging / RESULTS_FILE,
            {
                "created": utc_now(),
                "image_model": {"model_id": manifest.model_id, "dir": cfg.model, "embedding_dim": data.embedding_dim},
                "evaluation": evaluation,
                "train_images": len(data.train_texts),
                "train_captions": len(np.unique(data.train_texts)),
                "temperature": temperature,
                "history": last["history"],
                "resumed": last.get("resumed", []),
                **fit,
            },
        )


@dataclass
class TextRun:
    """A published train-text run, as `training export --text` takes it."""

    net: TextEmbeddingNet
    spec: LitTowerSpec
    image_model_id: str
    embedding_dim: int
    parity_texts: list[str]
    evaluation: dict[str, Any]
    source: dict[str, Any]


def load_text_run(run: str | Path) -> TextRun:
    """The run directory's tower (built, loaded, in eval mode) and what its manifest needs."""
    run = Path(run)
    path = run / RUN_CHECKPOINT
    if not path.is_file():
        raise ValueError(f"{run} has no {RUN_CHECKPOINT}: not a train-text run (python -m training train-text)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    missing = [k for k in RUN_KEYS if k not in state]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: not a train-text run's checkpoint")
    spec = LitTowerSpec(**state["spec"])
    net = build_lit_tower(state["embedding_dim"], spec)
    net.load_state_dict(state["model"])
    results = json.loads((run / RESULTS_FILE).read_text()) if (run / RESULTS_FILE).is_file() else {}
    return TextRun(
        net=net.eval(),
        spec=spec,
        image_model_id=state["image_model_id"],
        embedding_dim=state["embedding_dim"],
        parity_texts=list(state["parity_texts"]),
        evaluation=results.get("evaluation", {}),
        source={"kind": "lit", "run": str(run.resolve()), "spec": spec.to_dict(), "temperature": state["temperature"]},
    )
