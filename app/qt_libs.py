"""The system libraries Qt's X11 (xcb) platform plugin needs on Linux.

PySide6's wheels carry Qt but not the X11/xcb client libraries. A minimal desktop install
lacks some of them, and the app then aborts with "could not load the Qt platform plugin xcb".
The check asks the dynamic linker (`ldd`) which libraries the installed plugin cannot find,
and maps each missing library to the package that provides it on the distribution's package
manager, so the message is the exact command to run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# library -> package, per package manager. Debian/Ubuntu names are the runtime packages.
PACKAGES: dict[str, dict[str, str]] = {
    "libxcb-cursor.so.0": {"apt": "libxcb-cursor0", "dnf": "xcb-util-cursor", "pacman": "xcb-util-cursor", "zypper": "libxcb-cursor0"},
    "libxcb-icccm.so.4": {"apt": "libxcb-icccm4", "dnf": "xcb-util-wm", "pacman": "xcb-util-wm", "zypper": "libxcb-icccm4"},
    "libxcb-keysyms.so.1": {"apt": "libxcb-keysyms1", "dnf": "xcb-util-keysyms", "pacman": "xcb-util-keysyms", "zypper": "libxcb-keysyms1"},
    "libxkbcommon-x11.so.0": {"apt": "libxkbcommon-x11-0", "dnf": "libxkbcommon-x11", "pacman": "libxkbcommon-x11", "zypper": "libxkbcommon-x11-0"},
    "libxkbcommon.so.0": {"apt": "libxkbcommon0", "dnf": "libxkbcommon", "pacman": "libxkbcommon", "zypper": "libxkbcommon0"},
    "libxcb-image.so.0": {"apt": "libxcb-image0", "dnf": "xcb-util-image", "pacman": "xcb-util-image", "zypper": "libxcb-image0"},
    "libxcb-render-util.so.0": {"apt": "libxcb-render-util0", "dnf": "xcb-util-renderutil", "pacman": "xcb-util-renderutil", "zypper": "libxcb-render-util0"},
    "libxcb-util.so.1": {"apt": "libxcb-util1", "dnf": "xcb-util", "pacman": "xcb-util", "zypper": "libxcb-util1"},
    "libxcb-shape.so.0": {"apt": "libxcb-shape0", "dnf": "libxcb", "pacman": "libxcb", "zypper": "libxcb-shape0"},
    "libxcb-randr.so.0": {"apt": "libxcb-randr0", "dnf": "libxcb", "pacman": "libxcb", "zypper": "libxcb-randr0"},
    "libxcb-xinerama.so.0": {"apt": "libxcb-xinerama0", "dnf": "libxcb", "pacman": "libxcb", "zypper": "libxcb-xinerama0"},
    "libxcb-xkb.so.1": {"apt": "libxcb-xkb1", "dnf": "libxcb", "pacman": "libxcb", "zypper": "libxcb-xkb1"},
    "libxcb-xfixes.so.0": {"apt": "libxcb-xfixes0", "dnf": "libxcb", "pacman": "libxcb", "zypper": "libxcb-xfixes0"},
    "libxcb-sync.so.1": {"apt": "libxcb-sync1", "dnf": "libxcb", "pacman": "libxcb", "zypper": "libxcb-sync1"},
    "libxcb-shm.so.0": {"apt": "libxcb-shm0", "dnf": "libxcb", "pacman": "libxcb", "zypper": "libxcb-shm0"},
    "libxcb-render.so.0": {"apt": "libxcb-render0", "dnf": "libxcb", "pacman": "libxcb", "zypper": "libxcb-render0"},
    "libxcb-glx.so.0": {"apt": "libxcb-glx0", "dnf": "libxcb", "pacman": "libxcb", "zypper": "libxcb-glx0"},
    "libxcb.so.1": {"apt": "libxcb1", "dnf": "libxcb", "pacman": "libxcb", "zypper": "libxcb1"},
    "libX11-xcb.so.1": {"apt": "libx11-xcb1", "dnf": "libX11-xcb", "pacman": "libx11", "zypper": "libX11-xcb1"},
    "libX11.so.6": {"apt": "libx11-6", "dnf": "libX11", "pacman": "libx11", "zypper": "libX11-6"},
    "libSM.so.6": {"apt": "libsm6", "dnf": "libSM", "pacman": "libsm", "zypper": "libSM6"},
    "libICE.so.6": {"apt": "libice6", "dnf": "libICE", "pacman": "libice", "zypper": "libICE6"},
    "libEGL.so.1": {"apt": "libegl1", "dnf": "libglvnd-egl", "pacman": "libglvnd", "zypper": "libEGL1"},
    "libGL.so.1": {"apt": "libgl1", "dnf": "libglvnd-glx", "pacman": "libglvnd", "zypper": "libGL1"},
    "libOpenGL.so.0": {"apt": "libopengl0", "dnf": "libglvnd-opengl", "pacman": "libglvnd", "zypper": "libOpenGL0"},
    "libGLX.so.0": {"apt": "libglx0", "dnf": "libglvnd-glx", "pacman": "libglvnd", "zypper": "libGLX0"},
    "libfontconfig.so.1": {"apt": "libfontconfig1", "dnf": "fontconfig", "pacman": "fontconfig", "zypper": "libfontconfig1"},
    "libfreetype.so.6": {"apt": "libfreetype6", "dnf": "freetype", "pacman": "freetype2", "zypper": "libfreetype6"},
    "libdbus-1.so.3": {"apt": "libdbus-1-3", "dnf": "dbus-libs", "pacman": "dbus", "zypper": "libdbus-1-3"},
    "libglib-2.0.so.0": {"apt": "libglib2.0-0", "dnf": "glib2", "pacman": "glib2", "zypper": "libglib-2_0-0"},
    "libgthread-2.0.so.0": {"apt": "libglib2.0-0", "dnf": "glib2", "pacman": "glib2", "zypper": "libgthread-2_0-0"},
}

INSTALL_COMMANDS = {
    "apt": ["apt-get", "install", "-y"],
    "dnf": ["dnf", "install", "-y"],
    "pacman": ["pacman", "-S", "--needed", "--noconfirm"],
    "zypper": ["zypper", "--non-interactive", "install"],
}
# /etc/os-release ID or ID_LIKE words -> package manager
DISTRO_FAMILIES = {
    "debian": "apt", "ubuntu": "apt", "linuxmint": "apt", "pop": "apt", "elementary": "apt",
    "fedora": "dnf", "rhel": "dnf", "centos": "dnf", "rocky": "dnf", "almalinux": "dnf",
    "arch": "pacman", "manjaro": "pacman", "endeavouros": "pacman",
    "opensuse": "zypper", "suse": "zypper", "opensuse-leap": "zypper", "opensuse-tumbleweed": "zypper",
}


@dataclass(frozen=True)
class QtLibReport:
    missing: tuple[str, ...]  # library file names the linker could not find
    manager: str | None  # apt, dnf, pacman, zypper or None (unknown distribution)
    packages: tuple[str, ...]  # what to install, in the manager's names
    checked: tuple[Path, ...]  # the Qt files that were checked
    problem: str = ""  # why the check could not run (no ldd, plugin not found)
    unmapped: tuple[str, ...] = ()  # missing libraries with no known package (or no known manager)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.problem

    def command(self, as_root: bool) -> list[str]:
        if not self.manager or not self.packages:
            return []
        return ([] if as_root else ["sudo"]) + INSTALL_COMMANDS[self.manager] + list(self.packages)


def package_manager(os_release: str, which: dict[str, bool] | None = None) -> str | None:
    """The package manager, from /etc/os-release's ID and ID_LIKE (then from what is on PATH)."""
    words: list[str] = []
    for line in os_release.splitlines():
        key, _, value = line.partition("=")
        if key in ("ID", "ID_LIKE"):
            words += value.strip().strip('"').lower().split()
    for word in words:
        if word in DISTRO_FAMILIES:
            return DISTRO_FAMILIES[word]
    which = which if which is not None else {
        m: shutil.which(INSTALL_COMMANDS[m][0]) is not None for m in INSTALL_COMMANDS}
    return next((m for m, present in which.items() if present), None)


def missing_from_ldd(output: str) -> list[str]:
    """Library names `ldd` printed as 'not found'."""
    return [m.group(1) for m in re.finditer(r"^\s*(\S+)\s+=>\s+not found", output, re.MULTILINE)]


def report_for(missing: list[str], manager: str | None, checked: tuple[Path, ...] = ()) -> QtLibReport:
    unique = tuple(dict.fromkeys(missing))
    packages: list[str] = []
    unmapped: list[str] = []
    for lib in unique:
        names = PACKAGES.get(lib)
        if names and manager:
            packages.append(names[manager])
        else:
            unmapped.append(lib)
    return QtLibReport(unique, manager, tuple(dict.fromkeys(packages)), checked, unmapped=tuple(unmapped))


def qt_plugin_files(pyside_dir: Path) -> tuple[Path, ...]:
    """The xcb platform plugin and the Qt library it wraps, inside an installed PySide6."""
    candidates = (pyside_dir / "Qt" / "plugins" / "platforms" / "libqxcb.so",
                  pyside_dir / "Qt" / "lib" / "libQt6XcbQpa.so.6")
    return tuple(p for p in candidates if p.is_file())


def check(pyside_dir: Path) -> QtLibReport:
    """Run ldd on the installed plugin; never raises."""
    files = qt_plugin_files(pyside_dir)
    try:
        os_release = Path("/etc/os-release").read_text(errors="replace")
    except OSError:
        os_release = ""
    manager = package_manager(os_release)
    if not files:
        return QtLibReport((), manager, (), (), problem=f"Qt's xcb plugin was not found under {pyside_dir}")
    ldd = shutil.which("ldd")
    if ldd is None:
        return QtLibReport((), manager, (), files, problem="ldd is not installed, so Qt's libraries were not checked")
    missing: list[str] = []
    for file in files:
        env = dict(os.environ, LD_LIBRARY_PATH=str(pyside_dir / "Qt" / "lib"))  # Qt's own libs are found at run time
        done = subprocess.run([ldd, str(file)], capture_output=True, text=True, env=env, check=False)
        missing += missing_from_ldd(done.stdout)
    return report_for(missing, manager, files)
