"""Build an offline installer bundle: the installer scripts plus every wheel SpecChat needs.

    python installer/make_bundle.py --out dist/SpecChat-linux-cpu                # this machine
    python installer/make_bundle.py --out dist/SpecChat-win-cu128 --target windows --torch cu128
    python installer/make_bundle.py --out dist/SpecChat-mac --target macos --python 3.12

The bundle folder holds install.sh, install.ps1, specchat_setup/ and wheels/. On the user's
machine `sh install.sh` (or install.ps1) in that folder installs from wheels/ with no network
access. Wheels for another platform are fetched with pip's --platform and
--python-version (binary wheels only), so a Linux build machine can make the Windows bundle.
`--torch-index pip` takes PyTorch from pip's configured index instead of download.pytorch.org.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from specchat_setup.torch_choice import CUDA_BUILDS, TORCH_INDEX, TORCH_VERSION  # noqa: E402

PLATFORM_TAGS = {  # pip --platform tags per target (x86-64 / Apple silicon)
    "linux": ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64"],
    "windows": ["win_amd64"],
    "macos": ["macosx_14_0_arm64", "macosx_13_0_arm64", "macosx_12_0_arm64", "macosx_11_0_arm64"],
}


def pip(args: list[str]) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    print("+", " ".join(command), flush=True)
    if subprocess.run(command, check=False).returncode != 0:
        raise SystemExit(f"error: pip failed: {' '.join(args[:3])}…; see its output above.")


def target_args(target: str | None, python: str | None) -> list[str]:
    if target is None:
        return []
    args = ["--only-binary=:all:", "--implementation", "cp",
            "--python-version", python or f"{sys.version_info[0]}.{sys.version_info[1]}"]
    for tag in PLATFORM_TAGS[target]:
        args += ["--platform", tag]
    return args


def build(out: Path, source: Path, target: str | None, python: str | None, torch: str, torch_index: str) -> Path:
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip(["wheel", "--no-deps", "--wheel-dir", str(wheels), str(source)])
    index: list[str] = []
    if torch_index != "pip":
        index = ["--index-url", torch_index or TORCH_INDEX + torch]
    pip(["download", "--no-deps", f"torch=={TORCH_VERSION}", "--dest", str(wheels), *index,
         *target_args(target, python)])
    # the rest, resolved against the torch wheel already in the folder
    pip(["download", "--dest", str(wheels), "--find-links", str(wheels), str(next(wheels.glob("specchat-*.whl"))),
         *target_args(target, python)])
    for name in ("install.sh", "install.command", "install.cmd", "install.ps1", "uninstall.sh", "uninstall.ps1"):
        shutil.copy2(HERE / name, out / name)
    if (out / "specchat_setup").exists():
        shutil.rmtree(out / "specchat_setup")
    shutil.copytree(HERE / "specchat_setup", out / "specchat_setup", ignore=shutil.ignore_patterns("__pycache__"))
    (out / "README.txt").write_text(
        "SpecChat offline installer\n\n"
        "Windows:  double-click install.cmd\n"
        "macOS:    double-click install.command (if macOS refuses, right-click it > Open)\n"
        "Linux:    open a terminal here and run: sh install.sh\n\n"
        "Nothing is downloaded. Your models, conversations and settings are kept on upgrade.\n",
        encoding="utf-8")
    size = sum(p.stat().st_size for p in wheels.iterdir())
    print(f"bundle: {out} ({len(list(wheels.iterdir()))} wheels, {size / 1e9:.2f} GB)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the bundle folder to create")
    parser.add_argument("--source", type=Path, default=HERE.parent, help="the SpecChat source folder")
    parser.add_argument("--target", choices=sorted(PLATFORM_TAGS), help="another platform (default: this one)")
    parser.add_argument("--python", help="the Python version the bundle is for, e.g. 3.12 (with --target)")
    parser.add_argument("--torch", default="cpu", choices=["cpu", *(b.tag for b in CUDA_BUILDS)],
                        help="the PyTorch build to ship (default cpu)")
    parser.add_argument("--torch-index", default="", help="a package index URL for PyTorch, or 'pip'")
    args = parser.parse_args(argv)
    if args.target == "macos" and args.torch != "cpu":
        parser.error("macOS has no CUDA build")
    torch_index = args.torch_index
    if args.target == "macos" and not torch_index:
        torch_index = "https://pypi.org/simple"  # PyPI's macOS build is the one with Metal support
    build(args.out.resolve(), args.source.resolve(), args.target, args.python, args.torch, torch_index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
