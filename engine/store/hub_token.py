"""The Hugging Face access token, kept where huggingface_hub keeps it (its `token` file under
HF_HOME, as `hf auth login` writes it), so the app, the CLI, `hf` and every other HF tool share
one token. HF_TOKEN in the environment wins over the file, as in huggingface_hub.

Gated repos (the Llama pairs) need one with read access and the licence accepted on the hub.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants

from engine.errors import InvalidRequest, MalformedInput
from engine.untrusted import read_text

TOKEN_RE = re.compile(r"hf_[A-Za-z0-9]{20,}")


@dataclass(frozen=True)
class TokenStatus:
    source: str  # "environment" (HF_TOKEN), "file" (the token file) or "" (none)
    hint: str  # the token's last four characters ("" without one)
    path: Path  # the token file (whether or not it exists)

    def describe(self) -> str:
        if self.source == "environment":
            return f"HF_TOKEN is set in the environment (…{self.hint}); it is used instead of the saved one"
        if self.source == "file":
            return f"A token is saved (…{self.hint}) in {self.path}"
        return "No token saved: public models download without one"


def token_path() -> Path:
    return Path(os.environ.get("HF_TOKEN_PATH") or constants.HF_TOKEN_PATH)


def token_status() -> TokenStatus:
    path = token_path()
    env = os.environ.get("HF_TOKEN", "").strip()
    if env:
        return TokenStatus("environment", env[-4:], path)
    try:  # bounded, and never blocking on a pipe: the file is other tools' too
        saved = read_text(path, what="The saved Hugging Face token", max_bytes=4096).strip()
    except (OSError, MalformedInput):
        saved = ""
    return TokenStatus("file" if saved else "", saved[-4:], path)


def save_token(token: str) -> Path:
    """Write `token` to the token file (readable by this user only); checked for the hub's
    token form first, so a pasted sentence or a password never lands there."""
    token = token.strip()
    if not TOKEN_RE.fullmatch(token):
        raise InvalidRequest("That is not a Hugging Face token: tokens start with hf_ followed by letters and digits. "
                             "Copy one with read access from huggingface.co/settings/tokens.")
    path = token_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token)
    os.chmod(path, 0o600)  # also when the file was there before with wider rights
    return path


def forget_token() -> None:
    """Remove the saved token (as `hf auth logout` does for the active one)."""
    token_path().unlink(missing_ok=True)
