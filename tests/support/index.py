"""Index artifacts in milliseconds, for tests of the index commands that need no trained model:
a model artifact whose ONNX graph is one fixed random projection of the pixels (no torch), and
folders of small random images for it to embed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from core.artifacts.model_manifests import ModelManifest
from core.data.preprocess import InputContract

SIDE = 8


def write_tiny_model(out: Path, dim: int = 16, seed: int = 0, side: int = SIDE) -> Path:
    """A model directory (model.onnx + manifest.json) embedding side×side RGB images in `dim`-d
    (SIDE by default; a larger side is first average-pooled to SIDE×SIDE, so a 224-px model —
    what users send, 600 kB a float image — stays as small and fast as the 8-px one)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if side % SIDE:
        raise ValueError(f"side must be a multiple of {SIDE}, got {side}")
    weights = np.random.default_rng(seed).standard_normal((3 * SIDE * SIDE, dim)).astype(np.float32)
    pool = side // SIDE
    nodes = (
        []
        if pool == 1
        else [helper.make_node("AveragePool", ["images"], ["pooled"], kernel_shape=[pool, pool], strides=[pool, pool])]
    )
    graph = helper.make_graph(
        [
            *nodes,
            helper.make_node("Flatten", ["images" if pool == 1 else "pooled"], ["flat"], axis=1),
            helper.make_node("MatMul", ["flat", "w"], ["embeddings"]),
        ],
        "tiny",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, side, side])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", dim])],
        [numpy_helper.from_array(weights, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8  # what every ONNX Runtime this project installs reads
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / "model.onnx"))
    ModelManifest(
        model_id=f"tiny{seed:012d}", embedding_dim=dim, input=InputContract(height=side, width=side, channels=3)
    ).write(out)
    return out


def write_images(folder: Path, count: int, seed: int = 0, prefix: str = "img") -> list[Path]:
    """`count` SIDE×SIDE PNG images of random pixels, `<prefix>-<n>.png` in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for n in range(count):
        path = folder / f"{prefix}-{n:04d}.png"
        Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def write_catalog_index(tmp: Path, items: int = 12, per_item: int = 2, text: bool = False) -> Path:
    """An index root over a catalog of `items` items with `per_item` images each (an `item`
    column, so answers are grouped, and a filterable `shade`), embedded by the tiny model (and,
    with `text`, answering words with the tiny text model)."""
    import csv

    from index.build.build import run_build
    from index.build.config import BuildConfig

    paths = write_images(tmp / "images", items * per_item)
    catalog = tmp / "images" / "catalog.csv"  # paths in it are relative to it
    with open(catalog, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["id", "path", "item", "shade"])
        writer.writerows([p.stem, p.name, f"item{n // per_item}", n % 2] for n, p in enumerate(paths))
    root = tmp / "index"
    model = write_tiny_model(tmp / "model")
    text_model = str(write_tiny_text_model(tmp / "text", model)) if text else None
    config = BuildConfig(
        model=str(model), index_root=str(root), catalog=str(catalog), filterable=["shade"],
        min_ann_recall=0, text_model=text_model,
    )  # fmt: skip
    run_build(config, progress=False)
    return root


def write_tiny_text_model(out: Path, model_dir: Path, context_length: int = 16, seed: int = 0) -> Path:
    """A text model directory (text.onnx, CLIP's BPE tokenizer.json, manifest.json) for the image
    model in `model_dir`: the sum of a fixed random vector per token (the padding id's is zero),
    in the image model's dimension. No torch: an ONNX graph of one Gather and one ReduceSum."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from core.artifacts.layout import file_sha256
    from core.artifacts.model_manifests import TextModelManifest
    from core.data.text import TEXT_INPUT, TEXT_MODEL_FILE, TOKENIZER_FILE
    from training.models.text_models import CLIP_VOCAB_SIZE
    from training.models.text_tokenizer import write_clip_bpe

    dim = ModelManifest.read(model_dir).embedding_dim
    table = np.random.default_rng(seed).standard_normal((CLIP_VOCAB_SIZE, dim)).astype(np.float32)
    table[0] = 0  # padding adds nothing
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", TEXT_INPUT], ["tokens"], axis=0),
            helper.make_node("ReduceSum", ["tokens", "axis"], ["embeddings"], keepdims=0),
        ],
        "tiny_text",
        [helper.make_tensor_value_info(TEXT_INPUT, TensorProto.INT64, ["batch", context_length])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", dim])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.array([1], np.int64), "axis")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / TEXT_MODEL_FILE))
    tokenizer = write_clip_bpe(out / TOKENIZER_FILE)
    TextModelManifest(
        text_model_id=f"tinytext{seed:08d}",
        image_model_id=ModelManifest.read(model_dir).model_id,
        embedding_dim=dim,
        context_length=context_length,
        source={"kind": "tiny", "seed": seed},
        tokenizer={"file": TOKENIZER_FILE, **tokenizer},
        files={name: file_sha256(out / name) for name in (TEXT_MODEL_FILE, TOKENIZER_FILE)},
    ).write(out)
    return out
