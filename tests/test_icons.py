"""The committed app icons in resources/icons/ are what the installer needs and are well-formed.

Reads every file with its own small parsers (PNG IHDR, ICO directory, ICNS entries) written
from the format descriptions, not with scripts/make_icons.py's writers, and checks pixels with
Qt's PNG decoder. Does not re-render the SVG: that is `python scripts/make_icons.py --check`,
whose bytes depend on the exact Qt build.
"""

from __future__ import annotations

import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from PySide6.QtGui import QImage

ICON_DIR = Path(__file__).resolve().parents[1] / "resources" / "icons"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SVG_NS = "{http://www.w3.org/2000/svg}"

PNG_SIZES = (16, 24, 32, 48, 64, 128, 256, 512, 1024)
ICO_SIZES = {16, 24, 32, 48, 64, 128, 256}
# Apple's PNG-holding OSTypes and the pixel size each must hold (ic11..ic14 are @2x variants).
ICNS_TYPE_SIZES = {
    b"icp4": 16, b"icp5": 32, b"icp6": 64, b"ic07": 128, b"ic08": 256, b"ic09": 512,
    b"ic10": 1024, b"ic11": 32, b"ic12": 64, b"ic13": 256, b"ic14": 512,
}


def png_header(data: bytes) -> tuple[int, int, int, int]:
    """(width, height, bit depth, colour type) from a PNG's signature and leading IHDR chunk."""
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    length, chunk_type = struct.unpack(">I4s", data[8:16])
    assert chunk_type == b"IHDR" and length == 13
    width, height, depth, colour = struct.unpack(">IIBB", data[16:26])
    return width, height, depth, colour


def ico_images(data: bytes) -> list[tuple[int, int, bytes]]:
    """(width, height, image bytes) per ICONDIRENTRY of an .ico file."""
    reserved, kind, count = struct.unpack("<HHH", data[:6])
    assert (reserved, kind) == (0, 1), "not an icon directory"
    images = []
    for i in range(count):
        entry = data[6 + 16 * i: 6 + 16 * (i + 1)]
        width, height, _colours, _reserved, planes, bpp, size, offset = struct.unpack("<BBBBHHII", entry)
        assert planes in (0, 1) and bpp == 32
        assert 6 + 16 * count <= offset and offset + size <= len(data), "image data out of range"
        images.append((width or 256, height or 256, data[offset:offset + size]))
    return images


def icns_entries(data: bytes) -> list[tuple[bytes, bytes]]:
    """(OSType, payload) per entry of an .icns file, checking the declared lengths."""
    magic, total = struct.unpack(">4sI", data[:8])
    assert magic == b"icns"
    assert total == len(data), "declared length differs from the file size"
    entries = []
    pos = 8
    while pos < total:
        code, length = struct.unpack(">4sI", data[pos:pos + 8])
        assert length >= 8 and pos + length <= total, f"entry {code!r} runs past the end"
        entries.append((code, data[pos + 8:pos + length]))
        pos += length
    assert pos == total
    return entries


def test_svg_is_well_formed_plain_svg_with_a_square_viewbox() -> None:
    root = ET.parse(ICON_DIR / "specchat.svg").getroot()
    assert root.tag == f"{SVG_NS}svg"
    x, y, width, height = (float(v) for v in root.attrib["viewBox"].split())
    assert (x, y) == (0, 0) and width == height > 0
    # Only what QtSvg renders faithfully: no filters, masks, CSS or text.
    allowed = {"svg", "defs", "linearGradient", "stop", "g", "rect", "path", "circle"}
    used = {element.tag.removeprefix(SVG_NS) for element in root.iter()}
    assert used <= allowed, used - allowed


@pytest.mark.parametrize("size", PNG_SIZES)
def test_png_has_its_size_and_transparent_corners(size: int) -> None:
    data = (ICON_DIR / f"specchat-{size}.png").read_bytes()
    assert png_header(data) == (size, size, 8, 6)  # 8-bit RGBA
    image = QImage.fromData(data, "PNG")
    assert not image.isNull() and image.hasAlphaChannel()
    last = size - 1
    for x, y in ((0, 0), (last, 0), (0, last), (last, last)):
        assert image.pixelColor(x, y).alpha() == 0, (x, y)
    assert image.pixelColor(size // 2, size // 2).alpha() == 255
    assert image.pixelColor(size // 2, size // 8 + 1).alpha() == 255  # inside the ~10% margin


def test_ico_holds_one_png_per_windows_size() -> None:
    images = ico_images((ICON_DIR / "specchat.ico").read_bytes())
    assert len(images) == len(ICO_SIZES)
    assert {width for width, _, _ in images} == ICO_SIZES
    for width, height, png in images:
        assert png_header(png)[:2] == (width, height) and width == height
        assert png == (ICON_DIR / f"specchat-{width}.png").read_bytes()


def test_icns_entries_hold_pngs_of_their_type_size() -> None:
    entries = icns_entries((ICON_DIR / "specchat.icns").read_bytes())
    assert {code for code, _ in entries} == set(ICNS_TYPE_SIZES)
    assert len(entries) == len(ICNS_TYPE_SIZES)
    for code, png in entries:
        size = ICNS_TYPE_SIZES[code]
        assert png_header(png) == (size, size, 8, 6), code
        assert png == (ICON_DIR / f"specchat-{size}.png").read_bytes(), code


def test_icon_set_stays_small() -> None:
    total = sum(path.stat().st_size for path in ICON_DIR.iterdir() if path.is_file())
    assert total < 1_000_000
