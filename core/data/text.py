"""Text for a text tower: tokenized by Hugging Face `tokenizers` from the text model artifact's
`tokenizer.json`, so every stage — serving included — tokenizes the same way without torch.

The ids follow CLIP's convention, which both text towers (the user's open_clip weights and one
trained here with LiT) share: a start token, the text's tokens, an end token, zero padding to the
model's context length. A text longer than the context is refused, not truncated: a query cut
short silently answers a different question than the one asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

TEXT_MODEL_FILE = "text.onnx"  # input_ids int64 (N, context_length) → embeddings float32 (N, D)
TOKENIZER_FILE = "tokenizer.json"
TEXT_INPUT = "input_ids"
MAX_TEXT_CHARS = 2_000  # a query's text, checked before tokenizing it


class TextInputError(ValueError):
    """A text this model cannot embed: empty, too long, or not text."""


class TextTokenizer:
    """Texts to the zero-padded (N, context_length) int64 ids a text tower reads."""

    def __init__(self, path: str | Path, context_length: int) -> None:
        from tokenizers import Tokenizer

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: the tokenizer file is missing")
        try:
            self._tokenizer = Tokenizer.from_file(str(self.path))
        except Exception as exc:  # tokenizers raises its own Exception for a file it cannot parse
            raise ValueError(f"{self.path} is not a tokenizer file `tokenizers` can read ({exc})") from exc
        if context_length < 3:
            raise ValueError(f"context length must be at least 3 (start, one token, end), got {context_length}")
        self.context_length = context_length

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_ids(self, text: str) -> list[int]:
        """`text`'s ids with the start and end tokens, unpadded and untruncated."""
        return self._tokenizer.encode(text).ids

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Ids of `texts`, one row each; TextInputError naming the first text that cannot be one
        (its position in `texts`, when there are several)."""
        ids = np.zeros((len(texts), self.context_length), dtype=np.int64)
        for row, text in enumerate(texts):
            where = f"text {row}: " if len(texts) > 1 else ""
            tokens = self._tokenizer.encode(check_text(text, where)).ids
            if len(tokens) > self.context_length:
                raise TextInputError(
                    f"{where}the text is {len(tokens)} tokens with its start and end tokens; this text model "
                    f"reads at most {self.context_length}: shorten it"
                )
            ids[row, : len(tokens)] = tokens
        return ids


def check_text(text: object, where: str = "") -> str:
    """`text` as a query's text: a non-blank string of at most MAX_TEXT_CHARS characters."""
    if not isinstance(text, str):
        raise TextInputError(f"{where}text must be a string, got {type(text).__name__}")
    if not text.strip():
        raise TextInputError(f"{where}text is empty")
    if len(text) > MAX_TEXT_CHARS:
        raise TextInputError(f"{where}text is {len(text)} characters; at most {MAX_TEXT_CHARS}")
    return text
