"""A text tower measured: text → image Recall@K of each gallery (`TextData`'s), beside the
Recall@K a random ranking has on it, as the worker's history rows and results.json's
`evaluation` report them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from core.retrieval.metrics import query_gallery_recall_at_k
from training.runs.trainable import unwrap
from training.text.text_data import TextData


def embed_texts(net: torch.nn.Module, token_ids: np.ndarray, device: torch.device | str = "cpu") -> np.ndarray:
    """L2-normalised embeddings of token ids, in eval mode."""
    net = unwrap(net)
    was_training = net.training
    net.eval()
    with torch.no_grad():
        out = torch.cat(
            [net(torch.from_numpy(token_ids[i : i + 256]).to(device)).cpu() for i in range(0, len(token_ids), 256)]
        )
    net.train(was_training)
    return out.numpy().astype(np.float32)


def chance_recall(query_labels: np.ndarray, gallery_labels: np.ndarray, ks: Sequence[int]) -> dict[int, float]:
    """Recall@K of a random ranking: 1 − P(none of K images drawn without replacement is of the
    query's class), averaged over the queries."""
    n = len(gallery_labels)
    counts = np.bincount(gallery_labels, minlength=int(max(query_labels.max(), gallery_labels.max())) + 1)
    result = {}
    for k in ks:
        misses = np.ones(len(query_labels))
        for i in range(min(k, n)):
            misses *= np.clip((n - counts[query_labels] - i) / (n - i), 0, 1)
        result[int(k)] = float(np.mean(1 - misses))
    return result


def text_to_image_recall(
    net: torch.nn.Module, data: TextData, ks: Sequence[int], device: torch.device | str = "cpu"
) -> dict[str, dict[int, float]]:
    """Text → image Recall@K of each gallery."""
    texts = embed_texts(net, data.token_ids, device)
    return {
        name: query_gallery_recall_at_k(texts[g.query_texts], g.query_labels, g.embeddings, g.labels, ks)
        for name, g in data.galleries.items()
    }


def recall_columns(recalls: dict[str, dict[int, float]]) -> dict[str, float]:
    return {f"{name}_recall_at_{k}": v for name, by_k in recalls.items() for k, v in by_k.items()}


def reading(gallery: str, recall: dict[int, float], chance: dict[int, float], classes: int) -> str:
    """One line that says what a gallery's smallest-K recall means against chance: a tower trained
    on a catalog's own captions is judged on names it saw and on names it never saw, and the
    second is what a user's own words meet."""
    k = min(recall)
    found, random = recall[k], chance[k]
    times = found / random if random > 0 else float("inf")
    names = "names it trained on" if gallery == "seen" else "names it never saw"
    if times < 2:
        verdict = "no better than chance: it has not learnt these words"
    elif found < 0.3:
        verdict = "well above chance but weak: the right image is in the top few only sometimes"
    else:
        verdict = "a useful ranker of these words"
    figures = f"R@{k} {found:.3f} against {random:.3f} by chance ({times:.0f}×)"
    return f"{gallery}: {figures} on {classes} classes' {names} — {verdict}"


def gallery_evaluation(net: torch.nn.Module, data: TextData, ks: Sequence[int]) -> dict[str, dict[str, Any]]:
    """results.json's `evaluation`: each gallery's text → image Recall@K, a random ranking's, its
    captions, images and classes, and a one-line reading of them."""
    final = text_to_image_recall(net, data, ks)
    evaluation = {}
    for name, g in data.galleries.items():
        chance = chance_recall(g.query_labels, g.labels, ks)
        classes = len(np.unique(g.labels))
        evaluation[name] = {
            "recall_at_k": {str(k): v for k, v in final[name].items()},
            "chance_recall_at_k": {str(k): v for k, v in chance.items()},
            "captions": len(g.query_texts),
            "images": len(g.labels),
            "classes": classes,
            "reading": reading(name, final[name], chance, classes),
        }
    return evaluation
