"""Settings > Server: the app's OpenAI-compatible API (app/workers/api_server.py) on or off, its port,
its API key, whether other computers may reach it, the host names and web pages let in beside
the defaults (engine.serving.guard: `--allowed-hosts` / `--allowed-origins` of `specchat
serve`), and the URL to paste into a client. A malformed entry is said under the fields. Under
them it states what the API does with the model loaded now (`running`): whether requests may
give it tools, JSON output, and whether its reasoning comes apart from its answers
(app.state.running.api_support, by the server's own rules).

Like every settings tab it edits a copy: `show_preferences(prefs)` fills it, `values()` gives
the fields it owns for the dialog to save on OK.
"""

from __future__ import annotations

import html
import secrets

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.state.preferences import Preferences
from app.state.running import RunningPair, api_support
from engine.errors import InvalidRequest
from engine.serving.guard import split_list
from engine.serving.server import ServeSettings


class ServerTab(QWidget):
    """The Server settings tab (see the module docstring)."""

    title = "Ser&ver"

    def __init__(self, parent: QWidget | None = None, running: RunningPair | None = None) -> None:
        super().__init__(parent)
        self.enabled = QCheckBox("Serve the loaded model over an &OpenAI-compatible API")
        self.enabled.setAccessibleName("Serve the loaded model over an OpenAI-compatible API")
        self.enabled.setToolTip("Editors, chat front ends and scripts that speak OpenAI's API can then use the model "
                                "loaded here. Their requests take turns with this window's chat.")
        self.port = QSpinBox()
        self.port.setRange(1024, 65535)
        self.port.setAccessibleName("Port")
        self.port.setToolTip("The TCP port clients connect to (another program may already use some ports).")
        self.api_key = QLineEdit()
        self.api_key.setAccessibleName("API key")
        self.api_key.setPlaceholderText("none: any program on this computer may use the API")
        self.api_key.setToolTip("Clients must send it as 'Authorization: Bearer <key>' (the api_key of OpenAI's clients).")
        self.new_key_button = QPushButton("&New key")
        self.new_key_button.setAccessibleName("Generate a new API key")
        self.new_key_button.clicked.connect(lambda: self.api_key.setText("sk-" + secrets.token_urlsafe(24)))
        key_row = QHBoxLayout()
        key_row.addWidget(self.api_key, 1)
        key_row.addWidget(self.new_key_button)
        self.lan = QCheckBox("Let other computers on the &network use it (needs an API key)")
        self.lan.setAccessibleName("Let other computers on the network use the API")
        self.lan.setToolTip("Listen on every network this computer is on instead of this computer only.")
        self.allowed_hosts = QLineEdit()
        self.allowed_hosts.setAccessibleName("Allowed hosts")
        self.allowed_hosts.setPlaceholderText("none: this computer's own names and addresses")
        self.allowed_hosts.setToolTip(
            "Other names clients use to reach the API, comma-separated (a reverse proxy's name, a DNS name on your "
            "network, *.example.com). Requests naming any other host are refused: that stops web pages that point "
            "their own name at this computer (DNS rebinding).")
        self.allowed_origins = QLineEdit()
        self.allowed_origins.setAccessibleName("Allowed web pages")
        self.allowed_origins.setPlaceholderText("none: web pages in a browser may not use the API")
        self.allowed_origins.setToolTip(
            "Web pages whose scripts may use the API from your browser, comma-separated, as scheme://host:port "
            "(e.g. http://localhost:3000; null for local files; * for any page). Any other page is refused.")
        self.url = QLineEdit()
        self.url.setReadOnly(True)
        self.url.setAccessibleName("API URL")
        copy = QPushButton("&Copy")
        copy.setAccessibleName("Copy the API URL")
        copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.url.text()))
        url_row = QHBoxLayout()
        url_row.addWidget(self.url, 1)
        url_row.addWidget(copy)
        form = QFormLayout()
        form.addRow(self.enabled)
        form.addRow("&Port:", self.port)
        form.addRow("API &key:", key_row)
        form.addRow(self.lan)
        form.addRow("Allowed &hosts:", self.allowed_hosts)
        form.addRow("Allowed &web pages:", self.allowed_origins)
        form.addRow("&URL:", url_row)
        self.note = QLabel()
        self.note.setWordWrap(True)
        self.note.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout = QVBoxLayout(self)
        fields = QWidget()
        fields.setLayout(form)
        fields.setMaximumWidth(720)
        layout.addWidget(fields)
        self.support = QLabel(support_text(running))
        self.support.setObjectName("serverSupport")
        self.support.setAccessibleName("What the API does with the loaded model")
        self.support.setWordWrap(True)
        self.support.setTextFormat(Qt.TextFormat.RichText)
        self.support.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.support.setMaximumWidth(720)
        layout.addWidget(self.support)
        layout.addWidget(self.note)
        layout.addStretch(1)
        for signal in (self.enabled.toggled, self.lan.toggled, self.port.valueChanged, self.api_key.textChanged,
                       self.allowed_hosts.textChanged, self.allowed_origins.textChanged):
            signal.connect(self._refresh)

    def show_preferences(self, prefs: Preferences) -> None:
        self.enabled.setChecked(prefs.server_enabled)
        self.port.setValue(prefs.server_port or Preferences().server_port)
        self.api_key.setText(prefs.server_api_key)
        self.lan.setChecked(prefs.server_lan and bool(prefs.server_api_key))
        self.allowed_hosts.setText(prefs.server_allowed_hosts)
        self.allowed_origins.setText(prefs.server_allowed_origins)
        self._refresh()

    def values(self) -> dict[str, object]:
        key = self.api_key.text().strip()
        return {"server_enabled": self.enabled.isChecked(), "server_port": self.port.value(), "server_api_key": key,
                "server_lan": self.lan.isChecked() and bool(key),
                "server_allowed_hosts": ", ".join(split_list(self.allowed_hosts.text())),
                "server_allowed_origins": ", ".join(split_list(self.allowed_origins.text()))}

    def _refresh(self) -> None:
        has_key = bool(self.api_key.text().strip())
        if not has_key and self.lan.isChecked():
            self.lan.setChecked(False)
        self.lan.setEnabled(has_key)
        problem = ""
        try:
            ServeSettings(allowed_hosts=split_list(self.allowed_hosts.text()),
                          allowed_origins=split_list(self.allowed_origins.text()))
        except InvalidRequest as exc:  # the API will not start with it: say so before OK
            problem = exc.user_message.replace("--allowed-hosts", "Allowed hosts").replace(
                "--allowed-origins", "Allowed web pages") + "\n\n"
        settings = ServeSettings(host="0.0.0.0" if self.lan.isChecked() else "127.0.0.1", port=self.port.value(),
                                 api_key=self.api_key.text().strip(), insecure=True)
        self.url.setText(settings.url())
        model = "MODEL"
        key_header = " -H 'Authorization: Bearer KEY'" if has_key else ""
        lan = (" Other computers use this computer's network address or host name in place of 127.0.0.1 (any "
               "other name they reach it by goes under Allowed hosts)."
               if self.lan.isChecked() else "")
        self.note.setText(
            f"{problem}It serves the model loaded in SpecChat (GET /v1/models gives its name); when none is loaded it "
            "answers 503. API requests and this window's chat take turns on the one engine; the status bar says "
            f"when the API is busy.{lan}\n\nTry it:  curl -N {settings.url()}/chat/completions{key_header} "
            f"-H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", \"stream\": true, "
            "\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'\n\nWeb pages open in your "
            "browser cannot use it unless listed under Allowed web pages, and requests must send "
            "'Content-Type: application/json'.")


def support_text(running: RunningPair | None) -> str:
    """What the API does with the loaded model (rich text): tools, JSON output, reasoning."""
    if running is None:
        return "<b>Loaded model:</b> none. What the API can do (tools, JSON output) is stated here once a model is loaded."
    support = api_support(running.chat_template)
    rows = [("Tools", support.tools_text), ("JSON output", support.json_text), ("Reasoning", support.reasoning_text)]
    cells = "".join(f"<tr><td><b>{name}:</b></td><td>{html.escape(text, quote=False)}</td></tr>" for name, text in rows)
    return (f"<b>Loaded model:</b> {html.escape(running.name, quote=False)}"
            f"<table cellspacing='0' cellpadding='2'>{cells}</table>")
