"""One app per user data folder: a second launch asks the first to raise its window and exits.

Who is first is decided by an exclusive lock on `app.lock` in the data folder (fcntl.flock on
Linux and macOS, msvcrt.locking on Windows), taken before any window opens and held for the
process's life. Two launches at the same moment: exactly one gets it. The operating system drops
the lock when its process ends, however it ends, so a killed app never blocks the next start.

The lock holder listens on a QLocalServer whose name is derived from the data folder (two test
runs with their own folders never meet; the installer's `app_running` computes the same name). A
later launch connects, sends "raise" and quits; it retries for a few seconds, since the holder
may have taken the lock a moment before it listens. Only a lock holder removes a server name
left behind by a crashed instance, so a running instance's name is never taken over.

Where the lock file cannot be made (a read-only data folder) the check falls back to the local
server alone, which two launches at the same moment can both pass; the log says so.
"""

from __future__ import annotations

import errno
import getpass
import hashlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from PySide6.QtCore import QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

CONNECT_TIMEOUT_MS = 500
RAISE_WAIT_S = 5.0  # how long a second launch keeps trying to reach the lock holder
RETRY_S = 0.05
LOCK_NAME = "app.lock"
_HELD = {errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES, getattr(errno, "EDEADLOCK", errno.EDEADLK)}

log = logging.getLogger(__name__)


def server_name(data_dir: Path) -> str:
    key = f"{getpass.getuser()}:{data_dir.resolve()}".encode()
    return "specchat-" + hashlib.sha1(key).hexdigest()[:16]


def take_lock(path: Path) -> BinaryIO | None:
    """The lock file at `path`, opened and exclusively locked; None when another process holds
    it. Raises OSError when the file cannot be made or locked at all (read-only folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    file = open(path, "a+b")  # noqa: SIM115 - kept open (and locked) for the process's life
    try:
        if sys.platform == "win32":
            import msvcrt

            file.seek(0)
            msvcrt.locking(file.fileno(), msvcrt.LK_NBLCK, 1)  # byte 0, even past the end of the file
        else:
            import fcntl

            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        file.close()
        if exc.errno in _HELD:
            return None
        raise
    return file


def notify_running(name: str, wait_s: float = 0.0) -> bool:
    """True when an instance listening on `name` was asked to raise its window; tries for up to
    `wait_s` seconds (a lock holder listens a moment after taking the lock)."""
    deadline = time.monotonic() + wait_s
    while True:
        socket = QLocalSocket()
        socket.connectToServer(name)
        if socket.waitForConnected(CONNECT_TIMEOUT_MS):
            socket.write(b"raise\n")
            socket.flush()
            socket.waitForBytesWritten(CONNECT_TIMEOUT_MS)
            socket.disconnectFromServer()
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(RETRY_S)


@dataclass(frozen=True)
class Running:
    """Another instance runs for this data folder; `raised`: it was asked to raise its window
    (False: it holds the lock but did not answer in time)."""

    raised: bool


class SingleInstance(QObject):
    """The first instance: the lock and the server. Signals: raise_requested()."""

    raise_requested = Signal()

    def __init__(self, name: str, lock: BinaryIO | None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.name = name
        self._lock = lock
        self.server = QLocalServer(self)
        self.server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        self.server.newConnection.connect(self._on_server_new_connection)

    @property
    def locked(self) -> bool:
        """The data folder's lock is held (False: the read-only fallback)."""
        return self._lock is not None

    def listen(self) -> bool:
        if self._lock is not None:
            QLocalServer.removeServer(self.name)  # we hold the lock: a name left here is a crashed instance's
        if self.server.listen(self.name):
            return True
        QLocalServer.removeServer(self.name)  # fallback without a lock: stale socket of a crashed instance
        return self.server.listen(self.name)

    def release(self) -> None:
        """Stop listening and let the lock go (the process's end does the same)."""
        self.server.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

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


def acquire(data_dir: Path, parent: QObject | None = None) -> SingleInstance | Running:
    """This process's SingleInstance (it holds the lock and listens), or Running when another
    instance has the data folder (it has been asked to raise its window). Needs a
    QCoreApplication."""
    name = server_name(data_dir)
    try:
        lock = take_lock(data_dir / LOCK_NAME)
    except OSError as exc:
        log.warning("no single-instance lock in %s (%s): two launches at the same moment may both run",
                    data_dir, exc.strerror or exc)
        lock = None
    else:
        if lock is None:
            raised = notify_running(name, RAISE_WAIT_S)
            if not raised:
                log.warning("another SpecChat holds %s but did not answer", data_dir / LOCK_NAME)
            return Running(raised)
    if notify_running(name):  # no lock here, or an earlier version's instance, which takes none
        if lock is not None:
            lock.close()
        return Running(True)
    instance = SingleInstance(name, lock, parent)
    instance.listen()
    return instance
