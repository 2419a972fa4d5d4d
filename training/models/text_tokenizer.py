"""CLIP's byte-level BPE (the vocabulary open_clip ships inside its package) as a Hugging Face
`tokenizers` file: what a text model artifact carries, so serving tokenizes without open_clip
or torch. The same tokenizer serves open_clip's towers and the LiT towers trained here.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

CLIP_BPE = "clip-bpe"  # the manifest's name for this tokenizer
START, END = "<start_of_text>", "<end_of_text>"
CLIP_END_ID = 49407  # the highest id: a tower pools where the text ends by argmax of the ids
# open_clip's SimpleTokenizer pattern (less its special tokens, which `tokenizers` splits itself)
_CLIP_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def clip_bpe_tokenizer() -> Tokenizer:
    """open_clip's `SimpleTokenizer` (clean "lower": whitespace collapsed, lower case) rebuilt
    from its own vocabulary and merges, ids for ids."""
    from open_clip.tokenizer import SimpleTokenizer

    simple = SimpleTokenizer()
    merges = sorted(simple.bpe_ranks, key=simple.bpe_ranks.__getitem__)
    bpe = models.BPE(
        vocab=dict(simple.encoder),
        merges=list(merges),
        end_of_word_suffix="</w>",
        continuing_subword_prefix="",
        fuse_unk=False,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip(), normalizers.Lowercase()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([START, END])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{START} $A {END}", special_tokens=[(START, simple.sot_token_id), (END, simple.eot_token_id)]
    )
    return tokenizer


def write_clip_bpe(path: str | Path) -> dict[str, object]:
    """Write the CLIP BPE tokenizer to `path`; what the manifest says of it."""
    tokenizer = clip_bpe_tokenizer()
    tokenizer.save(str(path))
    return {"kind": CLIP_BPE, "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)}
