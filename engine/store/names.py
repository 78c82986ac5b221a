"""Names a user gives local models (`models import --name`, or the file or folder name): what
is allowed, how a default is made from a file name, and when two names are the same.

An import name becomes a folder name (`<models dir>/local--<name>`) and is typed on command
lines, so it is one path component that every file system SpecChat runs on can hold:

- letters and digits of any script ("Modèles", "模型", "Llama-3-ü"), combining marks, spaces,
  '-', '_' and '.'; it starts with a letter, digit or '_' (never '-', so it is not an option);
- never a path separator ('/', '\\'), "..", a control or invisible formatting character (a
  right-to-left override would show another name than the one stored), nor what Windows
  cannot hold: `<>:"|?*`, a trailing dot or space, the reserved device names (CON, PRN, AUX,
  NUL, COM0-9, LPT0-9, with or without an extension);
- at most 100 characters and 200 bytes of UTF-8 even when decomposed (macOS stores names
  decomposed; file names are limited to 255 bytes or UTF-16 units).

Names are kept in NFC, so "ü" typed as one character or as u + combining diaeresis is the same
name. Two names are the same model when their `name_key`s match (NFC, then Unicode case
folding): "Tiny" and "tiny" would share one folder on a case-insensitive file system (Windows,
macOS), so a second import under such a name is refused, and either spelling finds the model.

What this module does not do: touch the file system.
"""

from __future__ import annotations

import re
import unicodedata

from engine.errors import UsageError

MAX_CHARS = 100
MAX_BYTES = 200
_PUNCTUATION = frozenset(" _.-")
_RESERVED = frozenset({"CON", "PRN", "AUX", "NUL", *(f"{d}{n}" for d in ("COM", "LPT") for n in "0123456789¹²³")})
_HINT = ("use letters (any script), digits, spaces, '-', '_' or '.', starting with a letter, digit or '_', "
         f"at most {MAX_CHARS} characters")


def name_key(name: str) -> str:
    """What two names compare by: NFC, case-folded (NFC again: folding can decompose)."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFC", name).casefold())


def check_import_name(name: str) -> str:
    """`name` in NFC if it can be an import name; UsageError saying why not."""
    name = unicodedata.normalize("NFC", name)
    why = _problem(name)
    if why:
        raise UsageError(f"{name!r} cannot be an import name: {why}. Pass another --name ({_HINT}).")
    return name


def default_import_name(stem: str) -> str:
    """An import name made from a file or folder name: each run of characters a name cannot
    hold becomes '-', ".." becomes '.', and what cannot start or end a name is trimmed. Not
    checked (a reserved or over-long result is refused by check_import_name)."""
    name = unicodedata.normalize("NFC", stem)
    name = "".join(c if _allowed(c) else "\0" for c in name)
    name = re.sub(r"\0+", "-", name)
    name = re.sub(r"\.{2,}", ".", name)
    name = name.strip("-. ")
    while name and not _starts(name[0]):
        name = name[1:].lstrip("-. ")
    return name or "model"


def _allowed(c: str) -> bool:
    return c in _PUNCTUATION or unicodedata.category(c)[0] in "LMN"


def _starts(c: str) -> bool:
    return c == "_" or unicodedata.category(c)[0] in "LN"


def _problem(name: str) -> str:
    if not name:
        return "it is empty"
    if "/" in name or "\\" in name:
        return "it holds a path separator ('/' or '\\')"
    if ".." in name:
        return "it holds '..'"
    bad = next((c for c in name if not _allowed(c)), None)
    if bad is not None:
        kind = "a control or invisible character" if unicodedata.category(bad)[0] in "CZ" and bad != " " \
            else f"the character {bad!r}"
        return f"it holds {kind} (U+{ord(bad):04X})"
    if not _starts(name[0]):
        return f"it starts with {name[0]!r}"
    if name[-1] in ". ":
        return "it ends with a dot or a space, which Windows drops"
    if name.split(".")[0].rstrip(" ").upper() in _RESERVED:
        return f"{name.split('.')[0]} is a device name Windows reserves"
    if len(name) > MAX_CHARS or len(unicodedata.normalize("NFD", name).encode("utf-8")) > MAX_BYTES:
        return f"it is longer than {MAX_CHARS} characters or {MAX_BYTES} bytes"
    return ""
