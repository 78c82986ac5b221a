"""SpecChat's desktop app (PySide6) over the engine.

Rooms, each a package whose `__init__` states its contract; a room imports only the rooms
listed before it (tests/app/test_rooms.py holds it):

- `state`   what the app knows and keeps: preferences, conversations (SQLite), remote engine
            entries, what runs, the log file. Plain data and stores; no widgets.
- `workers` the threads that do the slow work (the engine, remote engines, downloads,
            measurements, disk scans) and the API server over the engine. No widgets.
- `widgets` pieces every page uses: the status bar and error banner, eliding fields, the
            injected dialogs, keyboard mnemonics.
- `chat`    the chat page and its parts, with the Qt-free turn controller.
- `models`  the models page and its parts: pairs, catalog, local models, downloads.
- `settings` the settings dialog and its tabs.
- `wizard`  the first-run wizard.

The shell is this folder's own modules: `launcher` (the `specchat` entry point), `main`
(start-up, `specchat-gui`), `main_window`, `theme`, `single_instance`, and the Qt checks before
the first window (`qt_platform`, `qt_libs`).

What the app does not do: touch tensors or import torch in the GUI thread (the engine runs in
`workers`' threads).
"""
