"""The start-up check of Qt's system libraries (app/qt_platform.py, issue 26 item 10).

The library search is `ldd`; the fakes here are a real `ldd` script on PATH that reports a
chosen set as missing, over a PySide6 folder holding the plugin's file names. The app's list is
the installer's (app/qt_libs.py is a copy of installer/specchat_setup/qt_libs.py: they must not
drift apart).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app import qt_libs
from app.qt_platform import chosen_platform, startup_problem

REPO = Path(__file__).resolve().parents[2]
MISSING = ("libxcb-icccm.so.4", "libxcb-keysyms.so.1", "libxcb-cursor.so.0")


def test_the_app_and_the_installer_share_one_list() -> None:
    installer = REPO / "installer" / "specchat_setup" / "qt_libs.py"
    assert (REPO / "app" / "qt_libs.py").read_bytes() == installer.read_bytes(), \
        "app/qt_libs.py must be a copy of installer/specchat_setup/qt_libs.py"


@pytest.mark.parametrize(("argv", "env", "platform"), [
    ([], {}, "xcb"),
    ([], {"XDG_SESSION_TYPE": "x11"}, "xcb"),
    ([], {"XDG_SESSION_TYPE": "wayland"}, "wayland"),
    ([], {"QT_QPA_PLATFORM": "offscreen"}, "offscreen"),
    ([], {"QT_QPA_PLATFORM": "xcb"}, "xcb"),
    ([], {"QT_QPA_PLATFORM": "xcb:dpi=96", "XDG_SESSION_TYPE": "wayland"}, "xcb"),
    ([], {"QT_QPA_PLATFORM": "wayland;xcb"}, "wayland"),
    ([], {"QT_QPA_PLATFORM": "  "}, "xcb"),
    (["-platform", "offscreen"], {"QT_QPA_PLATFORM": "xcb"}, "offscreen"),
    (["-platform", "xcb"], {"XDG_SESSION_TYPE": "wayland"}, "xcb"),
])
def test_the_platform_qt_will_use(argv: list[str], env: dict[str, str], platform: str) -> None:
    assert chosen_platform(["specchat", *argv], env) == platform


@pytest.fixture
def fake_ldd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A PySide6 folder with the xcb plugin's files, and an `ldd` first on PATH that reports
    MISSING as not found (and records each call). Returns (the PySide6 folder, the call log)."""
    pyside = tmp_path / "PySide6"
    for rel in ("Qt/plugins/platforms/libqxcb.so", "Qt/lib/libQt6XcbQpa.so.6"):
        (pyside / rel).parent.mkdir(parents=True, exist_ok=True)
        (pyside / rel).write_bytes(b"\x7fELF")
    calls = tmp_path / "ldd-calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    lines = "".join(f"\\t{lib} => not found\\n" for lib in MISSING)
    script = bin_dir / "ldd"
    script.write_text(f'#!/bin/sh\necho "$1" >> "{calls}"\nprintf "\\tlibc.so.6 => /lib/libc.so.6 (0x1)\\n{lines}"\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return pyside, calls


def _expected_command() -> str:
    manager = qt_libs.package_manager(Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else "")
    assert manager is not None
    packages = [qt_libs.PACKAGES[lib][manager] for lib in MISSING]
    prefix = [] if os.geteuid() == 0 else ["sudo"]
    return " ".join(prefix + qt_libs.INSTALL_COMMANDS[manager] + packages)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the package managers are Linux's")
def test_every_missing_library_is_named_with_one_install_command(fake_ldd: tuple[Path, Path]) -> None:
    pyside, calls = fake_ldd
    message = startup_problem(["specchat"], {"QT_QPA_PLATFORM": "xcb"}, pyside_dir=pyside)
    assert all(lib in message for lib in MISSING)  # all of them at once, not one per attempt
    assert f"\n    {_expected_command()}\n" in message
    assert calls.read_text().count("libqxcb.so") == 1


@pytest.mark.parametrize(("argv", "env", "system"), [
    (["specchat"], {"QT_QPA_PLATFORM": "offscreen"}, "linux"),
    (["specchat"], {"QT_QPA_PLATFORM": "wayland"}, "linux"),
    (["specchat"], {"XDG_SESSION_TYPE": "wayland"}, "linux"),
    (["specchat", "-platform", "offscreen"], {}, "linux"),
    (["specchat"], {"QT_QPA_PLATFORM": "xcb"}, "darwin"),
    (["specchat"], {}, "win32"),
])
def test_other_platforms_are_not_checked(fake_ldd: tuple[Path, Path], argv: list[str], env: dict[str, str],
                                         system: str) -> None:
    pyside, calls = fake_ldd
    assert startup_problem(argv, env, pyside_dir=pyside, system=system) == ""
    assert not calls.exists()  # the search did not even run


def test_nothing_missing_or_no_way_to_check_starts_as_before(tmp_path: Path, fake_ldd: tuple[Path, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pyside, _calls = fake_ldd
    assert startup_problem(["specchat"], {}, pyside_dir=tmp_path / "no-pyside", system="linux") == ""  # no plugin
    (tmp_path / "bin" / "ldd").write_text("#!/bin/sh\nprintf '\\tlibxcb.so.1 => /lib/libxcb.so.1 (0x1)\\n'\n")
    assert startup_problem(["specchat"], {}, pyside_dir=pyside, system="linux") == ""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no ldd at all
    assert startup_problem(["specchat"], {}, pyside_dir=pyside, system="linux") == ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="X11 is Linux's here")
def test_specchat_prints_the_command_and_exits_instead_of_aborting(tmp_path: Path,
                                                                    fake_ldd: tuple[Path, Path]) -> None:
    """The real entry point in a real process, with the fake search pointed at the installed
    PySide6's plugin (it exists; the fake ldd decides what is missing)."""
    import PySide6

    _pyside, calls = fake_ldd
    env = dict(os.environ, QT_QPA_PLATFORM="xcb", SPECCHAT_DATA_DIR=str(tmp_path / "data"),
               SPECCHAT_LOG_DIR=str(tmp_path / "logs"))
    done = subprocess.run([sys.executable, "-c", "import sys; from app.launcher import main; sys.exit(main([]))"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr  # not Qt's abort (-6)
    assert _expected_command() in done.stderr and "could not load the Qt platform plugin" not in done.stderr
    assert str(Path(PySide6.__file__).parent) in calls.read_text()
    assert not (tmp_path / "data").exists()  # it stopped before anything else


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="X11 is Linux's here")
def test_this_machine_real_libraries(tmp_path: Path) -> None:
    """The real search on this machine: where Qt's xcb plugin lacks libraries, `specchat` on
    xcb names them all and exits 1 (skipped where none are missing)."""
    import PySide6

    report = qt_libs.check(Path(PySide6.__file__).parent)
    if report.problem or not report.missing:
        pytest.skip(report.problem or "Qt's xcb libraries are all installed here")
    env = dict(os.environ, QT_QPA_PLATFORM="xcb", SPECCHAT_DATA_DIR=str(tmp_path / "data"))
    done = subprocess.run([sys.executable, "-c", "import sys; from app.launcher import main; sys.exit(main([]))"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and all(lib in done.stderr for lib in report.missing), done.stderr
    assert " ".join(report.command(os.geteuid() == 0)) in done.stderr
