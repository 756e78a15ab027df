"""Images with known text, rendered at run time with the DejaVu fonts matplotlib ships: pages,
receipts, signs and text on real photos, some stored turned with an EXIF orientation tag, and
pages of small print dense enough to hold thousands of text regions.

Seeded: the same seed gives the same pixels, so the tests and the OCR bench see the same set.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from support.photos import photo_paths

WORDS = (
    "invoice", "total", "amount", "paid", "cash", "card", "change", "order", "table", "coffee",
    "water", "bread", "milk", "station", "platform", "exit", "north", "south", "street", "avenue",
    "open", "closed", "monday", "friday", "garden", "museum", "ticket", "price", "number", "date",
    "time", "room", "floor", "hotel", "market", "bakery", "receipt", "welcome", "thank", "you",
    "please", "return", "delivery", "address", "account", "balance",
)
FONTS = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf")
KINDS = ("document", "receipt", "sign", "photo")
# EXIF orientation → the transpose that stores an upright image so that a viewer, applying
# the tag, shows it upright again.
STORED_TURNED = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90,
                 8: Image.Transpose.ROTATE_270}


DEBIAN_FONTS = Path("/usr/share/fonts/truetype/dejavu")


@cache
def font_path(name: str = "DejaVuSans.ttf") -> str:
    """matplotlib's bundled DejaVu, else Debian's fonts-dejavu (a machine without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return str(DEBIAN_FONTS / name)
    return str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / name)


def font(size: int, name: str = "DejaVuSans.ttf") -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(font_path(name), size)


@dataclass(frozen=True)
class TextImage:
    name: str
    image: Image.Image  # upright, as displayed
    lines: list[str]  # the text drawn, one entry per line
    boxes: list[tuple[int, int, int, int]]  # each line's ink box, displayed pixels
    orientation: int = 1  # the EXIF tag it is stored with

    def encoded(self) -> bytes:
        """The file: JPEG (quality 95) when stored turned, with its tag; PNG otherwise."""
        out = io.BytesIO()
        if self.orientation == 1:
            self.image.save(out, format="PNG")
        else:
            exif = Image.Exif()
            exif[0x0112] = self.orientation
            self.image.transpose(STORED_TURNED[self.orientation]).save(
                out, format="JPEG", quality=95, exif=exif)
        return out.getvalue()

    def save(self, folder: Path) -> Path:
        path = folder / (self.name + (".png" if self.orientation == 1 else ".jpg"))
        path.write_bytes(self.encoded())
        return path


def draw_lines(image: Image.Image, lines: list[str], origin: tuple[int, int], size: int,
               face: str, fill: tuple[int, int, int], spacing: float = 1.9
               ) -> list[tuple[int, int, int, int]]:
    draw = ImageDraw.Draw(image)
    typeface = font(size, face)
    x, y = origin
    boxes = []
    for line in lines:
        draw.text((x, y), line, fill=fill, font=typeface)
        left, top, right, bottom = draw.textbbox((x, y), line, font=typeface)
        boxes.append((int(left), int(top), int(right), int(bottom)))
        y += int(size * spacing)
    return boxes


def receipt_total() -> TextImage:
    """One line, "Total 348.20 EUR", on a white card: what the tests read exactly."""
    image = Image.new("RGB", (1000, 200), "white")
    lines = ["Total 348.20 EUR"]
    return TextImage("total", image, lines,
                     draw_lines(image, lines, (40, 60), 40, "DejaVuSans.ttf", (0, 0, 0)))


def _phrase(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def generated(count: int, seed: int = 20261205) -> Iterator[TextImage]:
    """``count`` varied text images: every fifth stored turned (EXIF 6, 8 or 3)."""
    rng = random.Random(seed)
    backgrounds = [p for name, p in sorted(photo_paths().items()) if name != "camera"]
    for n in range(count):
        kind = KINDS[n % len(KINDS)]
        face = FONTS[rng.randrange(len(FONTS))]
        if kind == "document":
            image = Image.new("RGB", (rng.choice((800, 1000)), rng.choice((600, 800))), "white")
            lines = [_phrase(rng, rng.randint(2, 4)) for _ in range(rng.randint(3, 6))]
            size, ink, origin = rng.choice((26, 30, 34)), (20, 20, 20), (50, 50)
        elif kind == "receipt":
            image = Image.new("RGB", (500, 700), (250, 248, 240))
            lines = [f"{rng.choice(WORDS)} {rng.randint(1, 99)}.{rng.randint(0, 99):02d}"
                     for _ in range(rng.randint(4, 8))]
            size, ink, origin = 28, (30, 30, 30), (40, 40)
        elif kind == "sign":
            colour = rng.choice(((20, 60, 140), (0, 110, 60), (150, 20, 20)))
            image = Image.new("RGB", (900, 400), colour)
            lines = [_phrase(rng, 2).upper() for _ in range(rng.randint(1, 2))]
            size, ink, origin = 56, (255, 255, 255), (60, 80)
        else:
            photo = Image.open(backgrounds[n % len(backgrounds)]).convert("RGB")
            image = photo.resize((800, int(800 * photo.height / photo.width)))
            lines = [_phrase(rng, 2) for _ in range(rng.randint(1, 2))]
            size, ink, origin = 36, (10, 10, 10), (40, 40)
            band = (30, 30, 40 + 560, 40 + int(size * 1.9) * len(lines) + 10)
            ImageDraw.Draw(image).rectangle(band, fill=(245, 245, 245))
        boxes = draw_lines(image, lines, origin, size, face, ink)
        orientation = (6, 8, 3)[(n // 5) % 3] if n % 5 == 4 else 1
        yield TextImage(f"{n:04d}-{kind}", image, lines, boxes, orientation)


def dense_page(seed: int, side: int = 2000, size: int = 14) -> TextImage:
    """Small print on a ``side``² page: short words on a grid, thousands of text regions."""
    rng = random.Random(seed)
    image = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(image)
    typeface = font(size)
    lines = []
    for y in range(20, side - size * 2, int(size * 2.2)):
        row = []
        for x in range(20, side - size * 4, size * 5):
            word = str(rng.randint(10, 999))
            draw.text((x, y), word, fill=(0, 0, 0), font=typeface)
            row.append(word)
        lines.append(" ".join(row))
    return TextImage(f"dense-{seed}", image, lines, [])
