"""Entry script of the frozen (PyInstaller one-folder) build; see specchat.spec.

One script serves both executables of the bundle, told apart by their file name:
`specchat-gui` (a windowed executable on Windows and macOS) runs the desktop app
(`app.main:main`); `specchat` runs the launcher (`app.launcher:main`): the command line, or the
app when given no arguments, as the pip-installed `specchat` does.
"""

from __future__ import annotations

import sys
from pathlib import Path

GUI_NAMES = ("specchat-gui",)


def wants_gui(executable: str) -> bool:
    """True when the running executable is the bundle's windowed `specchat-gui`."""
    return Path(executable).stem.lower() in GUI_NAMES


def main() -> int:
    if wants_gui(sys.executable):
        from app.main import main as gui_main

        return int(gui_main() or 0)
    from app.launcher import main as launcher_main

    return int(launcher_main())


if __name__ == "__main__":
    sys.exit(main())
