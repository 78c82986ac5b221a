"""`python -m specchat_setup install|uninstall|check`: the flows install.sh and install.ps1 run.

    install    [--source DIR | --wheelhouse DIR] [--torch auto|cpu|cuda|cu128…] [--torch-index URL|pip]
               [--no-desktop-icon] [--install-system-deps] [--yes]
    uninstall  [--remove-models] [--remove-conversations] [--keep-data] [--yes]
    check      what install would choose here, and whether Qt's system libraries are present

Re-running install upgrades in place: the environment is reused, SpecChat and anything whose
pin changed are replaced, launchers are rewritten, and the data folder (models, conversations,
hardware profile) and settings are never touched. Exit codes: 0 done, 1 failed (the message
says why and what to do), 2 bad usage, 130 cancelled.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from . import environment, launchers, qt_libs, torch_choice
from .environment import SetupError
from .locations import DISPLAY_NAME, Layout, chosen_models_folder, settings_files

PACKAGE_DIR = Path(__file__).resolve().parent
SPACE_CPU = 3_000_000_000  # venv with the CPU build of PyTorch and PySide6, plus pip's cache
SPACE_CUDA = 9_000_000_000  # a CUDA build of PyTorch brings ~5 GB of NVIDIA libraries
MANIFEST_VERSION = 1


def say(text: str = "") -> None:
    print(text, flush=True)


def ask(question: str, default: bool) -> bool:
    """A yes/no question on the terminal; the default when there is no terminal."""
    if not sys.stdin or not sys.stdin.isatty():
        return default
    suffix = " [Y/n] " if default else " [y/N] "
    try:
        answer = input(question + suffix).strip().lower()
    except EOFError:
        return default
    return default if not answer else answer.startswith("y")


def size_text(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"


# ---- what to install --------------------------------------------------------------------

def source_version(source: Path) -> str:
    text = (source / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if not match:
        raise SetupError(f"{source / 'pyproject.toml'} has no version; is this a SpecChat source folder?")
    return match.group(1)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version))


def wheel_in(wheelhouse: Path, name: str) -> Path | None:
    """The newest wheel of `name` in the folder (None when there is none)."""
    wheels = sorted(wheelhouse.glob(f"{name}-*.whl"), key=lambda p: _version_key(p.name.split("-")[1]))
    return wheels[-1] if wheels else None


def resolve_package(args: argparse.Namespace) -> tuple[str, str]:
    """(pip requirement for SpecChat, its version)."""
    if args.wheelhouse:
        wheelhouse = Path(args.wheelhouse).expanduser().resolve()
        if not wheelhouse.is_dir():
            raise SetupError(f"--wheelhouse {wheelhouse}: no such folder.")
        wheel = wheel_in(wheelhouse, "specchat")
        if wheel is not None:
            return str(wheel), wheel.name.split("-")[1]
        if not args.source:
            raise SetupError(f"{wheelhouse} has no specchat-*.whl. Build the bundle with "
                             "installer/make_bundle.py, or pass --source with the SpecChat folder.")
    source = Path(args.source).expanduser().resolve() if args.source else PACKAGE_DIR.parents[1]
    if not (source / "pyproject.toml").is_file():
        raise SetupError(f"{source} is not a SpecChat source folder (no pyproject.toml). Run the "
                         "installer from the unpacked SpecChat download, or pass --source or --wheelhouse.")
    return str(source), source_version(source)


def choose_torch(args: argparse.Namespace, layout: Layout) -> torch_choice.TorchChoice:
    if args.wheelhouse:
        wheel = wheel_in(Path(args.wheelhouse).expanduser(), "torch")
        if wheel is None:
            raise SetupError(f"{args.wheelhouse} has no torch-*.whl; a wheelhouse must carry PyTorch.")
        variant = torch_choice.installed_variant(wheel.name.split("-")[1])
        return torch_choice.TorchChoice(variant, None, f"{variant} build from the wheelhouse ({wheel.name})")
    report = torch_choice.detect(layout.platform)
    try:
        choice = torch_choice.choose(layout.platform, report, args.torch)
    except ValueError as exc:
        raise SetupError(str(exc)) from exc
    if args.torch_index == "pip":
        return torch_choice.TorchChoice(choice.variant, None, choice.reason + " (from pip's configured index)")
    if args.torch_index:
        return torch_choice.TorchChoice(choice.variant, args.torch_index, choice.reason + f" (from {args.torch_index})")
    return choice


def pip_source_args(args: argparse.Namespace) -> list[str]:
    if args.wheelhouse:
        return ["--no-index", "--find-links", str(Path(args.wheelhouse).expanduser().resolve())]
    return []


# ---- install ----------------------------------------------------------------------------

def read_manifest(layout: Layout) -> dict[str, object]:
    try:
        data = json.loads(layout.manifest.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_uninstaller(layout: Layout) -> None:
    """Copy this package into the runtime folder and write the uninstall script next to it."""
    target = layout.runtime / "specchat_setup"
    if PACKAGE_DIR != target.resolve():
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(PACKAGE_DIR, target, ignore=shutil.ignore_patterns("__pycache__"))
    here = Path(__file__).resolve().parents[1]
    template = "uninstall.ps1" if layout.platform == "windows" else "uninstall.sh"
    source = here / template
    if not source.is_file():  # running from an installed copy: the script is already there
        return
    text = source.read_text(encoding="utf-8").replace("@SYSTEM_PYTHON@", sys.executable)
    layout.uninstaller.write_text(text, encoding="utf-8")
    layout.uninstaller.chmod(0o755)


def copy_icons(layout: Layout, resources: Path) -> None:
    icons = resources / "icons"
    if not icons.is_dir():
        raise SetupError(f"The installed package has no icons ({icons}); the download is incomplete.")
    if layout.icons.exists():
        shutil.rmtree(layout.icons)
    shutil.copytree(icons, layout.icons)


def check_qt_libraries(layout: Layout, pyside_dir: Path, args: argparse.Namespace) -> list[str]:
    """Linux: report (or, with consent, install) the system libraries Qt's xcb plugin needs.
    Returns warnings for the summary."""
    report = qt_libs.check(pyside_dir)
    if report.problem:
        return [report.problem]
    if report.ok:
        say("Qt's system libraries: all present.")
        return []
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    command = report.command(as_root)
    say(f"\nQt needs system libraries this computer lacks: {', '.join(report.missing)}.")
    say("Without them SpecChat cannot open its window on X11 "
        "(\"could not load the Qt platform plugin xcb\").")
    warnings: list[str] = []
    if report.unmapped:
        warnings.append(f"install the packages that provide {', '.join(report.unmapped)} with your "
                        "package manager")
    if not command:
        return warnings
    shown = " ".join(command)
    say(f"They are installed by:\n    {shown}")
    if args.install_system_deps or (not args.yes and ask("Run that command now?", False)):
        done = subprocess.run(command, check=False)
        after = qt_libs.check(pyside_dir)
        if done.returncode == 0 and not set(after.missing) - set(report.unmapped):
            say("Qt's system libraries: installed.")
            return warnings
        return warnings + [f"installing Qt's system libraries failed; run: {shown}"]
    return warnings + [f"before the first start, run: {shown}"]


VERIFY_CODE = """
import json, os, importlib.metadata as m
import torch, PySide6, specchat_resources
cuda = torch.cuda.is_available()
print(json.dumps({
    "specchat": m.version("specchat"), "torch": torch.__version__, "cuda": cuda,
    "gpu": torch.cuda.get_device_name(0) if cuda else "",
    "pyside_dir": os.path.dirname(PySide6.__file__),
    "resources": os.path.dirname(specchat_resources.__file__),
}))
"""


def install(args: argparse.Namespace) -> int:
    layout = Layout.current()
    environment.check_python()
    bundled = PACKAGE_DIR.parent / "wheels"  # an offline bundle (make_bundle.py) installs from its wheels
    if not args.wheelhouse and not args.source and bundled.is_dir():
        args.wheelhouse = str(bundled)
    requirement, version = resolve_package(args)
    if environment.app_running(layout):
        raise SetupError("SpecChat is running (its window was raised). Close it, then run the installer again.")
    previous = environment.installed_versions(layout)
    old = previous.get("specchat")
    say(f"{'Upgrading' if old else 'Installing'} {DISPLAY_NAME} {version}"
        + (f" (installed: {old})" if old else "") + f" into {layout.runtime}")
    say(f"Your models, conversations and settings stay where they are ({layout.data}).")
    choice = choose_torch(args, layout)
    say(f"PyTorch {torch_choice.TORCH_VERSION}: {choice.reason}.")
    if not old:
        environment.check_space(layout.runtime, SPACE_CUDA if choice.is_cuda else SPACE_CPU, "Installing SpecChat")
    layout.runtime.mkdir(parents=True, exist_ok=True)
    if environment.create_venv(layout):
        say(f"Created a private Python environment ({sys.version.split()[0]}) in {layout.venv}.")
    source_args = pip_source_args(args)
    torch_args = ["install", choice.requirement, *source_args]
    if choice.index_url and not args.wheelhouse:
        torch_args += ["--index-url", choice.index_url]
    have = previous.get("torch", "")
    if have.split("+")[0] == torch_choice.TORCH_VERSION and torch_choice.installed_variant(have) != choice.variant \
            and choice.variant != "default":
        torch_args += ["--force-reinstall"]  # same version, other build (cpu -> cu128)
        say(f"Switching PyTorch from the {torch_choice.installed_variant(have)} build to {choice.variant}.")
    offline_hint = ("Check the internet connection, or install from a folder of wheels with "
                    "--wheelhouse DIR (see installer/make_bundle.py).")
    environment.pip(layout, torch_args, f"Installing PyTorch ({choice.variant} build)", offline_hint)
    environment.pip(layout, ["install", requirement, *source_args], "Installing SpecChat and its libraries", offline_hint)
    environment.pip(layout, ["install", "--force-reinstall", "--no-deps", requirement, *source_args],
                    f"Installing SpecChat {version}", offline_hint)
    state = environment.query(layout, VERIFY_CODE)
    warnings: list[str] = []
    if choice.is_cuda and not state["cuda"]:
        warnings.append("PyTorch's CUDA build is installed but does not see the GPU; update the NVIDIA "
                        "driver, reboot, and run the installer again")
    copy_icons(layout, Path(str(state["resources"])))
    if layout.platform == "linux":
        warnings += check_qt_libraries(layout, Path(str(state["pyside_dir"])), args)
    write_uninstaller(layout)
    made = launchers.Launchers(())
    if not args.no_launchers:
        made = launchers.make(layout, version, desktop_shortcut=not args.no_desktop_icon)
        warnings += list(made.notes)
        for stale in read_manifest(layout).get("launchers", []):  # type: ignore[union-attr]
            path = Path(str(stale))
            if path not in made.files and (path.is_file() or path.is_symlink()):
                path.unlink()
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "version": version,
        "installed_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "system_python": sys.executable,
        "torch": {"version": state["torch"], "variant": choice.variant, "reason": choice.reason},
        "gpu": state["gpu"],
        "launchers": [str(p) for p in made.files],
        "registry": list(made.registry),
        "data": str(layout.data),
        "cache": str(layout.cache),
    }
    layout.manifest.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    say(f"\n{DISPLAY_NAME} {state['specchat']} is installed, with PyTorch {state['torch']}"
        + (f" on {state['gpu']}." if state["gpu"] else "."))
    start = {"linux": "from your applications menu", "macos": "from ~/Applications (SpecChat.app)",
             "windows": "from the Start menu"}[layout.platform]
    if not args.no_launchers:
        say(f"Start it {start}, or run: {layout.gui_program}")
    say(f"Uninstall: {layout.uninstaller}")
    for warning in warnings:
        say(f"Note: {warning}.")
    return 0


# ---- uninstall --------------------------------------------------------------------------

def uninstall(args: argparse.Namespace) -> int:
    layout = Layout.current()
    manifest = read_manifest(layout)
    if not layout.runtime.exists() and not manifest:
        say(f"{DISPLAY_NAME} is not installed for this user (nothing at {layout.runtime}).")
        return 0
    if environment.app_running(layout):
        raise SetupError("SpecChat is running (its window was raised). Close it, then run the uninstaller again.")
    app_bytes = environment.folder_bytes(layout.runtime)
    cache_bytes = environment.folder_bytes(layout.cache) if layout.cache.exists() else 0
    say(f"This removes {DISPLAY_NAME} ({size_text(app_bytes)} in {layout.runtime}), its launchers"
        + (f" and its rebuildable cache ({size_text(cache_bytes)} in {layout.cache})" if cache_bytes else "") + ".")
    if not args.yes and not ask("Uninstall SpecChat?", True):
        say("Nothing was removed.")
        return 0
    models = layout.models
    model_bytes = environment.folder_bytes(models) if models.exists() else 0
    chosen = chosen_models_folder(layout.platform)  # read before the settings may be deleted
    remove_models = args.remove_models
    remove_chats = args.remove_conversations
    if not args.keep_data and not args.yes:
        if model_bytes and not remove_models:
            remove_models = ask(f"Also delete your downloaded models ({size_text(model_bytes)} in {models})?", False)
        if not remove_chats:
            remove_chats = ask("Also delete your conversations and settings?", False)
    if args.keep_data:
        remove_models = remove_chats = False

    for item in manifest.get("launchers", []):  # type: ignore[union-attr]
        path = Path(str(item))
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists() or path.is_symlink():
            path.unlink()
    if manifest.get("registry") and layout.platform == "windows":
        launchers.remove_registry(list(manifest["registry"]))  # type: ignore[arg-type]
    shutil.rmtree(layout.cache, ignore_errors=True)
    shutil.rmtree(layout.runtime, ignore_errors=True)
    kept: list[str] = []
    if remove_models:
        shutil.rmtree(models, ignore_errors=True)
    elif models.exists():
        kept.append(f"your models ({size_text(model_bytes)} in {models})")
    if remove_chats:
        for path in layout.data.iterdir() if layout.data.exists() else []:
            if path == models:
                continue
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
        for path in settings_files(layout.platform):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        if layout.platform == "windows":
            launchers.remove_settings_registry()
    elif layout.data.exists() and any(p != models for p in layout.data.iterdir()):
        kept.append(f"your conversations and settings (in {layout.data})")
    if layout.data.exists() and not any(layout.data.iterdir()):
        layout.data.rmdir()
    if chosen is not None and chosen != models and chosen.exists():
        kept.append(f"the models in the folder you chose ({chosen}; the uninstaller never deletes it)")
    say(f"{DISPLAY_NAME} was removed.")
    if kept:
        say("Kept " + " and ".join(kept) + ". Installing SpecChat again picks them up; "
            "delete the folders yourself to free the space.")
    return 0


# ---- check ------------------------------------------------------------------------------

def check(args: argparse.Namespace) -> int:
    layout = Layout.current()
    say(f"Python: {sys.version.split()[0]} ({sys.executable})")
    say(f"Install folder: {layout.runtime}")
    say(f"Data folder: {layout.data}")
    report = torch_choice.detect(layout.platform)
    for gpu in report.gpus:
        say(f"GPU: {gpu.name}, {gpu.memory_mib} MiB, compute {gpu.compute}, driver {report.driver}, CUDA {report.cuda}")
    choice = choose_torch(args, layout)
    say(f"PyTorch {torch_choice.TORCH_VERSION}: {choice.reason}; index {choice.index_url or 'pip default'}")
    installed = environment.installed_versions(layout)
    say("Installed: " + (", ".join(f"{k} {v}" for k, v in installed.items()) or "nothing"))
    if installed and layout.platform == "linux":
        state = environment.query(layout, VERIFY_CODE)
        report_qt = qt_libs.check(Path(str(state["pyside_dir"])))
        say("Qt system libraries: " + (report_qt.problem or ("all present" if report_qt.ok else
            "missing " + ", ".join(report_qt.missing) + "; run: " + " ".join(report_qt.command(False)))))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specchat-setup", description="Install or remove SpecChat for this user.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, handler, text in (("install", install, "install or upgrade SpecChat"),
                                ("check", check, "show what install would choose")):
        p = sub.add_parser(name, help=text)
        p.set_defaults(handler=handler)
        p.add_argument("--source", help="the SpecChat source folder (default: the one holding this installer)")
        p.add_argument("--wheelhouse", help="install offline from this folder of wheels (specchat, torch and the rest)")
        p.add_argument("--torch", default="auto",
                       help="PyTorch build: auto (default), cpu, cuda, or a CUDA tag: "
                            + ", ".join(b.tag for b in torch_choice.CUDA_BUILDS))
        p.add_argument("--torch-index", default="",
                       help="where PyTorch comes from: a package index URL, or 'pip' for pip's own settings")
        p.add_argument("--no-desktop-icon", action="store_true", help="no shortcut on the desktop")
        p.add_argument("--no-launchers", action="store_true", help="no menu entry, shortcut or app bundle")
        p.add_argument("--install-system-deps", action="store_true",
                       help="Linux: install missing Qt system libraries with the package manager (sudo)")
        p.add_argument("--yes", "-y", action="store_true", help="ask nothing; take the defaults")
    p = sub.add_parser("uninstall", help="remove SpecChat")
    p.set_defaults(handler=uninstall)
    p.add_argument("--remove-models", action="store_true", help="also delete downloaded models")
    p.add_argument("--remove-conversations", action="store_true", help="also delete conversations and settings")
    p.add_argument("--keep-data", action="store_true", help="keep models, conversations and settings (no questions)")
    p.add_argument("--yes", "-y", action="store_true", help="ask nothing; keep data unless told to remove it")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except SetupError as exc:
        print(f"\nerror: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nCancelled. Run the installer again to finish; nothing you had was lost.", file=sys.stderr)
        return 130
