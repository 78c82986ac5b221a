"""Regenerate the app icon rasters in resources/icons/ from the hand-written specchat.svg.

    python scripts/make_icons.py            # render and write every file below
    python scripts/make_icons.py --check    # exit 1 if a committed file differs from a fresh render

Writes, next to the SVG:

- specchat-<N>.png for N in PNG_SIZES (RGBA, transparent outside the rounded square);
- specchat.ico for Windows: one PNG-compressed image per size in ICO_SIZES (ICONDIR of 6 bytes,
  then one 16-byte ICONDIRENTRY per image, then the PNG data; a width/height byte of 0 means 256);
- specchat.icns for macOS: b"icns" + big-endian total length, then one entry per ICNS_ENTRIES
  code (OSType, big-endian entry length including its 8-byte header, PNG data).

Rendering uses Qt's own SVG renderer (QtSvg, offscreen platform), so the icon looks the same as
Qt draws the SVG at run time. The output is deterministic: the same SVG and the same pinned
PySide6 give the same bytes, which is what --check relies on. This script does not touch the
installer's configuration; installer/ only points at the files it writes.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ICON_DIR = REPO / "resources" / "icons"
SVG_NAME = "specchat.svg"

PNG_SIZES: tuple[int, ...] = (16, 24, 32, 48, 64, 128, 256, 512, 1024)
ICO_SIZES: tuple[int, ...] = (16, 24, 32, 48, 64, 128, 256)
# OSType -> pixel size. The @2x codes (ic11..ic14) hold the same pixels as a plain size twice
# as large; macOS picks them by type, not by the PNG's own size.
ICNS_ENTRIES: tuple[tuple[bytes, int], ...] = (
    (b"icp4", 16),
    (b"icp5", 32),
    (b"icp6", 64),
    (b"ic07", 128),
    (b"ic08", 256),
    (b"ic09", 512),
    (b"ic10", 1024),
    (b"ic11", 32),
    (b"ic12", 64),
    (b"ic13", 256),
    (b"ic14", 512),
)


def render_pngs(svg: bytes, sizes: Iterable[int]) -> dict[int, bytes]:
    """Render `svg` once per size into a square ARGB image and return PNG bytes by size."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QRectF, Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    app = QGuiApplication.instance() or QGuiApplication([])  # noqa: F841 (keeps Qt's GUI state alive)
    renderer = QSvgRenderer(QByteArray(svg))
    if not renderer.isValid():
        raise ValueError("QtSvg could not parse the SVG")
    pngs: dict[int, bytes] = {}
    for size in sorted(set(sizes)):
        image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing, True)
        painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform, True)
        renderer.render(painter, QRectF(0, 0, size, size))
        painter.end()
        # Straight (non-premultiplied) alpha is what PNG stores.
        image = image.convertToFormat(QImage.Format.Format_ARGB32)
        data = QByteArray()
        buffer = QBuffer(data)
        buffer.open(QIODevice.OpenModeFlag.WriteOnly)
        if not image.save(buffer, "PNG", 0):  # for PNG, quality 0 = strongest zlib level
            raise RuntimeError(f"Qt could not encode the {size} px PNG")
        buffer.close()
        pngs[size] = bytes(data.data())
    return pngs


def build_ico(pngs: Mapping[int, bytes], sizes: Iterable[int] = ICO_SIZES) -> bytes:
    """An ICO file holding one PNG-compressed image per size (Windows Vista and later)."""
    sizes = list(sizes)
    header = struct.pack("<HHH", 0, 1, len(sizes))  # reserved, type 1 = icon, image count
    offset = len(header) + 16 * len(sizes)
    entries = b""
    blobs = b""
    for size in sizes:
        if not 1 <= size <= 256:
            raise ValueError(f"ICO images are 1..256 px, not {size}")
        png = pngs[size]
        dim = 0 if size == 256 else size  # a byte: 0 stands for 256
        # width, height, palette colours, reserved, colour planes, bits per pixel, size, offset
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(png), offset)
        blobs += png
        offset += len(png)
    return header + entries + blobs


def build_icns(pngs: Mapping[int, bytes], entries: Iterable[tuple[bytes, int]] = ICNS_ENTRIES) -> bytes:
    """An ICNS file whose every entry is PNG data (macOS 10.7 and later read these)."""
    body = b""
    for code, size in entries:
        if len(code) != 4:
            raise ValueError(f"an OSType is 4 bytes, not {code!r}")
        png = pngs[size]
        body += code + struct.pack(">I", 8 + len(png)) + png
    return b"icns" + struct.pack(">I", 8 + len(body)) + body


def build_all(svg: bytes) -> dict[str, bytes]:
    """Every generated file's name (relative to the icon folder) and its bytes."""
    sizes = set(PNG_SIZES) | set(ICO_SIZES) | {size for _, size in ICNS_ENTRIES}
    pngs = render_pngs(svg, sizes)
    files = {f"specchat-{size}.png": pngs[size] for size in PNG_SIZES}
    files["specchat.ico"] = build_ico(pngs)
    files["specchat.icns"] = build_icns(pngs)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if any file differs from a fresh render")
    args = parser.parse_args(argv)

    files = build_all((ICON_DIR / SVG_NAME).read_bytes())
    if args.check:
        stale = [name for name, data in files.items()
                 if not (ICON_DIR / name).is_file() or (ICON_DIR / name).read_bytes() != data]
        for name in stale:
            print(f"out of date: resources/icons/{name}")
        if stale:
            print("run: python scripts/make_icons.py")
            return 1
        print(f"{len(files)} icon files up to date")
        return 0
    for name, data in files.items():
        (ICON_DIR / name).write_bytes(data)
        print(f"{len(data):>9,} B  resources/icons/{name}")
    total = sum(len(data) for data in files.values())
    print(f"{total:>9,} B  total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
