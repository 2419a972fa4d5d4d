"""core.data.preprocess: the one decode → model-input implementation every stage calls."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from PIL import ExifTags, Image

from core.data.preprocess import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_REDUCING_GAP,
    ImageDecodeError,
    ImageTooLarge,
    InputContract,
    RegionError,
    decode,
    load_batch,
    load_image,
    load_pixels,
    open_image,
)
from tests.support.images import encode, png_header_only


def column_image(width: int, height: int) -> Image.Image:
    """Grey image whose pixel value is its column index (exact, no resampling ambiguity)."""
    array = np.tile(np.arange(width, dtype=np.uint8), (height, 1))
    return Image.fromarray(array, mode="L")


GREY = InputContract(height=8, width=8, channels=1)
RGB = InputContract(height=8, width=8, channels=3)


# --- InputContract -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"height": 0, "width": 8},
        {"height": 8, "width": -1},
        {"height": 8, "width": 8, "channels": 2},
        {"height": 8, "width": 8, "channels": 3, "mean": (0.1, 0.2)},
        {"height": 8, "width": 8, "std": (0.0,)},
        {"height": 8, "width": 8, "layout": "NHWC"},
        {"height": 8, "width": 8, "dtype": "float16"},
        {"height": 8, "width": 8, "reducing_gap": 0.5},
        {"height": 8, "width": 8, "reducing_gap": float("inf")},
        {"height": 8, "width": 8, "reducing_gap": float("nan")},
    ],
)
def test_contract_rejects_invalid_values(kwargs):
    with pytest.raises(ValueError):
        InputContract(**kwargs)


def test_contract_dict_round_trip_and_unknown_keys_ignored():
    contract = InputContract(
        height=224,
        width=200,
        channels=3,
        resize=256,
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        normalize_in_graph=False,
    )
    d = contract.to_dict()
    assert d["mean"] == [0.485, 0.456, 0.406] and isinstance(d["std"], list)
    assert InputContract.from_dict({**d, "future_field": 1}) == contract
    reduced = InputContract(height=224, width=224, resize=256, reducing_gap=2.0)
    assert InputContract.from_dict(reduced.to_dict()) == reduced
    # A manifest written before the field existed keeps decoding every pixel, as its index did.
    assert (
        InputContract.from_dict({k: v for k, v in reduced.to_dict().items() if k != "reducing_gap"}).reducing_gap
        is None
    )
    assert contract.input_shape == (3, 224, 200)
    assert contract.color_mode == "RGB"
    assert GREY.color_mode == "L"


# --- open_image: errors ----------------------------------------------------------------------


def test_empty_bytes_are_rejected_clearly():
    with pytest.raises(ImageDecodeError, match="empty"):
        open_image(b"")


def test_garbage_bytes_are_rejected_clearly():
    with pytest.raises(ImageDecodeError, match="not a recognised image"):
        open_image(b"this is not an image at all" * 10)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image_is_rejected_clearly(fmt):
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), mode="RGB")
    data = encode(noise, fmt)
    with pytest.raises(ImageDecodeError, match="corrupt or truncated"):
        open_image(data[: len(data) // 2])


def test_header_only_open_defers_decoding_to_load_pixels():
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), mode="RGB")
    truncated = encode(noise)[:300]
    image = open_image(truncated, load=False)  # the header is intact: size known, nothing decoded
    assert image.size == (64, 64)
    with pytest.raises(ImageDecodeError, match="corrupt or truncated"):
        load_pixels(image)
    with pytest.raises(ImageTooLarge):
        open_image(encode(noise), max_pixels=64 * 64 - 1, load=False)
    whole = load_pixels(open_image(encode(noise), load=False))
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(noise))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "AVIF", "HEIF"])
def test_damaged_bytes_of_every_format_are_an_image_decode_error(fmt):
    # Random bytes overwritten and cut short: every outcome must be a picture or an
    # ImageDecodeError (AVIF's decoder raised RuntimeError and SyntaxError, which a server
    # answered as INTERNAL and an index build died of).
    data = encode(Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 80, 3), dtype=np.uint8)), fmt)
    rng = random.Random(1)
    contract = InputContract(height=24, width=24, channels=3, resize=32, reducing_gap=2.0, exif_orientation=True)
    errors = 0
    for _ in range(120):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        if rng.random() < 0.3:
            damaged = damaged[: rng.randrange(len(damaged))]
        try:
            assert load_image(bytes(damaged), contract).shape == (3, 24, 24)
        except ImageDecodeError:
            errors += 1
    assert errors > 0


def test_missing_file_is_rejected(tmp_path):
    with pytest.raises(ImageDecodeError, match="not found"):
        open_image(tmp_path / "nope.png")
    with pytest.raises(ImageDecodeError, match="not found"):
        open_image(tmp_path)  # a directory is not an image file


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_decompression_bomb_rejected_from_header_before_decoding():
    # 10000×10000 = 1e8 pixels > the default limit. The bytes hold no real pixel data, so the
    # "over the limit" message (rather than "truncated") proves the header was checked first.
    data = png_header_only(10_000, 10_000)
    assert len(data) < 200
    with pytest.raises(ImageTooLarge, match="over the limit"):
        open_image(data)


def test_huge_bomb_over_pillows_own_limit_is_an_image_decode_error():
    # 400 million pixels: past Pillow's own DecompressionBombError threshold, which must still
    # surface as the module's ImageDecodeError (a user error), not a foreign exception type.
    with pytest.raises(ImageTooLarge, match="over the pixel limit"):
        open_image(png_header_only(20_000, 20_000), max_pixels=10**12)


def test_max_pixels_is_the_limit(tmp_path):
    data = encode(Image.new("RGB", (100, 50), (1, 2, 3)))
    with pytest.raises(ImageTooLarge, match="5000 pixels, over the limit of 4999"):
        open_image(data, max_pixels=4999)
    assert open_image(data, max_pixels=5000).size == (100, 50)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    with pytest.raises(ImageDecodeError, match="over the limit"):
        load_image(path, RGB, max_pixels=4999)
    assert DEFAULT_MAX_PIXELS >= 100 * 50


# --- open_image / load_image: success ---------------------------------------------------------


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_open_image_accepts_bytes_like(wrap):
    data = encode(Image.new("RGB", (5, 7), (9, 9, 9)))
    image = open_image(wrap(data))
    assert image.size == (5, 7)


def test_load_image_from_path_and_bytes_agree(tmp_path):
    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), mode="RGB")
    path = tmp_path / "img.png"
    image.save(path)
    from_path = load_image(path, RGB)
    from_str = load_image(str(path), RGB)
    from_bytes = load_image(path.read_bytes(), RGB)
    np.testing.assert_array_equal(from_path, from_bytes)
    np.testing.assert_array_equal(from_path, from_str)
    # CHW layout, scaled to [0, 1], exact for a same-size PNG.
    expected = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0
    np.testing.assert_allclose(from_path, expected, rtol=0, atol=1e-7)
    assert from_path.dtype == np.float32 and from_path.flags.c_contiguous


def test_colour_modes_are_converted():
    solid = Image.new("RGB", (8, 8), (10, 20, 30))
    out = load_image(encode(solid), RGB)
    assert out.shape == (3, 8, 8)
    np.testing.assert_allclose(out[:, 0, 0], np.array([10, 20, 30]) / 255.0, atol=1e-7)
    grey = load_image(encode(solid), GREY)
    assert grey.shape == (1, 8, 8)
    expected_l = np.asarray(solid.convert("L"), dtype=np.float32)[0, 0] / 255.0
    assert grey[0, 0, 0] == pytest.approx(expected_l)
    # RGBA and palette inputs become 3 channels; grey input is replicated into RGB.
    for mode in ("RGBA", "P", "L", "1"):
        assert load_image(encode(solid.convert(mode)), RGB).shape == (3, 8, 8)
    grey_in = load_image(encode(Image.new("L", (8, 8), 77)), RGB)
    np.testing.assert_allclose(grey_in, np.full((3, 8, 8), 77 / 255.0, np.float32), atol=1e-7)


@pytest.mark.parametrize("size", [(28, 28), (300, 200), (17, 90)])
def test_grey_image_for_rgb_model_equals_converting_first(size):
    # Grey sources are resized as one channel and replicated: the numbers must be exactly
    # those of converting to RGB before resizing, upscaled or downscaled, cropped or not.
    from core.data.preprocess import to_model_input

    grey = Image.fromarray(np.random.default_rng(0).integers(0, 256, size[::-1], dtype=np.uint8), mode="L")
    contract = InputContract(height=24, width=24, channels=3, resize=32)
    out = to_model_input(grey, contract)
    rgb = grey.convert("RGB")
    w, h = rgb.size
    ratio = 32 / min(w, h)
    rgb = rgb.resize((max(1, round(w * ratio)), max(1, round(h * ratio))), Image.Resampling.BILINEAR)
    left, top = (rgb.width - 24) // 2, (rgb.height - 24) // 2
    pixels = np.asarray(rgb.crop((left, top, left + 24, top + 24)), np.float32).transpose(2, 0, 1)
    assert out.dtype == np.float32 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, pixels * np.float32(contract.scale))


def test_centre_crop_takes_the_middle():
    contract = InputContract(height=10, width=10, channels=1, scale=1.0)
    out = load_image(encode(column_image(30, 14)), contract)
    assert out.shape == (1, 10, 10)
    # Columns 10..19 (left = (30-10)//2), every row the same.
    np.testing.assert_array_equal(out[0], np.tile(np.arange(10, 20, dtype=np.float32), (10, 1)))


def test_resize_shorter_side_then_crop():
    contract = InputContract(height=10, width=10, channels=1, resize=10)
    out = load_image(encode(Image.new("L", (60, 20), 200)), contract)
    assert out.shape == (1, 10, 10)
    np.testing.assert_allclose(out, 200 / 255.0, atol=1e-6)
    # Shorter side 20 → 10 makes a 30×10 image; the crop keeps its middle third, which holds
    # the middle third of the original's columns: the left/right bands must not appear.
    array = np.zeros((20, 60), np.uint8)
    array[:, 20:40] = 255
    out = load_image(encode(Image.fromarray(array, mode="L")), contract)
    assert out[0, :, 2:8].min() > 0.9
    assert out.max() <= 1.0 and out.min() >= 0.0


def test_small_image_is_resized_up_to_the_input_size():
    out = load_image(encode(Image.new("RGB", (3, 5), (255, 0, 0))), RGB)
    assert out.shape == (3, 8, 8)
    np.testing.assert_allclose(out[0], 1.0, atol=1e-6)
    np.testing.assert_allclose(out[1:], 0.0, atol=1e-6)


def test_normalisation_outside_the_graph():
    in_graph = InputContract(height=4, width=4, channels=3, mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 2.0))
    outside = InputContract(
        height=4,
        width=4,
        channels=3,
        mean=(0.5, 0.25, 0.0),
        std=(0.5, 0.25, 2.0),
        normalize_in_graph=False,
    )
    data = encode(Image.new("RGB", (4, 4), (255, 51, 102)))
    raw = load_image(data, in_graph)
    normed = load_image(data, outside)
    mean = np.array([0.5, 0.25, 0.0], np.float32).reshape(3, 1, 1)
    std = np.array([0.5, 0.25, 2.0], np.float32).reshape(3, 1, 1)
    np.testing.assert_allclose(normed, (raw - mean) / std, rtol=1e-6)
    np.testing.assert_allclose(normed[:, 0, 0], [1.0, -0.2, 0.2], atol=1e-6)


# --- reduced-scale decoding of large images ----------------------------------------------------

REDUCED = InputContract(height=56, width=56, channels=3, resize=64, reducing_gap=DEFAULT_REDUCING_GAP)
FAIR = InputContract(height=56, width=56, channels=3, resize=64)


def bands(width: int, height: int) -> Image.Image:
    """Sharp-edged bands off the centre: a picture shifted or stretched by a pixel shows it."""
    array = np.zeros((height, width, 3), np.uint8)
    array[:, width // 2 : width // 2 + width // 40] = 255
    array[height // 2 : height // 2 + height // 30, :, 1] = 200
    return Image.fromarray(array)


@pytest.mark.parametrize("size", [(1600, 1200), (1601, 1203), (1203, 1601)])
def test_large_jpeg_is_decoded_at_reduced_scale_and_matches_the_fair_resample(size):
    data = encode(bands(*size), "JPEG")
    image = open_image(data, load=False)
    reduced = decode(image, REDUCED)
    # Resized to 64 on the shorter side, gap 2: the decoder may go down to 128, so 1/8 scale.
    assert min(image.size) == -(-min(size) // 8)
    fair_image = open_image(data, load=False)
    fair = decode(fair_image, FAIR)
    assert fair_image.size == size  # without the gap every pixel is decoded
    # Sides not a multiple of 8 leave a partial block: the draft box keeps the picture in place
    # (without it the bands move: mean 1.6-2/255, max 36-48/255); sharp edges differ by a few.
    difference = np.abs(reduced - fair)
    assert difference.mean() < 0.5 / 255 and difference.max() <= 10 / 255
    np.testing.assert_array_equal(load_image(data, REDUCED), reduced)  # training and indexing: the same path


@pytest.mark.parametrize(("mode", "options"), [("CMYK", {}), ("L", {}), ("RGB", {"progressive": True})])
def test_reduced_scale_decoding_of_other_jpeg_kinds(mode, options):
    data = encode(bands(1600, 1200).convert(mode), "JPEG", **options)
    image = open_image(data, load=False)
    reduced = decode(image, REDUCED)
    assert image.size == (200, 150)
    difference = np.abs(reduced - decode(open_image(data, load=False), FAIR))
    assert difference.mean() < 1 / 255 and difference.max() <= 10 / 255
    with pytest.raises(ImageDecodeError, match="corrupt or truncated"):
        decode(open_image(data[:2000], load=False), REDUCED)


def landscape(width: int = 160, height: int = 120) -> Image.Image:
    """Smooth colours with no symmetry: any turn or flip changes it."""
    field = np.random.default_rng(1).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    return Image.fromarray(field).resize((width, height), Image.Resampling.BICUBIC)


def with_orientation_exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = orientation
    return exif


def with_orientation(image: Image.Image, orientation: int, fmt: str = "PNG") -> bytes:
    return encode(image, fmt, exif=with_orientation_exif(orientation))


UPRIGHT = InputContract(height=56, width=56, channels=3, resize=64, exif_orientation=True)
TURNS = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270"}
TURNS |= {7: "TRANSVERSE", 8: "ROTATE_90"}


@pytest.mark.parametrize("orientation", sorted(TURNS))
def test_exif_orientation_turns_the_picture_upright(orientation):
    stored = landscape()
    tagged = with_orientation(stored, orientation)
    # What a camera that stored the picture upright would have written:
    upright = encode(stored.transpose(Image.Transpose[TURNS[orientation]]))
    out = load_image(tagged, UPRIGHT)
    # The turn comes after the resize there, before it here: the two resample passes swap
    # order and round once in between, hence up to 2/255 apart, not bit-equal.
    assert np.abs(out - load_image(upright, UPRIGHT)).max() <= 2 / 255
    # A contract without the field (models exported before it) keeps the stored pixels.
    stored_as_is = load_image(encode(stored), UPRIGHT)
    np.testing.assert_array_equal(
        load_image(tagged, dataclasses.replace(UPRIGHT, exif_orientation=False)), stored_as_is
    )
    assert np.abs(out - stored_as_is).mean() > 10 / 255


@pytest.mark.parametrize("orientation", sorted(TURNS))
def test_a_region_is_in_pixels_of_the_upright_picture(orientation):
    stored = landscape()
    upright = stored.transpose(Image.Transpose[TURNS[orientation]])
    region = (5, 7, upright.width // 2, upright.height // 3)
    box = (5, 7, 5 + upright.width // 2, 7 + upright.height // 3)
    out = load_image(with_orientation(stored, orientation), UPRIGHT, region=region)
    np.testing.assert_array_equal(out, load_image(encode(upright.crop(box)), UPRIGHT))


def test_a_region_outside_empty_or_tiny_is_refused():
    image = encode(landscape())
    width, height = landscape().size
    for region, message in [
        ((width - 4, 0, 8, 8), f"reaches outside the {width}x{height} image"),
        ((0, 0, 0, 10), "is empty"),
        ((0, 0, 7, 30), "under the minimum of 8 pixels a side"),
        ((float("nan"), 0, 9, 9), "is not finite"),
    ]:
        with pytest.raises(RegionError, match=message):
            load_image(image, UPRIGHT, region=region)


@pytest.mark.parametrize("junk", [b"\x00" * 3, b"Exif\x00\x00II*\x00\xff\xff\xff\x7f", b"MM\x00*" + bytes(range(40))])
def test_a_corrupt_exif_block_keeps_the_stored_pixels(junk):
    stored = landscape()
    for fmt in ("PNG", "JPEG"):
        damaged = encode(stored, fmt, exif=junk)
        np.testing.assert_array_equal(load_image(damaged, UPRIGHT), load_image(encode(stored, fmt), UPRIGHT))


def test_exif_orientation_with_reduced_scale_decoding():
    tagged = with_orientation(bands(1600, 1200), 6, "JPEG")
    image = open_image(tagged, load=False)
    reduced = decode(image, dataclasses.replace(REDUCED, exif_orientation=True))
    assert image.size == (200, 150)  # the draft is taken in the stored orientation
    fair = load_image(tagged, dataclasses.replace(FAIR, exif_orientation=True))
    difference = np.abs(reduced - fair)
    assert difference.mean() < 0.5 / 255 and difference.max() <= 10 / 255
    assert np.abs(fair - load_image(tagged, FAIR)).mean() > 10 / 255  # and it was turned


def test_heif_photos_decode_like_any_other_format():
    stored = landscape(640, 480)
    heif = encode(stored, "HEIF", quality=95)
    image = open_image(heif, load=False)
    assert (image.format, image.size) == ("HEIF", (640, 480))
    difference = np.abs(load_image(heif, UPRIGHT) - load_image(encode(stored), UPRIGHT))
    assert difference.mean() < 2 / 255  # HEVC is lossy: close to the PNG, not equal
    with pytest.raises(ImageTooLarge):
        open_image(heif, max_pixels=640 * 480 - 1, load=False)
    with pytest.raises(ImageDecodeError, match="corrupt or truncated"):
        load_image(heif[: len(heif) // 2], UPRIGHT)
    # An orientation written into a HEIF's EXIF is the container's business (libheif applies
    # its own rotation): the tag reads as upright, so the picture is not turned a second time.
    tagged = encode(stored, "HEIF", quality=95, exif=with_orientation_exif(6))
    np.testing.assert_array_equal(load_image(tagged, UPRIGHT), load_image(heif, UPRIGHT))


def test_large_png_is_reduced_by_whole_factors_close_to_the_fair_resample():
    data = encode(bands(1000, 800))
    image = open_image(data, load=False)
    reduced = decode(image, REDUCED)
    assert image.size == (1000, 800)  # PNG has no reduced-scale decoding
    difference = np.abs(reduced - decode(open_image(data, load=False), FAIR))
    assert 0 < difference.max() <= 10 / 255 and difference.mean() < 0.5 / 255


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_small_images_are_untouched_by_the_gap(fmt):
    # Upscaled (a glyph) or only slightly downscaled: nothing to reduce, the very same numbers.
    for size in [(28, 28), (150, 100)]:
        data = encode(bands(*size), fmt)
        np.testing.assert_array_equal(load_image(data, REDUCED), load_image(data, FAIR))


# --- load_batch --------------------------------------------------------------------------------


def test_load_batch_stacks_in_order(tmp_path):
    images = [Image.new("RGB", (8, 8), (v, v, v)) for v in (0, 100, 255)]
    path = tmp_path / "b.png"
    images[2].save(path)
    batch = load_batch([encode(images[0]), encode(images[1]), path], RGB)
    assert batch.shape == (3, 3, 8, 8) and batch.dtype == np.float32
    np.testing.assert_allclose(batch[:, 0, 0, 0], [0.0, 100 / 255, 1.0], atol=1e-7)


def test_load_batch_empty_and_bad():
    empty = load_batch([], GREY)
    assert empty.shape == (0, 1, 8, 8) and empty.dtype == np.float32
    with pytest.raises(ImageDecodeError):
        load_batch([encode(Image.new("L", (8, 8))), b""], GREY)


@pytest.mark.parametrize("in_graph", [True, False])
def test_a_batch_travels_as_the_pixels_it_was_made_of(in_graph):
    """`pixels_of` gives the uint8 pixels a batch of model inputs was decoded from, and
    `scaled_pixels` of them is the batch bit for bit (the sharded server sends its embedder a
    quarter of the bytes); a batch not made of whole pixels is None (it travels as floats)."""
    from core.data.preprocess import pixels_of, scaled_pixels, to_model_input

    contract = InputContract(
        32, 32, 3, normalize_in_graph=in_graph, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)
    )
    images = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (40, 50, 3), dtype=np.uint8)) for i in range(4)]
    batch = np.stack([to_model_input(image, contract) for image in images])
    pixels = pixels_of(batch, contract)
    assert pixels is not None and pixels.dtype == np.uint8
    assert np.array_equal(scaled_pixels(pixels, contract), batch)
    assert pixels_of(batch + np.float32(1e-3), contract) is None
    assert pixels_of(batch[:0], contract) is None
