"""The one preprocessing implementation: image bytes or files → model input arrays.

Training evaluation, ONNX export parity checks, index building and serving all call this,
so an image is turned into numbers the same way at every stage. The model's manifest carries
the `InputContract`; everything downstream reads it from there.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pillow_heif
from PIL import ExifTags, Image, UnidentifiedImageError

# HEIF/HEIC photos open like any other format. libheif applies the container's own rotation and
# pillow_heif then resets the EXIF Orientation tag, so `exif_orientation` never turns one twice.
pillow_heif.register_heif_opener()

# A decompression bomb is rejected from the header before any pixel is decoded.
DEFAULT_MAX_PIXELS = 40_000_000
# What new models' contracts use (`InputContract.reducing_gap`); `Image.thumbnail`'s default.
DEFAULT_REDUCING_GAP = 2.0
# `InputContract.interpolation` → Pillow's filter (timm's names for the ones its configs use).
RESAMPLING = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
    "lanczos": Image.Resampling.LANCZOS,
}


class ImageDecodeError(ValueError):
    """The bytes are not a decodable image, or the image breaks a limit."""

    reason = "unreadable"  # how index builds count the rows they skip


class ImageTooLarge(ImageDecodeError):
    """The header declares more pixels than the limit allows (nothing was decoded)."""

    reason = "oversized"


class ImageNotFound(ImageDecodeError):
    """No file at the image's path."""

    reason = "missing"


class RegionError(ImageDecodeError):
    """A region (a query's crop, a catalog row's bbox) that does not fit the image."""

    reason = "bad_region"


# A region narrower or lower than this is refused: a handful of pixels upscaled to the model's
# input is noise, and usually a click where a drag was meant.
MIN_REGION_SIDE = 8

# A region of an image: x, y, width, height in pixels of the image as it is seen — upright, after
# its EXIF Orientation (what a browser shows and a detector annotates) — from the top left.
Region = tuple[float, float, float, float]


# Pixels of one forward pass on a CPU. Activation memory grows with rows × pixels (mobilenet_v2
# at 224 px: ~17 MB per image in eval, so 256 rows held 4 GB, and ONNX Runtime's arena keeps its
# peak), while CPU throughput stops improving at a few dozen rows: 32 images of 224 px per pass.
CPU_PASS_PIXELS = 32 * 224 * 224


def rows_per_pass(height: int, width: int, pixels: int = CPU_PASS_PIXELS) -> int:
    """Images of height × width that fit one CPU forward pass's pixel budget (at least 1)."""
    return max(1, pixels // (height * width))


@dataclass(frozen=True)
class InputContract:
    """What a model expects as input; written to and read from the model manifest."""

    height: int
    width: int
    channels: int = 3  # 1 = grey ("L"), 3 = RGB
    resize: int | None = None  # shorter side resized to this before the centre crop
    dtype: str = "float32"
    layout: str = "NCHW"
    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] = field(default=(0.0,))
    std: tuple[float, ...] = field(default=(1.0,))
    # When True the graph applies (x - mean) / std itself and callers feed scaled pixels.
    normalize_in_graph: bool = True
    # With `resize`, a large image is first reduced cheaply to no less than `reducing_gap` times
    # the resized size — a JPEG decoded at 1/2, 1/4 or 1/8 scale in the DCT, any image shrunk
    # by a whole factor — then resampled fairly (Pillow's `reducing_gap`, as `Image.thumbnail`
    # does). None: every pixel decoded and resampled, the contract of models exported before
    # the field existed, so their indexes keep matching their queries.
    reducing_gap: float | None = None
    # Turn the picture upright as its EXIF Orientation tag says (phones store portraits sideways
    # and tag them). False, as in manifests written before the field: the stored pixels as they are.
    exif_orientation: bool = False
    # The resampling filter of the resize, as the model was trained with: timm's ViTs, ConvNeXts
    # and CLIP towers were trained on bicubic resizes, torchvision's CNNs on bilinear (the
    # default, and what manifests written before the field meant).
    interpolation: str = "bilinear"

    def __post_init__(self) -> None:
        if self.height <= 0 or self.width <= 0:
            raise ValueError(f"input size must be positive, got {self.height}x{self.width}")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 (grey) or 3 (RGB), got {self.channels}")
        if len(self.mean) not in (1, self.channels) or len(self.std) not in (1, self.channels):
            raise ValueError("mean/std must have 1 or `channels` entries")
        if any(s <= 0 for s in self.std):
            raise ValueError("std entries must be positive")
        if self.layout != "NCHW" or self.dtype != "float32":
            raise ValueError("only NCHW float32 inputs are supported")
        if self.reducing_gap is not None and not 1.0 <= self.reducing_gap < float("inf"):
            raise ValueError(f"reducing_gap must be None or a number >= 1, got {self.reducing_gap}")
        if self.interpolation not in RESAMPLING:
            raise ValueError(f"interpolation must be one of {', '.join(RESAMPLING)}, got {self.interpolation!r}")

    @property
    def color_mode(self) -> str:
        return "L" if self.channels == 1 else "RGB"

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return (self.channels, self.height, self.width)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean"], d["std"] = list(self.mean), list(self.std)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> InputContract:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for key in ("mean", "std"):
            if key in known:
                known[key] = tuple(float(x) for x in known[key])
        if known.get("reducing_gap") is not None:
            known["reducing_gap"] = float(known["reducing_gap"])
        return cls(**known)


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """An image as its request sent it, to be decoded where it is embedded: what `serve --ray`'s
    ingress sends its embedder deployment (a 224-px JPEG is ~11 kB, its pixels 150 kB), so the
    ingress, one process for every caller, does not spend its core decoding."""

    data: bytes
    region: Region | None = None  # checked against the image's size already


def open_image(source: bytes | str | Path, max_pixels: int = DEFAULT_MAX_PIXELS, load: bool = True) -> Image.Image:
    """Open an image from bytes or a path, checking its size from the header first.

    With `load=False` only the header is read: the size is known and checked, and
    `load_pixels` decodes the pixels later (on whichever thread should pay for it)."""
    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            if len(source) == 0:
                raise ImageDecodeError("empty image bytes")
            image = Image.open(io.BytesIO(bytes(source)))
        else:
            path = Path(source)
            if not path.is_file():
                raise ImageNotFound(f"image file not found: {path}")
            image = Image.open(path)
    except ImageDecodeError:
        raise
    except UnidentifiedImageError as exc:
        raise ImageDecodeError("bytes are not a recognised image format") from exc
    except Image.DecompressionBombError as exc:  # Pillow's own header check, past ~179M pixels
        raise ImageTooLarge(f"image is over the pixel limit: {exc}") from exc
    except MemoryError:
        raise
    except Exception as exc:  # OSError, or a format plugin's own error on bytes it claimed
        raise ImageDecodeError(f"cannot read image: {exc}") from exc
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageDecodeError(f"image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise ImageTooLarge(f"image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}")
    return load_pixels(image) if load else image


def load_pixels(image: Image.Image) -> Image.Image:
    """Decode the pixels of an image opened with `open_image(..., load=False)`."""
    try:
        image.load()
    except MemoryError:
        raise
    except Exception as exc:  # decoders raise OSError, ValueError, and AVIF's RuntimeError or SyntaxError
        raise ImageDecodeError(f"corrupt or truncated image: {exc}") from exc
    return image


def upright_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) of an opened image as it is seen: its EXIF Orientation applied."""
    return _turned_size(image.size, _upright_turn(image))


# The turns that swap width and height.
_SIDEWAYS = (
    Image.Transpose.TRANSPOSE,
    Image.Transpose.TRANSVERSE,
    Image.Transpose.ROTATE_90,
    Image.Transpose.ROTATE_270,
)


def _turned_size(size: tuple[int, int], turn: Image.Transpose | None) -> tuple[int, int]:
    return (size[1], size[0]) if turn in _SIDEWAYS else size


def region_box(region: Region, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """The (left, top, right, bottom) pixel box of `region` in an image of `size` (upright);
    RegionError when it is not finite, not inside the image, or under MIN_REGION_SIDE a side."""
    x, y, width, height = (float(v) for v in region)
    if not all(np.isfinite((x, y, width, height))):
        raise RegionError(f"region {_region_text(region)} is not finite")
    if width <= 0 or height <= 0:
        raise RegionError(f"region {_region_text(region)} is empty (width and height must be positive)")
    if x < 0 or y < 0 or x + width > size[0] + 0.5 or y + height > size[1] + 0.5:
        raise RegionError(
            f"region {_region_text(region)} (x, y, width, height) reaches outside the {size[0]}x{size[1]} image"
        )
    box = (round(x), round(y), min(round(x + width), size[0]), min(round(y + height), size[1]))
    if box[2] - box[0] < MIN_REGION_SIDE or box[3] - box[1] < MIN_REGION_SIDE:
        raise RegionError(f"region {_region_text(region)} is under the minimum of {MIN_REGION_SIDE} pixels a side")
    return box


def _region_text(region: Region) -> str:
    return "(" + ", ".join(f"{float(v):g}" for v in region) + ")"


def decode(image: Image.Image, contract: InputContract, region: Region | None = None) -> np.ndarray:
    """Decode an image opened with `open_image(..., load=False)` into the contract's model
    input, asking the decoder for a reduced scale first where the contract allows it (a 12 MP
    JPEG: 3.6x less CPU at `reducing_gap` 2, see `benchmarks/bench_decode.py`). `region`: only
    that part of the (upright) picture, cropped before the contract's resize and crop."""
    if region is not None:
        turn = _upright_turn(image) if contract.exif_orientation else None
        box = region_box(region, _turned_size(image.size, turn))
        pixels = load_pixels(image)
        if turn is not None:
            pixels = pixels.transpose(turn)
        return to_model_input(pixels.crop(box), contract, upright=True)
    box = None
    if contract.resize is not None and contract.reducing_gap is not None:
        width, height = _resized_size(image.size, contract.resize)
        gap = contract.reducing_gap
        # Formats without reduced-scale decoding answer None; a JPEG answers with the whole
        # image's box in the reduced pixels, which the resize below must use to stay exact.
        drafted = image.draft(None, (int(width * gap), int(height * gap)))
        box = drafted[1] if drafted else None
    return to_model_input(load_pixels(image), contract, box)


def to_model_input(
    image: Image.Image,
    contract: InputContract,
    box: tuple[float, float, float, float] | None = None,
    upright: bool = False,
) -> np.ndarray:
    """Convert a decoded image to one CHW float32 array following the contract. `box`: the
    region of `image` holding the picture (what `Image.draft` answers), None for all of it;
    `upright`: the image is turned already (a region cropped from the upright picture)."""
    upright = _upright_turn(image) if contract.exif_orientation and not upright else None
    # A grey image feeding an RGB model is resized as its one channel and replicated at the
    # end: the same numbers as converting first (each channel is resized alike), a third of
    # the resampling work, which dominates when small images are upscaled.
    replicate = image.mode == "L" and contract.channels == 3
    if not replicate:
        image = image.convert(contract.color_mode)
    if contract.resize is not None:
        size = (box[2] - box[0], box[3] - box[1]) if box else image.size
        image = image.resize(
            _resized_size(size, contract.resize), RESAMPLING[contract.interpolation], box, contract.reducing_gap
        )
    if upright is not None:  # after the resize: turning the smaller image costs less, same picture
        image = image.transpose(upright)
    image = _center_crop_or_resize(image, contract.height, contract.width, RESAMPLING[contract.interpolation])
    pixels = np.asarray(image)
    pixels = pixels[None, :, :] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
    return scaled_pixels(pixels, contract)


def scaled_pixels(pixels: np.ndarray, contract: InputContract) -> np.ndarray:
    """uint8 pixels, channels first (C, H, W, or N of them), as the contract's float32 model
    input: scaled, and normalised by mean and std where the graph does not do it itself. One
    grey channel for an RGB model is replicated."""
    array = np.empty(pixels.shape[:-3] + contract.input_shape, dtype=np.float32)
    np.multiply(pixels, np.float32(contract.scale), out=array)  # casts, scales and broadcasts in one pass
    if not contract.normalize_in_graph:
        array -= np.asarray(contract.mean, dtype=np.float32).reshape(-1, 1, 1)
        array /= np.asarray(contract.std, dtype=np.float32).reshape(-1, 1, 1)
    return array


def pixels_of(batch: np.ndarray, contract: InputContract) -> np.ndarray | None:
    """The uint8 pixels a batch of model inputs was made from (`scaled_pixels` of them gives the
    batch back bit for bit), or None when it was not made from whole pixels. A quarter of the
    bytes: what a batch travels as between processes (a sharded server's ingress and embedder)."""
    values = batch
    if not contract.normalize_in_graph:
        values = batch * np.asarray(contract.std, dtype=np.float32).reshape(-1, 1, 1)
        values += np.asarray(contract.mean, dtype=np.float32).reshape(-1, 1, 1)
    pixels = np.rint(values / np.float32(contract.scale))
    if not len(pixels) or pixels.min() < 0 or pixels.max() > 255:
        return None
    pixels = pixels.astype(np.uint8)
    return pixels if np.array_equal(scaled_pixels(pixels, contract), batch) else None


# EXIF Orientation value → the turn that makes the stored pixels upright (1: already upright).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _upright_turn(image: Image.Image) -> Image.Transpose | None:
    try:
        return _UPRIGHT.get(image.getexif().get(ExifTags.Base.Orientation, 1))
    except Exception:  # Pillow's EXIF parser raises many kinds; a broken tag loses metadata, not the picture
        return None


def _resized_size(size: tuple[float, float], shorter_side: int) -> tuple[int, int]:
    # A draft box's sides are the true sides over a power of two: the same sizes come out.
    w, h = size
    ratio = shorter_side / min(w, h)
    return max(1, round(w * ratio)), max(1, round(h * ratio))


def _center_crop_or_resize(
    image: Image.Image, height: int, width: int, resample: Image.Resampling = Image.Resampling.BILINEAR
) -> Image.Image:
    w, h = image.size
    if (w, h) == (width, height):
        return image
    if w >= width and h >= height:
        left, top = (w - width) // 2, (h - height) // 2
        return image.crop((left, top, left + width, top + height))
    return image.resize((width, height), resample)


def load_image(
    source: bytes | str | Path,
    contract: InputContract,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    region: Region | None = None,
) -> np.ndarray:
    """Decode and preprocess one image (only `region` of it, when given): the whole inference
    contract in one call."""
    return decode(open_image(source, max_pixels=max_pixels, load=False), contract, region)


def load_batch(
    sources: list[bytes | str | Path], contract: InputContract, max_pixels: int = DEFAULT_MAX_PIXELS
) -> np.ndarray:
    """Decode and stack several images into an NCHW batch (raises on the first bad one)."""
    if not sources:
        return np.zeros((0, *contract.input_shape), dtype=np.float32)
    return np.stack([load_image(s, contract, max_pixels) for s in sources])
