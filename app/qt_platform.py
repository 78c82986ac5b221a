"""Before the first window: can Qt's X11 platform plugin load on this Linux machine?

PySide6's wheels carry Qt but not the X11/xcb client libraries, so `pip install -e . && specchat`
on a minimal system aborts inside QApplication: Qt names one library ("xcb-cursor0 ... is
needed", even when another one is missing) and, once that is installed, fails without a word on
the next. The installer checks the whole set; this does the same at start (app.main, before
QApplication) and gives the one package-manager line that installs them all.

The list of libraries, their packages per distribution and the check itself are the installer's
(`installer/specchat_setup/qt_libs.py`, standard library only): `app/qt_libs.py` is the same file,
since the installer runs from its own folder without the app and the app is installed without
the installer; tests/app/test_qt_platform.py fails when the two differ.

It runs only on Linux when Qt will use the xcb plugin: QT_QPA_PLATFORM or `-platform` names xcb
first, or names nothing outside a Wayland session. Offscreen, Wayland or any other platform is
never checked, and the presence of a display is never looked at. When the check cannot run (no
`ldd`, a frozen build without the plugin where expected) the app starts as before.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from . import qt_libs


def chosen_platform(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """The platform plugin Qt will try first: `-platform NAME` on the command line, else the
    first of QT_QPA_PLATFORM's "name[:options]" entries (";"-separated), else "wayland" in a
    Wayland session and "xcb" otherwise (Qt's default on Linux)."""
    args = list(argv[1:])
    for i, arg in enumerate(args):
        if arg in ("-platform", "--platform") and i + 1 < len(args):
            return _first(args[i + 1])
    value = environ.get("QT_QPA_PLATFORM", "")
    if value.strip():
        return _first(value)
    return "wayland" if environ.get("XDG_SESSION_TYPE", "").lower() == "wayland" else "xcb"


def _first(spec: str) -> str:
    return spec.split(";")[0].split(":")[0].strip().lower()


def missing_libraries_message(report: qt_libs.QtLibReport, as_root: bool = False) -> str:
    """What to tell the user when `report` found libraries missing: which, and the command."""
    lines = ["SpecChat cannot open its window: Qt's X11 platform plugin (xcb) needs system libraries "
             f"this computer lacks: {', '.join(report.missing)}."]
    command = report.command(as_root)
    if command:
        lines += ["Install them with:", "    " + " ".join(command)]
    if report.unmapped:
        lines.append(f"Install the packages that provide {', '.join(report.unmapped)} with your package manager.")
    lines.append("Then start SpecChat again. (In a Wayland session, QT_QPA_PLATFORM=wayland uses Wayland instead.)")
    return "\n".join(lines)


def startup_problem(argv: Sequence[str], environ: Mapping[str, str] | None = None,
                    pyside_dir: Path | None = None, system: str | None = None) -> str:
    """The message to print and exit with, or "" when Qt can open a window as far as this can
    tell (not Linux, not xcb, every library present, or the check could not run). `system`
    stands for sys.platform (tests)."""
    environ = os.environ if environ is None else environ
    if not (system or sys.platform).startswith("linux") or chosen_platform(argv, environ) != "xcb":
        return ""
    if pyside_dir is None:
        import PySide6

        pyside_dir = Path(PySide6.__file__).parent
    report = qt_libs.check(pyside_dir)
    if report.problem or not report.missing:
        return ""
    return missing_libraries_message(report, as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
