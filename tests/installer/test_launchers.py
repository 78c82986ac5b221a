"""The launchers' files: a .desktop entry the freedesktop validator accepts, an .app bundle
whose Info.plist macOS can read, and PowerShell that parses."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
from pathlib import Path

import pytest
from installer_env import INSTALLER, REPO
from specchat_setup import launchers
from specchat_setup.locations import Layout

AWKWARD = ['/home/ann/My Apps/spec"chat$/bin/specchat-gui', "/opt/100%/run", "plain", "tab\there", "back\\slash"]


def validator() -> str | None:
    found = shutil.which("desktop-file-validate")
    if found is None and os.environ.get("CI"):
        pytest.fail("desktop-file-validate is missing; .ci/run installs Debian's desktop-file-utils")
    return found


def fake_install(home: Path) -> Layout:
    """A runtime folder with the files the launchers point at (as an install leaves it)."""
    layout = Layout("linux", home / ".local" / "share" / "specchat", home / ".cache" / "specchat")
    shutil.copytree(REPO / "resources" / "icons", layout.icons)
    layout.venv_bin.mkdir(parents=True)
    layout.gui_program.write_text("#!/bin/sh\n")
    layout.gui_program.chmod(0o755)
    return layout


@pytest.mark.parametrize("arg", AWKWARD)
def test_exec_quoting_round_trips(arg: str) -> None:
    quoted = launchers.exec_quote(arg)
    assert launchers.exec_unquote(quoted) == [arg]
    assert launchers.exec_unquote(quoted + " --flag " + launchers.exec_quote(arg)) == [arg, "--flag", arg]


def test_desktop_entry_is_valid_and_points_at_the_install(tmp_path: Path) -> None:
    program = tmp_path / "My Apps" / "bin" / "specchat-gui"
    text = launchers.desktop_entry(program, tmp_path / "icon.png", "1.2.3")
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    assert launchers.exec_unquote(fields["Exec"]) == [str(program)]
    assert fields["StartupWMClass"] == "SpecChat" and fields["Terminal"] == "false"
    entry = tmp_path / "specchat.desktop"
    entry.write_text(text)
    tool = validator()
    if tool:
        done = subprocess.run([tool, str(entry)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


def test_linux_launchers_written_where_desktops_look(home: Path) -> None:
    (home / "Desktop").mkdir()
    layout = fake_install(home)
    made = launchers.make_linux(layout, "0.1.0")
    entry = home / ".local" / "share" / "applications" / "specchat.desktop"
    on_desktop = home / "Desktop" / "specchat.desktop"
    assert entry in made.files and on_desktop in made.files
    assert os.access(on_desktop, os.X_OK)
    for size in launchers.ICON_SIZES:
        assert (home / ".local" / "share" / "icons" / "hicolor" / f"{size}x{size}" / "apps" / "specchat.png").is_file()
    icon = next(line.split("=", 1)[1] for line in entry.read_text().splitlines() if line.startswith("Icon="))
    assert Path(icon).is_file()
    without = launchers.make_linux(layout, "0.1.0", desktop_shortcut=False)
    assert on_desktop not in without.files


def test_desktop_folder_from_user_dirs(home: Path) -> None:
    (home / "Schreibtisch").mkdir()
    (home / ".config").mkdir()
    (home / ".config" / "user-dirs.dirs").write_text('XDG_DESKTOP_DIR="$HOME/Schreibtisch"\n')
    assert launchers.desktop_folder() == home / "Schreibtisch"


def test_macos_bundle(home: Path) -> None:
    layout = fake_install(home)
    made = launchers.make_macos_bundle(layout, "0.4.1", applications=home / "Applications")
    bundle = made.files[0]
    assert bundle == home / "Applications" / "SpecChat.app"
    with open(bundle / "Contents" / "Info.plist", "rb") as handle:
        plist = plistlib.load(handle)
    assert plist["CFBundlePackageType"] == "APPL" and plist["CFBundleShortVersionString"] == "0.4.1"
    executable = bundle / "Contents" / "MacOS" / plist["CFBundleExecutable"]
    assert os.access(executable, os.X_OK)
    assert (bundle / "Contents" / "Resources" / f"{plist['CFBundleIconFile']}.icns").read_bytes()[:4] == b"icns"
    assert plist["CFBundleIdentifier"].count(".") == 2 and plist["NSHighResolutionCapable"] is True
    # the launcher script runs what it points at (here the fake program), and reports a missing one
    assert subprocess.run(["sh", str(executable)], check=False).returncode == 0
    layout.gui_program.unlink()
    assert subprocess.run(["sh", str(executable)], capture_output=True, check=False).returncode == 1
    again = launchers.make_macos_bundle(layout, "0.4.2", applications=home / "Applications")  # upgrade
    with open(again.files[0] / "Contents" / "Info.plist", "rb") as handle:
        assert plistlib.load(handle)["CFBundleVersion"] == "0.4.2"


def powershell_errors(source: bytes) -> list[str]:
    """Syntax errors in PowerShell source, from the tree-sitter PowerShell grammar."""
    import tree_sitter
    import tree_sitter_powershell

    parser = tree_sitter.Parser(tree_sitter.Language(tree_sitter_powershell.language()))
    errors: list[str] = []
    stack = [parser.parse(source).root_node]
    while stack:
        node = stack.pop()
        if node.is_error or node.is_missing:
            errors.append(f"line {node.start_point[0] + 1}: {node.text[:60]!r}")
        stack.extend(node.children)
    return errors


def test_powershell_checker_finds_errors() -> None:
    assert powershell_errors(b"try { $a = @(1, 2 } catch { Write-Host 'x'\n")
    assert powershell_errors(b"if ($x -eq 1) { Write-Host 'unclosed }\n")


@pytest.mark.parametrize("script", ["install.ps1", "uninstall.ps1"])
def test_windows_scripts_parse(script: str) -> None:
    assert powershell_errors((INSTALLER / script).read_bytes()) == []


def test_windows_shortcut_script_parses_with_awkward_paths() -> None:
    shortcuts = [Path(r"C:\Users\O'Brien\AppData\Roaming\Microsoft\Windows\Start Menu\Programs\SpecChat.lnk")]
    script = launchers.shortcut_script(shortcuts, Path(r"C:\Users\O'Brien\AppData\Local\specchat\runtime\venv\Scripts\specchat-gui.exe"),
                                       Path(r"C:\icons\specchat.ico"), Path(r"C:\Users\O'Brien"))
    assert "O''Brien" in script
    assert powershell_errors(script.encode()) == []
    assert launchers.ps_quote("it's") == "'it''s'"


def test_terminal_command_linked_only_onto_the_path(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = fake_install(home)
    layout.cli_program.write_text("#!/bin/sh\n")
    bin_dir = home / ".local" / "bin"
    monkeypatch.setenv("PATH", "/usr/bin")
    assert launchers.link_command(layout).files == ()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin")
    made = launchers.link_command(layout)
    assert made.files == (bin_dir / "specchat",) and (bin_dir / "specchat").resolve() == layout.cli_program
    launchers.link_command(layout)  # again (an upgrade): replaced, no error
    (bin_dir / "specchat").unlink()
    (bin_dir / "specchat").write_text("someone else's")
    kept = launchers.link_command(layout)
    assert kept.files == () and "left as it is" in kept.notes[0]
    assert (bin_dir / "specchat").read_text() == "someone else's"


@pytest.mark.parametrize("script", ["install.sh", "uninstall.sh", "install.command"])
def test_posix_scripts_parse_and_are_executable(script: str) -> None:
    path = INSTALLER / script
    assert os.access(path, os.X_OK)
    for shell in ("sh", "dash", "bash"):
        if shutil.which(shell):
            done = subprocess.run([shell, "-n", str(path)], capture_output=True, text=True, check=False)
            assert done.returncode == 0, f"{shell}: {done.stderr}"


def test_windows_double_click_wrapper() -> None:
    raw = (INSTALLER / "install.cmd").read_bytes()
    assert raw.count(b"\r\n") == raw.count(b"\n") > 0  # cmd.exe wants CRLF line ends
    assert b'-ExecutionPolicy Bypass -File "%~dp0install.ps1" %*' in raw
