"""open_clip models from the user's own weights: `--backbone open_clip:<config> --pretrained FILE`.

open_clip supplies the architecture from the config it ships (`open_clip.list_models()`), never
the weights: the model is created with `pretrained=None` and no tower's default weights, the hub
switched off, and the user's state dict (a `.safetensors` file or a torch `.bin`/`.pt`/`.pth`, as
open_clip and the Hugging Face hub publish them) is read here and checked key by key against the
config before anything is loaded. The model then splits into its two towers, each exported on its
own: the image tower as an image model (scaled pixels in, normalisation in the graph,
L2-normalised embeddings out) and the text tower as a text model (CLIP BPE ids in).

Only configs whose text tower reads CLIP's BPE ids are taken: the text model artifact carries one
tokenizer (`training/models/text_tokenizer.py`), open_clip's `SimpleTokenizer` rebuilt.

Imported only when an open_clip backbone is named: open_clip imports timm and takes seconds.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core.data.preprocess import DEFAULT_REDUCING_GAP, RESAMPLING, InputContract
from training.models.text_models import CLIP_VOCAB_SIZE, TextEmbeddingNet
from training.models.weight_files import check_weights_fit, hub_offline, read_state_dict, resolve_weights

OPEN_CLIP_PREFIX = "open_clip:"
LIST_CONFIGS = "python -c 'import open_clip; print(open_clip.list_models())'"
# Parameters of the contrastive loss, not of either tower: a checkpoint may lack them.
LOSS_KEYS = ("logit_scale", "logit_bias")


def is_open_clip(backbone: str | None) -> bool:
    return bool(backbone) and str(backbone).startswith(OPEN_CLIP_PREFIX)


def _open_clip():
    """open_clip, imported with the Hugging Face hub switched off: an architecture is all it
    may supply."""
    hub_offline()
    import open_clip

    return open_clip


def config_name(backbone: str) -> str:
    return backbone.removeprefix(OPEN_CLIP_PREFIX)


def check_open_clip_config(backbone: str, tag: str | None = None) -> dict[str, Any]:
    """The config of `open_clip:<name>`, checked before anything is built: a name open_clip ships,
    a text tower that reads CLIP BPE ids, the pretrained tag (if given) one of the config's.
    ValueError saying what instead."""
    open_clip = _open_clip()
    name = config_name(backbone)
    if not name:
        raise ValueError(f"--backbone {backbone}: name an open_clip config after 'open_clip:', e.g. open_clip:ViT-B-32")
    if name.startswith(("hf-hub:", "local-dir:")):
        raise ValueError(
            f"--backbone {backbone}: only open_clip's packaged configs are taken (nothing is downloaded); the weights "
            "go in --pretrained"
        )
    config = open_clip.get_model_config(name)
    if config is None:
        names = open_clip.list_models()
        nearest = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
        raise ValueError(
            f"unknown open_clip config {name!r}; nearest: {', '.join(nearest) or '(none)'} ({LIST_CONFIGS} "
            f"names all {len(names)})"
        )
    text = config.get("text_cfg", {})
    reads = (
        "a Hugging Face text model's ids"
        if text.get("hf_model_name") or text.get("hf_tokenizer_name")
        else "a captioning decoder's tokens (CoCa)"
        if "multimodal_cfg" in config
        else f"a vocabulary of {text['vocab_size']:,} ids"
        if text.get("vocab_size", CLIP_VOCAB_SIZE) != CLIP_VOCAB_SIZE
        else None
    )
    if reads is not None:
        raise ValueError(
            f"open_clip config {name!r}: its text tower reads {reads}, not CLIP's BPE ids; the text model artifact "
            "carries CLIP's BPE tokenizer only (configs such as ViT-B-32, ViT-L-14, RN50 or convnext_base read it)"
        )
    if tag is not None:
        tags = open_clip.list_pretrained_tags_by_model(name)
        if tag not in tags:
            raise ValueError(
                f"--open-clip-tag {tag}: open_clip has no pretrained tag {tag!r} for {name}; its tags: "
                f"{', '.join(tags) or '(none)'}"
            )
    return config


def open_clip_contract(backbone: str, tag: str | None = None) -> InputContract:
    """The image tower's input contract: the size of the config, and the preprocessing open_clip
    gives the weights of `tag` (its table, no download) or, without a tag, the config's own
    (OpenAI's mean/std, bicubic): shorter side resized to the size, centre crop."""
    open_clip = _open_clip()
    config = check_open_clip_config(backbone, tag)
    name = config_name(backbone)
    cfg = dict(open_clip.get_pretrained_cfg(name, tag)) if tag else {}
    from open_clip.transform import PreprocessCfg

    defaults = PreprocessCfg()
    size = config["vision_cfg"].get("image_size", defaults.size)
    height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    mode = cfg.get("resize_mode", defaults.resize_mode)
    if mode != "shortest" or height != width:
        raise ValueError(
            f"open_clip:{name}{f' ({tag})' if tag else ''} resizes images by {mode!r} to {height}x{width}; an input "
            "contract resizes the shorter side and crops a square centre (open_clip's 'shortest')"
        )
    interpolation = cfg.get("interpolation", defaults.interpolation)
    if interpolation not in RESAMPLING:
        raise ValueError(f"open_clip:{name}: interpolation {interpolation!r} is not one of {', '.join(RESAMPLING)}")
    return InputContract(
        height=height,
        width=width,
        channels=3,
        resize=height,
        mean=tuple(float(v) for v in cfg.get("mean", defaults.mean)),
        std=tuple(float(v) for v in cfg.get("std", defaults.std)),
        normalize_in_graph=True,
        reducing_gap=DEFAULT_REDUCING_GAP,
        exif_orientation=True,
        interpolation=interpolation,
    )


class OpenClipImageNet(nn.Module):
    """(x − mean)/std → open_clip's image tower (its own pooling and projection) → L2 normalise:
    scaled pixels in, as every image model here takes them."""

    def __init__(self, visual: nn.Module, contract: InputContract, embedding_dim: int) -> None:
        super().__init__()
        self.visual = visual
        self.register_buffer("mean", torch.tensor(contract.mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(contract.std).view(1, -1, 1, 1))
        self.embedding_dim = embedding_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.visual((x - self.mean) / self.std), dim=-1)


class OpenClipTextTower(nn.Module):
    """open_clip's text tower, as the model encodes text (token embedding, causal transformer,
    pooling at the end token, projection), without its image tower."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.encode_text(input_ids, normalize=False)


@dataclass
class OpenClipTowers:
    """Both towers of one open_clip model with the user's weights, and what manifests say of them."""

    image: OpenClipImageNet
    text: TextEmbeddingNet
    contract: InputContract
    embedding_dim: int
    config: dict[str, Any]
    weights: Path


def load_open_clip(backbone: str, pretrained: str | Path, tag: str | None = None) -> OpenClipTowers:
    """open_clip:<config> built offline with the weights of `pretrained` loaded and checked; the
    model split into its image and text towers, in eval mode."""
    open_clip = _open_clip()
    config = check_open_clip_config(backbone, tag)
    contract = open_clip_contract(backbone, tag)
    weights = resolve_weights(pretrained)
    state = read_state_dict(weights)
    quiet = logging.root.manager.disable
    logging.disable(logging.WARNING)  # open_clip warns "initialized randomly": the weights come next
    try:
        model = open_clip.create_model(
            config_name(backbone), pretrained=None, pretrained_image=False, pretrained_text=False, device="cpu"
        )
    finally:
        logging.disable(quiet)
    load_open_clip_weights(model, state, backbone)
    model.eval()
    visual = model.visual
    model.visual = None  # the text tower's graph holds no image weights
    dim = int(config["embed_dim"])
    context = int(model.context_length if hasattr(model, "context_length") else model.text.context_length)
    return OpenClipTowers(
        image=OpenClipImageNet(visual, contract, dim).eval(),
        text=TextEmbeddingNet(OpenClipTextTower(model), context).eval(),
        contract=contract,
        embedding_dim=dim,
        config=config,
        weights=weights,
    )


def load_open_clip_weights(model: nn.Module, state: dict[str, torch.Tensor], backbone: str) -> None:
    """Load an open_clip checkpoint's state dict into `model`, through open_clip's own converters
    (third-party layouts, a text tower kept at the top level or under `text.`); keys or shapes that
    do not fit → ValueError naming the first missing and unexpected ones."""
    from open_clip.model import convert_to_custom_text_state_dict

    name = f"open_clip:{config_name(backbone)}"
    try:
        from open_clip.factory import convert_state_dict

        state = convert_state_dict(model, state)
    except Exception as exc:  # noqa: BLE001 — a converter fed another architecture's keys
        raise ValueError(f"weights do not fit {name}: open_clip's converter failed ({exc})") from None
    if "positional_embedding" in state and not hasattr(model, "positional_embedding"):
        state = convert_to_custom_text_state_dict(state)  # the text tower under `text.`
    expected = model.state_dict()
    for key in LOSS_KEYS:  # neither tower reads them: the model's own when the file has none
        if key in expected and key not in state:
            state[key] = expected[key]
        elif key in expected and state[key].ndim != expected[key].ndim:
            state[key] = state[key].reshape(expected[key].shape)
    check_weights_fit(
        state,
        expected,
        name,
        "config",
        f"weights of another config? ({LIST_CONFIGS} names them)",
        lambda key: " — weights of another size of it?",
    )
    model.load_state_dict(state, strict=True)
