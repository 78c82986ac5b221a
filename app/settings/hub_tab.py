"""Settings > Hugging Face: the access token gated models (the Llama pairs) need, saved where
huggingface_hub keeps it (engine/store/hub_token.py), so `hf auth login` and SpecChat share it,
with links to make a token and to each gated catalog model's licence page.

Unlike the other tabs it owns no preference: Save and Forget act at once on the token file (a
token is not a setting to undo with Cancel, and the CLI reads it from there)."""

from __future__ import annotations

from html import escape

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.state.preferences import Preferences
from engine.errors import EngineError
from engine.store import load_catalog
from engine.store.hub_token import forget_token, save_token, token_status

TOKENS_URL = "https://huggingface.co/settings/tokens"


class HubTab(QWidget):
    """The Hugging Face settings tab (see the module docstring)."""

    title = "&Hugging Face"

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        intro = QLabel(
            "Some models are <b>gated</b>: before downloading them, accept their licence on the Hugging Face "
            f"page with your account, then paste an access token with <i>read</i> rights "
            f"(<a href='{TOKENS_URL}'>make one here</a>). It is saved where the Hugging Face tools keep theirs, "
            "so <code>hf auth login</code> and SpecChat share it.")
        intro.setWordWrap(True)
        intro.setOpenExternalLinks(True)
        intro.setTextFormat(Qt.TextFormat.RichText)
        self.token = QLineEdit()
        self.token.setAccessibleName("Hugging Face access token")
        self.token.setPlaceholderText("hf_…")
        self.token.setEchoMode(QLineEdit.EchoMode.Password)
        self.token.returnPressed.connect(self.save)
        self.save_button = QPushButton("Save &token")
        self.save_button.setAccessibleName("Save the Hugging Face token")
        self.save_button.clicked.connect(self.save)
        self.forget_button = QPushButton("&Forget")
        self.forget_button.setAccessibleName("Forget the saved Hugging Face token")
        self.forget_button.clicked.connect(self.forget)
        row = QHBoxLayout()
        row.addWidget(self.token, 1)
        row.addWidget(self.save_button)
        row.addWidget(self.forget_button)
        self.status = QLabel()
        self.status.setAccessibleName("Token status")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        gated = [m for m in load_catalog().models if m.gated]
        links = "".join(f"<li><a href='{escape(m.licence_url)}'>{escape(m.repo_id)}</a> ({escape(m.license)})</li>"
                        for m in gated)
        self.licences = QLabel(f"Gated models in the catalog, with their licence pages:<ul>{links}</ul>" if gated else "")
        self.licences.setAccessibleName("Licence pages of gated models")
        self.licences.setOpenExternalLinks(True)
        self.licences.setTextFormat(Qt.TextFormat.RichText)
        self.licences.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addLayout(row)
        layout.addWidget(self.status)
        layout.addWidget(self.licences)
        layout.addStretch(1)
        self._refresh()

    def show_preferences(self, prefs: Preferences) -> None:
        self._refresh()

    def values(self) -> dict[str, object]:
        return {}

    def save(self) -> None:
        try:
            path = save_token(self.token.text())
        except EngineError as exc:
            self.status.setText(exc.user_message)
            return
        self.token.clear()
        self._refresh()
        self.status.setText(f"Saved in {path}. Downloads of gated models use it from now on.")

    def forget(self) -> None:
        forget_token()
        self._refresh()

    def _refresh(self) -> None:
        status = token_status()
        self.status.setText(status.describe())
        self.forget_button.setEnabled(status.source == "file")
