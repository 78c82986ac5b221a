"""Settings > Server and Settings > Engines: what they show, what OK saves, and listing a
server's models in the worker thread (against the vLLM stand-in)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QTableWidgetItem
from pytestqt.qtbot import QtBot
from remote_helpers import VLLM_MODEL, VllmStandIn

from app.chat.engine_picker import EnginePicker
from app.settings.dialog import SettingsDialog
from app.state.remote_engines import RemoteEngineEntry, encode_choice, parse_engines

KEY = "token-abc123"


@pytest.fixture
def vllm() -> Iterator[VllmStandIn]:
    server = VllmStandIn(models=(VLLM_MODEL, "Qwen/Qwen2.5-7B-Instruct"), api_key=KEY).start()
    yield server
    server.stop()


def test_server_tab_saves_its_fields_and_guards_the_network(qtbot: QtBot, make_prefs) -> None:
    store = make_prefs()
    dialog = SettingsDialog(store)
    qtbot.addWidget(dialog)
    tab = dialog.server_tab
    assert dialog.tabs.indexOf(tab) >= 0 and not tab.enabled.isChecked()
    assert tab.url.text() == "http://127.0.0.1:8765/v1" and not tab.lan.isEnabled()  # no key: this computer only
    tab.enabled.setChecked(True)
    tab.port.setValue(9001)
    assert tab.url.text() == "http://127.0.0.1:9001/v1" and "curl -N http://127.0.0.1:9001/v1" in tab.note.text()
    qtbot.mouseClick(tab.new_key_button, Qt.MouseButton.LeftButton)
    generated = tab.api_key.text()
    assert generated.startswith("sk-") and len(generated) > 20
    assert tab.lan.isEnabled() and "Bearer KEY" in tab.note.text()
    tab.lan.setChecked(True)
    tab.api_key.clear()  # a network server without a key is not offered
    assert not tab.lan.isChecked() and not tab.lan.isEnabled()
    tab.api_key.setText("sk-mine")
    tab.lan.setChecked(True)
    dialog.accept()
    prefs = store.load()
    assert (prefs.server_enabled, prefs.server_port, prefs.server_api_key, prefs.server_lan) == (
        True, 9001, "sk-mine", True)

    again = SettingsDialog(store)
    qtbot.addWidget(again)
    assert again.server_tab.values() == {"server_enabled": True, "server_port": 9001, "server_api_key": "sk-mine",
                                         "server_lan": True, "server_allowed_hosts": "",
                                         "server_allowed_origins": ""}
    again.reject()


def test_server_tab_sets_the_hosts_and_web_pages_let_in(qtbot: QtBot, make_prefs) -> None:
    store = make_prefs()
    dialog = SettingsDialog(store)
    qtbot.addWidget(dialog)
    tab = dialog.server_tab
    assert tab.allowed_hosts.text() == tab.allowed_origins.text() == ""
    assert "Allowed web pages" in tab.note.text()  # says that web pages are refused by default
    tab.allowed_origins.setText("localhost:3000")  # no scheme: not an origin
    assert "localhost:3000" in tab.note.text() and "Allowed web pages" in tab.note.text().split("\n")[0]
    tab.allowed_hosts.setText("gpu-box.lan  models.example.com:8443")
    tab.allowed_origins.setText("http://localhost:3000,null")
    assert "localhost:3000" not in tab.note.text().split("\n")[0]
    dialog.accept()
    prefs = store.load()
    assert prefs.server_allowed_hosts == "gpu-box.lan, models.example.com:8443"
    assert prefs.server_allowed_origins == "http://localhost:3000, null"
    again = SettingsDialog(store)
    qtbot.addWidget(again)
    assert again.server_tab.allowed_hosts.text() == "gpu-box.lan, models.example.com:8443"
    assert again.server_tab.allowed_origins.text() == "http://localhost:3000, null"
    again.reject()


def test_engines_tab_lists_a_servers_models_and_the_chat_menu_offers_them(qtbot: QtBot, make_prefs,
                                                                          vllm: VllmStandIn) -> None:
    store = make_prefs()
    dialog = SettingsDialog(store)
    qtbot.addWidget(dialog)
    tab = dialog.engines_tab
    qtbot.mouseClick(tab.add_button, Qt.MouseButton.LeftButton)
    assert tab.table.rowCount() == 1
    tab.table.setItem(0, 1, QTableWidgetItem(vllm.url))
    tab.table.setItem(0, 2, QTableWidgetItem("wrong"))
    qtbot.mouseClick(tab.list_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "API key" in tab.status.text(), timeout=30_000)  # said, in the tab
    tab.table.setItem(0, 2, QTableWidgetItem(KEY))
    qtbot.mouseClick(tab.list_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "serves 2 models" in tab.status.text(), timeout=30_000)
    dialog.accept()
    [entry] = parse_engines(store.load().remote_engines)
    assert entry == RemoteEngineEntry("gpu-box", vllm.url, KEY, ("Qwen/Qwen2.5-7B-Instruct", VLLM_MODEL))
    assert json.loads(store.load().remote_engines)[0]["api_key"] == KEY

    picker = EnginePicker()
    qtbot.addWidget(picker)
    picker.reload(store.load())
    assert [picker.itemText(i) for i in range(picker.count())] == [
        "Local model", "gpu-box: Qwen/Qwen2.5-7B-Instruct", f"gpu-box: {VLLM_MODEL}"]
    assert picker.findData(encode_choice("gpu-box", VLLM_MODEL)) == 2


def test_unreadable_engine_settings_give_what_can_be_read() -> None:
    good = {"name": "a", "url": "http://a:8000/v1", "api_key": "", "models": ["m"]}
    text = json.dumps([good, {"name": "no url"}, "junk", {"name": "b", "url": "http://b/v1", "models": None}])
    assert [e.name for e in parse_engines(text)] == ["a", "b"]
    assert parse_engines("{not json") == () and parse_engines("") == ()
