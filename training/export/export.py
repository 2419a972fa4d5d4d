"""ONNX export of a trained run — or of a pretrained network with no training run — verified
against PyTorch before it is published.

The exported graph takes scaled pixels (N×C×H×W float32 in [0, 1]) with a dynamic batch axis
and returns L2-normalised embeddings; the input contract goes into the manifest, which every
downstream stage reads. The export fails, and nothing is published, if ONNX Runtime and PyTorch
disagree on real images.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from core.artifacts.layout import MODEL_FILE, ArtifactError, file_sha256, staging_directory, utc_now
from core.artifacts.model_manifests import ModelManifest
from core.cli import verbose
from core.config import option
from core.data.catalog import Catalog, read_catalog
from core.data.preprocess import ImageDecodeError, InputContract, load_image
from core.progress import stage
from index.embedder import OnnxEmbedder
from training.data.splits import load_images
from training.export.parity import DEFAULT_OPSET, MIN_PARITY_COSINE, ExportError, cosine_parity
from training.models.backbone_specs import ALL_POOLINGS
from training.models.forward import embed_images
from training.models.models import EmbeddingNet, check_backbone, input_contract
from training.models.open_clip_models import (
    OpenClipTowers,
    config_name,
    is_open_clip,
    load_open_clip,
    open_clip_contract,
)
from training.models.weight_files import WEIGHTS_HELP, resolve_weights
from training.runs.checkpoints import CHECKPOINT_FILE
from training.runs.train import RESULTS_FILE
from training.text.train_text import RUN_CHECKPOINT

log = logging.getLogger(__name__)

DEFAULT_TEXT_RUN = "runs/text"  # where `training train-text` publishes by default
DEFAULT_TEXT_NAME = "text-model"
DEFAULT_TEXT_OUT = f"runs/{DEFAULT_TEXT_NAME}"


def _fp16(source: Path, target: Path) -> None:
    from onnxconverter_common.float16 import convert_float_to_float16

    # Inputs and outputs stay float32 so callers and the input contract do not change.
    onnx.save(convert_float_to_float16(onnx.load(str(source)), keep_io_types=True), str(target))


def _int8(source: Path, target: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)


VARIANTS = {"fp16": _fp16, "int8": _int8}


@dataclass
class ExportConfig:
    """`training export`: a training run, or a pretrained network as it is (day one, no labels:
    the trunk and its pooling, L2-normalised, no head), to a verified ONNX model artifact; with
    `--text`, a train-text run's tower to a text model artifact; with `--backbone open_clip:<config>`,
    both towers of the user's open_clip weights, an image model and a text model."""

    run: str | None = option(
        None,
        help="training run directory (default: runs/train unless --pretrained is given; with --text: a train-text "
        "run, default runs/text)",
    )
    text: bool = option(
        False, help="export a train-text run's text tower (--run) to a text model artifact instead of an image model"
    )
    backbone: str | None = option(
        None,
        help="with --pretrained: export this network with no training run (a name, timm:<architecture>, or "
        "open_clip:<config> — both towers, the text one to --text-out)",
    )
    pretrained: str | None = option(
        None,
        help=WEIGHTS_HELP,
    )
    pooling: str | None = option(
        None,
        choices=ALL_POOLINGS,
        help="with --pretrained: how the features become a vector (gap/gmp/gap+gmp of a CNN's map; cls, mean or "
        "map of a transformer's tokens); default: the backbone's own",
    )
    image_size: int | None = option(None, help="with --pretrained: input side in px (default: the backbone's)")
    open_clip_tag: str | None = option(
        None,
        help="with --backbone open_clip:<config>: the pretrained tag the weights are (e.g. laion2b_s34b_b79k), "
        "whose image preprocessing — mean/std, filter — open_clip's own table gives (nothing downloaded); default: "
        "the config's (OpenAI's mean/std, bicubic)",
    )
    parity_catalog: str | None = option(
        None,
        help="images to check ONNX against PyTorch on (default: the run's test split; with --pretrained, "
        "which has no run, random pixels)",
    )
    out: str | None = option(
        None, help="artifact directory to publish (default: runs/model; with --text: runs/text-model)"
    )
    text_out: str | None = option(
        None,
        help="with --backbone open_clip:<config>: the text model artifact directory (default: text-model beside --out)",
    )
    opset: int = option(DEFAULT_OPSET, help="ONNX opset")
    parity_images: int = option(256, help="images the parity check embeds with both runtimes")
    min_cosine: float = option(MIN_PARITY_COSINE, help="least cosine between ONNX and PyTorch embeddings")
    variants: list[str] = option(
        default_factory=list,
        help="reduced-precision copies to publish beside it, each with its recall drop on the run's test split "
        "(with --pretrained: on a labelled --parity-catalog): fp16,int8",
    )

    def __post_init__(self) -> None:
        unknown = sorted(set(self.variants) - set(VARIANTS))
        if unknown:
            raise ValueError(f"unknown variant(s) {', '.join(unknown)}; available: {', '.join(VARIANTS)}")
        if self.parity_images <= 0:
            raise ValueError("parity_images must be positive")
        if self.text:
            self._check_text()
            return
        open_clip = is_open_clip(self.backbone)
        for name, value in (("--text-out", self.text_out), ("--open-clip-tag", self.open_clip_tag)):
            if value is not None and not open_clip:
                raise ValueError(f"{name} goes with --backbone open_clip:<config> (its text tower's artifact)")
        self.out = self.out or "runs/model"
        if self.pretrained is not None or self.backbone is not None:
            if self.run is not None:
                raise ValueError("export takes --run (a training run) or --backbone with --pretrained, not both")
            if self.pretrained is None or self.backbone is None:
                raise ValueError("exporting a pretrained network needs both --backbone and --pretrained")
            if open_clip:
                self._check_open_clip()
            else:
                self.pooling = check_backbone(self.backbone, self.pooling, self.image_size)
            if self.variants and self.parity_catalog is None:
                raise ValueError(
                    "--variants measure their recall on labelled images: a training run's test split, or with "
                    "--pretrained a labelled --parity-catalog"
                )
            return
        self.run = self.run or "runs/train"

    def _check_text(self) -> None:
        """`--text`: a train-text run, and none of the image export's options."""
        image_only = {
            "--backbone": self.backbone,
            "--pretrained": self.pretrained,
            "--pooling": self.pooling,
            "--image-size": self.image_size,
            "--open-clip-tag": self.open_clip_tag,
            "--parity-catalog": self.parity_catalog,
            "--text-out": self.text_out,
            "--variants": self.variants or None,
        }
        given = [flag for flag, value in image_only.items() if value is not None]
        if given:
            raise ValueError(
                f"--text exports a train-text run (--run) to --out; {', '.join(given)} "
                f"{'is' if len(given) == 1 else 'are'} for an image model's export"
            )
        self.run = self.run or DEFAULT_TEXT_RUN
        self.out = self.out or DEFAULT_TEXT_OUT

    def _check_open_clip(self) -> None:
        """`--backbone open_clip:<config>`: a config open_clip ships whose text tower reads CLIP
        BPE ids; it pools and sizes itself; its text model goes beside the image model."""
        for flag, value in (("--pooling", self.pooling), ("--image-size", self.image_size)):
            if value is not None:
                raise ValueError(
                    f"{flag}: an open_clip image tower pools and sizes its input as its config says ({self.backbone})"
                )
        open_clip_contract(self.backbone, self.open_clip_tag)  # the config, its tokenizer, the tag
        self.text_out = self.text_out or str(Path(self.out).with_name(DEFAULT_TEXT_NAME))
        if Path(self.text_out).resolve() == Path(self.out).resolve():
            raise ValueError(f"--text-out {self.text_out} is --out: the image and text models are two artifacts")

    def check_inputs(self) -> None:
        """What reads files, before anything is built: the run, the weights, the parity images."""
        if self.text:
            if not (Path(self.run) / RUN_CHECKPOINT).is_file():
                raise ValueError(
                    f"--run {self.run}: no {RUN_CHECKPOINT}, not a train-text run; pass --run a directory "
                    "`python -m training train-text` published (its --out)"
                )
            return
        if self.parity_catalog is not None and not Path(self.parity_catalog).exists():
            raise ValueError(f"--parity-catalog {self.parity_catalog} does not exist")
        if self.variants and self.pretrained is not None:
            read_catalog(self.parity_catalog).require_labels("measuring --variants' recall")
        if self.pretrained is not None:
            resolve_weights(self.pretrained)
            if not is_open_clip(self.backbone):
                input_contract(self.backbone, self.image_size, self.pretrained)  # a folder's config.json
        elif not (Path(self.run) / CHECKPOINT_FILE).is_file():
            raise ValueError(f"{self.run}: no {CHECKPOINT_FILE}; pass a training run directory")


def load_trained_model(run: Path) -> tuple[EmbeddingNet, dict, InputContract]:
    state = torch.load(run / CHECKPOINT_FILE, map_location="cpu", weights_only=False)
    cfg = state["config"]
    contract = InputContract.from_dict(state["contract"])
    # Built at the size it was trained at: a ViT's position embeddings are as many as its patches.
    model = EmbeddingNet(cfg["backbone"], cfg["embedding_dim"], cfg["pooling"], image_size=contract.height)
    model.load_state_dict(state["model"])
    return model.eval(), cfg, contract


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
        verbose=verbose(),  # the exporter prints a line per pass otherwise
    )
    onnx.checker.check_model(str(path), full_check=True)


def parity_check(model: nn.Module, model_dir: Path, images: np.ndarray, min_cosine: float) -> dict[str, float]:
    """Cosine between ONNX Runtime and PyTorch embeddings for every image."""
    reference = embed_images(model, images)
    return cosine_parity(reference, OnnxEmbedder(model_dir, provider="cpu").embed(images), min_cosine, "images")


def _trained_source(cfg: ExportConfig) -> tuple[EmbeddingNet, InputContract, dict, Path | None]:
    """A training run's model, contract, manifest fields and test split."""
    run = Path(cfg.run)
    model, train_cfg, contract = load_trained_model(run)
    results = _read_json(run / RESULTS_FILE)
    fields = {
        "backbone": train_cfg["backbone"],
        "embedding_dim": model.embedding_dim,  # the trunk's width when the run had no head
        "pooling": train_cfg["pooling"],
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
        "config": {"train": train_cfg},
    }
    return model, contract, fields, run / "splits" / "test.csv"


def _pretrained_source(cfg: ExportConfig) -> tuple[EmbeddingNet, InputContract, dict, Path | None]:
    """The pretrained trunk as it is: no training, no head (a random projection would only
    lose what the network knows), so the embedding is its pooled features."""
    assert cfg.backbone is not None and cfg.pretrained is not None
    model = EmbeddingNet(cfg.backbone, None, cfg.pooling, pretrained=cfg.pretrained, image_size=cfg.image_size).eval()
    weights = resolve_weights(cfg.pretrained)
    fields = {
        "backbone": cfg.backbone,
        "embedding_dim": model.embedding_dim,
        "pooling": cfg.pooling,
        "loss": None,
        "pretrained": {"source": cfg.pretrained, "sha256": file_sha256(weights)},
        "training_data": None,  # no training run: `index build` needs --catalog
        "evaluation": None,
        "config": {"train": None},
    }
    return model, input_contract(cfg.backbone, cfg.image_size, cfg.pretrained), fields, None


def parity_images(catalog: Catalog, contract: InputContract, count: int) -> np.ndarray | None:
    """Up to `count` of a catalog's images, spread over it, as the model takes them — labelled or
    not (parity needs pixels, not classes); None when none of them can be read."""
    step = max(1, len(catalog) // count)
    sample = catalog.subset(range(0, len(catalog), step)[:count])
    arrays = []
    for path in sample.paths:
        try:
            arrays.append(load_image(path, contract))
        except ImageDecodeError as exc:
            log.warning("parity check: skipping %s: %s", path, exc)
    return np.stack(arrays) if arrays else None


def _open_clip_source(cfg: ExportConfig, towers: OpenClipTowers) -> tuple[nn.Module, InputContract, dict, None]:
    """open_clip's image tower with the user's weights, as it is: its own pooling and projection
    into the space its text tower shares, L2-normalised."""
    fields = {
        "backbone": cfg.backbone,
        "embedding_dim": towers.embedding_dim,
        "pooling": None,  # the tower's own (a class token, attention pooling, a ResNet's attention pool)
        "loss": None,
        "pretrained": {"source": cfg.pretrained, "sha256": file_sha256(towers.weights), "tag": cfg.open_clip_tag},
        "training_data": None,
        "evaluation": None,
        "config": {"train": None, "open_clip": towers.config},
    }
    return towers.image, towers.contract, fields, None


def run_export(cfg: ExportConfig) -> Path:
    """Export what `cfg` names and return the artifact published: the image model's (with
    `--backbone open_clip:<config>`, its text model too, at `cfg.text_out`), or with `--text` the
    text model's."""
    cfg.check_inputs()
    if cfg.text:
        return run_text_export(cfg)
    towers = None
    # Loading, tracing and the parity check each take seconds to a minute: each says so.
    with stage(f"export: loading {_what(cfg)}"):
        if is_open_clip(cfg.backbone):
            towers = load_open_clip(cfg.backbone, cfg.pretrained, cfg.open_clip_tag)
            model, contract, fields, test_split = _open_clip_source(cfg, towers)
        else:
            source = _pretrained_source if cfg.pretrained else _trained_source
            model, contract, fields, test_split = source(cfg)
    parity_catalog = Path(cfg.parity_catalog) if cfg.parity_catalog else test_split
    out = Path(cfg.out)
    with staging_directory(out) as staging:
        with stage(f"export: tracing the model to ONNX (opset {cfg.opset}) and checking the graph"):
            export_onnx(model, contract, staging / MODEL_FILE, cfg.opset)
        model_id = file_sha256(staging / MODEL_FILE)[:16]
        config = fields.pop("config")
        manifest = ModelManifest(
            model_id=model_id,
            **fields,
            input=contract,
            output={"name": "embeddings", "l2_normalized": True},
            opset=cfg.opset,
            created=utc_now(),
            exporter={"torch": torch.__version__, "onnx": onnx.__version__, "python": platform.python_version()},
            config={**config, "export": {k: v for k, v in vars(cfg).items()}},
        )
        manifest.write(staging)
        images = None
        if parity_catalog is not None and parity_catalog.exists():  # a catalog file or a folder of images
            images = parity_images(read_catalog(parity_catalog), contract, cfg.parity_images)
            source = str(parity_catalog.resolve()) + ("" if cfg.parity_catalog else " (the run's test split)")
        if images is None:
            images = np.random.default_rng(0).random((cfg.parity_images, *contract.input_shape), dtype=np.float32)
            if cfg.parity_catalog:
                why = f"--parity-catalog {parity_catalog} holds no readable image"
            elif cfg.pretrained:
                why = "no training run, no --parity-catalog"
            else:
                why = "the run records no test split" if parity_catalog is None else f"{parity_catalog} is missing"
            source = f"random pixels ({why})"
        # What the check ran on, in the manifest and the log: random pixels are not real images.
        with stage(f"export: parity check, PyTorch and ONNX Runtime embedding {len(images)} images"):
            manifest.parity = {**parity_check(model, staging, images, cfg.min_cosine), "source": source}
        manifest.write(staging)
        if towers is not None:
            # Inside the image model's staging: a text tower that fails its parity publishes
            # neither, and the text model names an image model that exists.
            _export_open_clip_text(cfg, towers, model_id, manifest.pretrained or {})
    log.info("exported model %s to %s (parity %s)", model_id, out, manifest.parity)
    # A day-one export has no test split: its variants are measured on its labelled parity images.
    ks = (config["train"] or {}).get("ks", [1, 2, 4, 8])
    for name in cfg.variants:
        export_variant(out, name, Path(cfg.parity_catalog) if cfg.pretrained else test_split, ks)
    return out


def _what(cfg: ExportConfig) -> str:
    """What `run_export` loads, in the words of its first progress line."""
    if cfg.pretrained:
        return f"{cfg.backbone} with the weights {cfg.pretrained}"
    return f"the trained model of {cfg.run}"


def _export_open_clip_text(cfg: ExportConfig, towers: OpenClipTowers, model_id: str, pretrained: dict) -> Path:
    from training.export.text_export import DEFAULT_PARITY_TEXTS, export_text_model

    assert cfg.backbone is not None and cfg.text_out is not None
    source = {
        "kind": "open_clip",
        "config": config_name(cfg.backbone),
        "pretrained": pretrained.get("source"),
        "sha256": pretrained.get("sha256"),
        "tag": pretrained.get("tag"),
    }
    return export_text_model(
        towers.text, cfg.text_out, model_id, source, DEFAULT_PARITY_TEXTS, opset=cfg.opset, min_cosine=cfg.min_cosine
    )


def run_text_export(cfg: ExportConfig) -> Path:
    """`export --text`: a train-text run's tower (`training.text.train_text.load_text_run`) to the text
    model artifact `cfg.out`, checked on the captions the run measured on."""
    from training.export.text_export import export_text_model
    from training.text.train_text import load_text_run

    run = load_text_run(cfg.run)
    return export_text_model(
        run.net,
        cfg.out,
        run.image_model_id,
        run.source,
        run.parity_texts,
        run.evaluation or None,
        opset=cfg.opset,
        min_cosine=cfg.min_cosine,
    )


def export_variant(base: Path, name: str, test_catalog: Path, ks: list[int]) -> Path:
    """Publish `<base>-<name>`: a reduced-precision copy with its Recall@K drop measured."""
    from core.retrieval.metrics import recall_at_k

    manifest = ModelManifest.read(base)
    target = base.with_name(f"{base.name}-{name}")
    if not test_catalog.exists():
        raise ExportError(f"variant {name}: no test split at {test_catalog} to measure its recall on")
    test = load_images(read_catalog(test_catalog), manifest.input, max_bad_fraction=1.0)
    base_recall = recall_at_k(OnnxEmbedder(base, provider="cpu").embed(test.images), test.labels, ks)
    with staging_directory(target) as staging:
        VARIANTS[name](base / MODEL_FILE, staging / MODEL_FILE)
        onnx.checker.check_model(str(staging / MODEL_FILE))
        variant_id = file_sha256(staging / MODEL_FILE)[:16]
        variant = {"name": name, "base_model_id": manifest.model_id}
        variant_manifest = dataclasses.replace(manifest, model_id=variant_id, variant=variant, created=utc_now())
        variant_manifest.write(staging)
        recall = recall_at_k(OnnxEmbedder(staging, provider="cpu").embed(test.images), test.labels, ks)
        variant.update(
            test_images=len(test.ids),
            recall_at_k={str(k): v for k, v in recall.items()},
            base_recall_at_k={str(k): v for k, v in base_recall.items()},
            recall_drop={str(k): base_recall[k] - recall[k] for k in ks},
            size_bytes=(staging / MODEL_FILE).stat().st_size,
            base_size_bytes=(base / MODEL_FILE).stat().st_size,
        )
        variant_manifest.write(staging)
    log.info("variant %s: Recall@K drop %s", name, variant["recall_drop"])
    return target


def _read_json(path: Path) -> dict:
    import json

    if not path.is_file():
        raise ArtifactError(f"{path} is missing")
    return json.loads(path.read_text(encoding="utf-8"))
