"""The manifests of the model artifacts: an image model's (`training export` writes it) and a
text model's, made for one image model's space; and the check that a text model answers in the
space of the image model it is paired with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from core.artifacts.layout import ArtifactError
from core.artifacts.manifests import SCHEMA_VERSION, Manifest, ManifestFields, without_none
from core.data.preprocess import InputContract


@dataclass
class ModelManifest(Manifest):
    """`manifest.json` of a model artifact (training/export/export.py writes it)."""

    model_id: str
    embedding_dim: int
    input: InputContract
    backbone: str | None = None
    pooling: str | None = None
    loss: dict[str, Any] | None = None  # None: a pretrained trunk, no training
    training_data: dict[str, Any] | None = None  # {"catalog", "splits": {name: csv path}}
    evaluation: dict[str, Any] | None = None
    output: dict[str, Any] = field(default_factory=lambda: {"name": "embeddings", "l2_normalized": True})
    opset: int | None = None
    created: str | None = None
    exporter: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    # Written only when they have a value:
    pretrained: dict[str, Any] | None = None  # {"source", "sha256"} of a pretrained export
    parity: dict[str, Any] | None = None  # ONNX Runtime vs PyTorch, once measured
    variant: dict[str, Any] | None = None  # a reduced-precision copy: its name, base and recall drop
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    _OPTIONAL: ClassVar[tuple[str, ...]] = ("pretrained", "parity", "variant")

    @property
    def test_split(self) -> str | None:
        """The test split's catalog of the training run (None: a pretrained export has none)."""
        splits = self.training_data.get("splits") if self.training_data else None
        return splits.get("test") if splits else None

    @classmethod
    def _parse(cls, fields: ManifestFields, version: int) -> ModelManifest:
        source = fields.source
        raw_input = fields.get("input", dict)
        try:
            contract = InputContract.from_dict(raw_input)
        except (TypeError, ValueError) as exc:
            raise ArtifactError(f"{source}: field 'input' is not an input contract ({exc})") from exc
        dim = fields.get("embedding_dim", int)
        if dim <= 0:
            raise ArtifactError(f"{source}: field 'embedding_dim' must be positive, got {dim}")
        model_id = fields.get("model_id", str)
        if not model_id:
            raise ArtifactError(f"{source}: field 'model_id' is empty")
        training_data = fields.section_of("training_data", required=False)
        if training_data is not None:
            training_data.get("splits", dict, required=False)
        return cls(
            model_id=model_id,
            embedding_dim=dim,
            input=contract,
            backbone=fields.get("backbone", str, required=False),
            pooling=fields.get("pooling", str, required=False),
            loss=fields.get("loss", dict, required=False),
            training_data=None if training_data is None else dict(training_data.data),
            evaluation=fields.get("evaluation", dict, required=False),
            output=fields.get("output", dict, required=False, default={"name": "embeddings", "l2_normalized": True}),
            opset=fields.get("opset", int, required=False),
            created=fields.get("created", str, required=False),
            exporter=fields.get("exporter", dict, required=False, default={}),
            config=fields.get("config", dict, required=False, default={}),
            pretrained=fields.get("pretrained", dict, required=False),
            parity=fields.get("parity", dict, required=False),
            variant=fields.get("variant", dict, required=False),
            schema_version=version,
            extra=fields.rest(),
        )

    def _dict(self) -> dict[str, Any]:
        d = self._values()
        d["input"] = self.input.to_dict()
        return without_none(d, self._OPTIONAL)


@dataclass
class TextModelManifest(Manifest):
    """`manifest.json` of a text model artifact (`training export --text`): a text tower whose
    embeddings share the space of image model `image_model_id`, its ONNX graph reading the ids
    its `tokenizer.json` makes (`core/data/text.py`)."""

    text_model_id: str
    image_model_id: str  # the image model whose space it embeds into: the only one it can search
    embedding_dim: int
    context_length: int  # ids a text may take, start and end tokens included
    source: dict[str, Any]  # {"kind": "lit", "run": …} or {"kind": "open_clip", "config", "pretrained"}
    tokenizer: dict[str, Any] = field(default_factory=dict)  # {"file", "sha256", "vocab_size", "kind"}
    files: dict[str, str] = field(default_factory=dict)  # file name → sha256
    opset: int | None = None
    created: str | None = None
    exporter: dict[str, Any] = field(default_factory=dict)
    parity: dict[str, Any] | None = None  # ONNX Runtime vs PyTorch on real texts
    evaluation: dict[str, Any] | None = None  # text → image Recall@K, where measured
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    _OPTIONAL: ClassVar[tuple[str, ...]] = ("parity", "evaluation", "opset", "created")

    @classmethod
    def _parse(cls, fields: ManifestFields, version: int) -> TextModelManifest:
        source = fields.source
        if "text_model_id" not in fields.data and "model_id" in fields.data:
            raise ArtifactError(f"{source} is an image model's manifest, not a text model's (no 'text_model_id')")
        dim = fields.get("embedding_dim", int)
        if dim <= 0:
            raise ArtifactError(f"{source}: field 'embedding_dim' must be positive, got {dim}")
        context = fields.get("context_length", int)
        if context < 3:
            raise ArtifactError(f"{source}: field 'context_length' must be at least 3, got {context}")
        for name in ("text_model_id", "image_model_id"):
            if not fields.data.get(name):
                raise ArtifactError(f"{source}: field {name!r} is missing or empty")
        return cls(
            text_model_id=fields.get("text_model_id", str),
            image_model_id=fields.get("image_model_id", str),
            embedding_dim=dim,
            context_length=context,
            source=fields.get("source", dict),
            tokenizer=fields.get("tokenizer", dict, required=False, default={}),
            files=fields.get("files", dict, required=False, default={}),
            opset=fields.get("opset", int, required=False),
            created=fields.get("created", str, required=False),
            exporter=fields.get("exporter", dict, required=False, default={}),
            parity=fields.get("parity", dict, required=False),
            evaluation=fields.get("evaluation", dict, required=False),
            schema_version=version,
            extra=fields.rest(),
        )

    def _dict(self) -> dict[str, Any]:
        return without_none(self._values(), self._OPTIONAL)


def check_text_model_pair(text_manifest: TextModelManifest, model_id: str, where: str) -> None:
    """A text model answers only in the space of the image model it was made for: ArtifactError
    naming both ids when `model_id` (the image model of `where`) is another."""
    if text_manifest.image_model_id != model_id:
        raise ArtifactError(
            f"text model {text_manifest.text_model_id} embeds into the space of image model "
            f"{text_manifest.image_model_id}, but {where} uses image model {model_id}: train or export a text "
            f"model for {model_id} (`python -m training train-text`, `training export --text`)"
        )
