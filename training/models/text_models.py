"""Text towers: a text encoder whose output lands in an image model's embedding space.

Both kinds are open_clip's `TextTransformer` (causal, pooled at the end token, CLIP's BPE ids):
`lit`, a small tower trained here against a locked image model (LiT), and the text tower of an
open_clip model built from its packaged config, with the user's weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from training.models.text_tokenizer import CLIP_END_ID

CLIP_VOCAB_SIZE = 49408  # open_clip's SimpleTokenizer: 49,406 BPE tokens + start and end


@dataclass(frozen=True)
class LitTowerSpec:
    """The shape of a LiT text tower trained here. Names and titles of a catalog are short:
    32 ids hold them, and a few narrow layers learn them on a CPU."""

    context_length: int = 32
    width: int = 256
    heads: int = 4
    layers: int = 4

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class TextEmbeddingNet(nn.Module):
    """Token ids (N, context_length) → L2-normalised embeddings (N, D): a text tower, as exported."""

    def __init__(self, tower: nn.Module, context_length: int) -> None:
        super().__init__()
        self.tower = tower
        self.context_length = context_length

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.tower(input_ids), dim=-1)


def build_lit_tower(embedding_dim: int, spec: LitTowerSpec | None = None) -> TextEmbeddingNet:
    """A freshly initialised LiT tower whose output has the image model's `embedding_dim`."""
    from open_clip.transformer import TextTransformer

    spec = spec or LitTowerSpec()
    tower = TextTransformer(
        context_length=spec.context_length,
        vocab_size=CLIP_VOCAB_SIZE,
        width=spec.width,
        heads=spec.heads,
        layers=spec.layers,
        output_dim=embedding_dim,
        pool_type="argmax",  # the end token has the highest id: pooled where the text ends
        eos_id=CLIP_END_ID,
    )
    return TextEmbeddingNet(tower, spec.context_length)
