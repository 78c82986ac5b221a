"""One app per user data folder: a second launch asks the first to raise its window and exits.

The first instance listens on a QLocalServer whose name is derived from the data folder (two
test runs with their own folders never meet); a later one connects, sends "raise" and quits.
A server name left behind by a crashed instance is removed when nobody answers on it.
"""

from __future__ import annotations

import getpass
import hashlib
from pathlib import Path

from PySide6.QtCore import QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

CONNECT_TIMEOUT_MS = 500


def server_name(data_dir: Path) -> str:
    key = f"{getpass.getuser()}:{data_dir.resolve()}".encode()
    return "specchat-" + hashlib.sha1(key).hexdigest()[:16]


def notify_running(name: str) -> bool:
    """True when another instance listens on `name` and was asked to raise its window."""
    socket = QLocalSocket()
    socket.connectToServer(name)
    if not socket.waitForConnected(CONNECT_TIMEOUT_MS):
        return False
    socket.write(b"raise\n")
    socket.flush()
    socket.waitForBytesWritten(CONNECT_TIMEOUT_MS)
    socket.disconnectFromServer()
    return True


class SingleInstance(QObject):
    """The first instance's server. Signals: raise_requested()."""

    raise_requested = Signal()

    def __init__(self, name: str, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.name = name
        self.server = QLocalServer(self)
        self.server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        self.server.newConnection.connect(self._on_server_new_connection)

    def listen(self) -> bool:
        if self.server.listen(self.name):
            return True
        QLocalServer.removeServer(self.name)  # stale socket of a crashed instance
        return self.server.listen(self.name)

    def _on_server_new_connection(self) -> None:
        while self.server.hasPendingConnections():
            socket = self.server.nextPendingConnection()
            # a second launch writes one short line right after connecting, then exits
            if not socket.bytesAvailable():
                socket.waitForReadyRead(CONNECT_TIMEOUT_MS)
            message = bytes(socket.readAll().data())
            socket.abort()
            socket.deleteLater()
            if message.strip().startswith(b"raise"):
                self.raise_requested.emit()


def acquire(data_dir: Path, parent: QObject | None = None) -> SingleInstance | None:
    """The server for this data folder, or None when another instance is already running
    (it has been asked to raise its window)."""
    name = server_name(data_dir)
    if notify_running(name):
        return None
    instance = SingleInstance(name, parent)
    instance.listen()
    return instance
