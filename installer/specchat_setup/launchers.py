"""The launchers: a freedesktop .desktop entry (Linux), an .app bundle (macOS), Start-menu and
desktop shortcuts plus an "Apps & features" entry (Windows).

Each `make_*` function writes its files and returns the paths it created, which go into the
install manifest so the uninstaller removes exactly those. The file contents are built by pure
functions (`desktop_entry`, `info_plist`, `shortcut_script`) that tests check directly.
"""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .locations import DISPLAY_NAME, Layout, home

BUNDLE_ID = "io.specchat.SpecChat"
DESKTOP_FILE = "specchat.desktop"  # matches QGuiApplication.setDesktopFileName("specchat")
WM_CLASS = "SpecChat"  # Qt's X11 WM_CLASS class: the application name
ICON_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
COMMENT = "Chat with large open language models on your own computer"
UNINSTALL_KEY = r"Software\Microsoft\Windows\CurrentVersion\Uninstall\SpecChat"


@dataclass(frozen=True)
class Launchers:
    files: tuple[Path, ...]  # files and folders created (removed on uninstall)
    registry: tuple[str, ...] = ()  # Windows registry keys created under HKEY_CURRENT_USER
    notes: tuple[str, ...] = ()  # what the user should know (a step that was skipped, and why)


# ---- Linux -------------------------------------------------------------------------------

def exec_quote(arg: str) -> str:
    """Quote one argument for a .desktop Exec key (Desktop Entry Specification, "The Exec
    key"): double quotes when it has reserved characters, \\ before ", `, $ and \\ inside them,
    then the string-value escape that doubles every backslash; % is written %%."""
    reserved = set(' \t\n"\'\\><~|&;$*?#()`')
    escaped = arg.replace("%", "%%")
    if any(c in reserved for c in escaped):
        inner = "".join("\\" + c if c in '"`$\\' else c for c in escaped)
        escaped = f'"{inner}"'
    return escaped.replace("\\", "\\\\")


def exec_unquote(value: str) -> list[str]:
    """The inverse of exec_quote over a whole Exec value (used to launch an entry as a desktop
    would)."""
    value = value.replace("\\\\", "\\")
    args: list[str] = []
    current: list[str] = []
    quoted = in_arg = False
    i = 0
    while i < len(value):
        c = value[i]
        if quoted:
            if c == "\\" and i + 1 < len(value) and value[i + 1] in '"`$\\':
                current.append(value[i + 1])
                i += 1
            elif c == '"':
                quoted = False
            else:
                current.append(c)
        elif c == '"':
            quoted = in_arg = True
        elif c == " ":
            if in_arg:
                args.append("".join(current))
                current, in_arg = [], False
        else:
            current.append(c)
            in_arg = True
        i += 1
    if in_arg:
        args.append("".join(current))
    return [a.replace("%%", "%") for a in args]


def desktop_entry(program: Path, icon: Path, version: str) -> str:
    return "\n".join([
        "[Desktop Entry]",
        "Type=Application",
        "Version=1.4",  # the newest Debian 12's desktop-file-validate knows
        f"Name={DISPLAY_NAME}",
        "GenericName=AI chat",
        f"Comment={COMMENT}",
        f"Exec={exec_quote(str(program))}",
        f"TryExec={str(program)}",
        f"Icon={icon}",
        "Terminal=false",
        "Categories=Utility;",
        "Keywords=AI;LLM;chat;assistant;language model;",
        "StartupNotify=true",
        f"StartupWMClass={WM_CLASS}",
        f"X-SpecChat-Version={version}",
        "",
    ])


def desktop_folder() -> Path | None:
    """The user's desktop folder, if there is one (xdg-user-dirs, else ~/Desktop)."""
    config = Path(os.environ.get("XDG_CONFIG_HOME") or home() / ".config") / "user-dirs.dirs"
    try:
        for line in config.read_text().splitlines():
            if line.startswith("XDG_DESKTOP_DIR="):
                value = line.split("=", 1)[1].strip().strip('"').replace("$HOME", str(home()))
                folder = Path(value)
                if folder.is_dir() and folder != home():
                    return folder
    except OSError:
        pass
    folder = home() / "Desktop"
    return folder if folder.is_dir() else None


def xdg_data_home() -> Path:
    value = os.environ.get("XDG_DATA_HOME", "")
    return Path(value) if value and os.path.isabs(value) else home() / ".local" / "share"


def make_linux(layout: Layout, version: str, desktop_shortcut: bool = True) -> Launchers:
    created: list[Path] = []
    notes: list[str] = []
    icon_root = xdg_data_home() / "icons" / "hicolor"
    for size in ICON_SIZES:
        target = icon_root / f"{size}x{size}" / "apps" / "specchat.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(layout.icons / f"specchat-{size}.png", target)
        created.append(target)
    scalable = icon_root / "scalable" / "apps" / "specchat.svg"
    scalable.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(layout.icons / "specchat.svg", scalable)
    created.append(scalable)
    text = desktop_entry(layout.gui_program, icon_root / "256x256" / "apps" / "specchat.png", version)
    applications = xdg_data_home() / "applications"
    applications.mkdir(parents=True, exist_ok=True)
    entry = applications / DESKTOP_FILE
    entry.write_text(text, encoding="utf-8")
    created.append(entry)
    _quiet([["update-desktop-database", str(applications)],
            ["gtk-update-icon-cache", "--quiet", "--ignore-theme-index", str(icon_root)]])
    folder = desktop_folder() if desktop_shortcut else None
    if folder is not None:
        on_desktop = folder / DESKTOP_FILE
        on_desktop.write_text(text, encoding="utf-8")
        on_desktop.chmod(0o755)  # file managers launch only executable (and trusted) entries
        created.append(on_desktop)
        _quiet([["gio", "set", str(on_desktop), "metadata::trusted", "true"]])
    elif desktop_shortcut:
        notes.append("no desktop folder found, so no desktop icon; SpecChat is in the applications menu")
    return Launchers(tuple(created), notes=tuple(notes))


def _quiet(commands: list[list[str]]) -> None:
    """Run optional helpers (cache refreshers) that may be missing; their failure is harmless."""
    for command in commands:
        if shutil.which(command[0]):
            subprocess.run(command, capture_output=True, check=False, timeout=60)


def link_command(layout: Layout) -> Launchers:
    """Linux and macOS: `specchat` on the PATH for terminal use, as a link in ~/.local/bin when
    that folder is on the PATH (most desktop distributions put it there). A file of the same
    name that is not our link is left alone."""
    folder = home() / ".local" / "bin"
    on_path = any(Path(p).expanduser() == folder for p in os.environ.get("PATH", "").split(os.pathsep) if p)
    link = folder / "specchat"
    if not on_path:
        return Launchers((), notes=(f"for the terminal command, add {layout.venv_bin} to your PATH",))
    if link.exists() and not link.is_symlink():
        return Launchers((), notes=(f"{link} exists and is not SpecChat's; left as it is",))
    folder.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        link.unlink()
    link.symlink_to(layout.cli_program)
    return Launchers((link,))


# ---- macOS -------------------------------------------------------------------------------

def info_plist(version: str) -> dict[str, object]:
    return {
        "CFBundleName": DISPLAY_NAME,
        "CFBundleDisplayName": DISPLAY_NAME,
        "CFBundleIdentifier": BUNDLE_ID,
        "CFBundleExecutable": DISPLAY_NAME,
        "CFBundleIconFile": DISPLAY_NAME,  # Contents/Resources/SpecChat.icns
        "CFBundlePackageType": "APPL",
        "CFBundleInfoDictionaryVersion": "6.0",
        "CFBundleShortVersionString": version,
        "CFBundleVersion": version,
        "LSMinimumSystemVersion": "12.0",
        "LSApplicationCategoryType": "public.app-category.productivity",
        "NSHighResolutionCapable": True,
        "NSHumanReadableCopyright": "Apache-2.0",
    }


def bundle_script(program: Path) -> str:
    quoted = "'" + str(program).replace("'", "'\\''") + "'"
    return "\n".join([
        "#!/bin/sh",
        "# SpecChat's launcher: runs the app from its private Python environment.",
        f"if [ ! -x {quoted} ]; then",
        "  osascript -e 'display alert \"SpecChat is not installed correctly\" message "
        "\"Run the SpecChat installer again.\"' >/dev/null 2>&1",
        "  exit 1",
        "fi",
        f'exec {quoted} "$@"',
        "",
    ])


def make_macos_bundle(layout: Layout, version: str, applications: Path | None = None) -> Launchers:
    """~/Applications/SpecChat.app: Info.plist, a launcher script, the icon."""
    applications = applications or home() / "Applications"
    bundle = applications / f"{DISPLAY_NAME}.app"
    if bundle.exists():
        shutil.rmtree(bundle)
    contents = bundle / "Contents"
    (contents / "MacOS").mkdir(parents=True)
    (contents / "Resources").mkdir()
    with open(contents / "Info.plist", "wb") as handle:
        plistlib.dump(info_plist(version), handle)
    (contents / "PkgInfo").write_text("APPL????")
    launcher = contents / "MacOS" / DISPLAY_NAME
    launcher.write_text(bundle_script(layout.gui_program))
    launcher.chmod(0o755)
    shutil.copyfile(layout.icons / "specchat.icns", contents / "Resources" / f"{DISPLAY_NAME}.icns")
    _quiet([["touch", str(bundle)]])  # Finder picks up the new icon
    return Launchers((bundle,))


# ---- Windows -----------------------------------------------------------------------------

def ps_quote(text: str) -> str:
    """A PowerShell single-quoted string literal."""
    return "'" + text.replace("'", "''") + "'"


def shortcut_script(shortcuts: list[Path], target: Path, icon: Path, workdir: Path) -> str:
    """PowerShell that creates .lnk shortcuts through the WScript.Shell COM object."""
    lines = ["$ErrorActionPreference = 'Stop'", "$shell = New-Object -ComObject WScript.Shell"]
    for path in shortcuts:
        lines += [
            f"$link = $shell.CreateShortcut({ps_quote(str(path))})",
            f"$link.TargetPath = {ps_quote(str(target))}",
            f"$link.WorkingDirectory = {ps_quote(str(workdir))}",
            f"$link.IconLocation = {ps_quote(str(icon) + ',0')}",
            f"$link.Description = {ps_quote(COMMENT)}",
            "$link.Save()",
        ]
    return "\n".join(lines) + "\n"


def windows_folders() -> tuple[Path, Path | None]:
    """(Start-menu Programs folder, Desktop folder or None)."""
    appdata = Path(os.environ.get("APPDATA") or home() / "AppData" / "Roaming")
    start_menu = appdata / "Microsoft" / "Windows" / "Start Menu" / "Programs"
    desktop = home() / "Desktop"
    try:
        found = subprocess.run(
            ["powershell", "-NoProfile", "-Command", "[Environment]::GetFolderPath('Desktop')"],
            capture_output=True, text=True, timeout=60, check=False).stdout.strip()
        if found:
            desktop = Path(found)
    except OSError:
        pass
    return start_menu, desktop if desktop.is_dir() else None


def make_windows(layout: Layout, version: str, desktop_shortcut: bool = True) -> Launchers:
    start_menu, desktop = windows_folders()
    start_menu.mkdir(parents=True, exist_ok=True)
    shortcuts = [start_menu / f"{DISPLAY_NAME}.lnk"]
    if desktop_shortcut and desktop is not None:
        shortcuts.append(desktop / f"{DISPLAY_NAME}.lnk")
    script = shortcut_script(shortcuts, layout.gui_program, layout.icons / "specchat.ico", layout.data)
    done = subprocess.run(["powershell", "-NoProfile", "-ExecutionPolicy", "Bypass", "-Command", script],
                          capture_output=True, text=True, timeout=120, check=False)
    notes: list[str] = []
    if done.returncode != 0:
        notes.append(f"the shortcuts could not be created ({done.stderr.strip()[:300]}); "
                     f"start SpecChat with {layout.gui_program}")
        shortcuts = []
    registry = _register_uninstaller(layout, version)
    return Launchers(tuple(shortcuts), registry=registry, notes=tuple(notes))


def uninstall_command(layout: Layout) -> str:
    return f'powershell.exe -NoProfile -ExecutionPolicy Bypass -File "{layout.uninstaller}"'


def _register_uninstaller(layout: Layout, version: str) -> tuple[str, ...]:
    """An entry in Settings > Apps (per user, no admin rights)."""
    import winreg  # type: ignore[import-not-found]  # Windows only

    with winreg.CreateKey(winreg.HKEY_CURRENT_USER, UNINSTALL_KEY) as key:
        values = {
            "DisplayName": DISPLAY_NAME,
            "DisplayVersion": version,
            "Publisher": DISPLAY_NAME,
            "DisplayIcon": str(layout.icons / "specchat.ico"),
            "InstallLocation": str(layout.runtime),
            "UninstallString": uninstall_command(layout),
        }
        for name, value in values.items():
            winreg.SetValueEx(key, name, 0, winreg.REG_SZ, value)
        winreg.SetValueEx(key, "NoModify", 0, winreg.REG_DWORD, 1)
        winreg.SetValueEx(key, "NoRepair", 0, winreg.REG_DWORD, 1)
    return (UNINSTALL_KEY,)


def remove_registry(keys: tuple[str, ...] | list[str]) -> None:
    import winreg  # type: ignore[import-not-found]

    for key in keys:
        try:
            winreg.DeleteKey(winreg.HKEY_CURRENT_USER, key)
        except OSError:
            pass


def remove_settings_registry() -> None:
    """QSettings("SpecChat", "SpecChat") on Windows: HKCU\\Software\\SpecChat\\SpecChat."""
    import winreg  # type: ignore[import-not-found]

    for key in (r"Software\SpecChat\SpecChat", r"Software\SpecChat"):
        try:
            winreg.DeleteKey(winreg.HKEY_CURRENT_USER, key)
        except OSError:
            pass


def make(layout: Layout, version: str, desktop_shortcut: bool = True) -> Launchers:
    if layout.platform == "windows":
        return make_windows(layout, version, desktop_shortcut)
    made = make_macos_bundle(layout, version) if layout.platform == "macos" else \
        make_linux(layout, version, desktop_shortcut)
    command = link_command(layout)
    return Launchers(made.files + command.files, made.registry, made.notes + command.notes)
