"""Pure decisions of the installer: which PyTorch build, which Qt packages, where files go."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from installer_env import REPO
from specchat_setup import locations, qt_libs, torch_choice
from specchat_setup.torch_choice import GpuReport, choose, parse_nvidia_smi

RTX_4090 = "NVIDIA GeForce RTX 4090, 24564, 8.9, 575.64.03\n"
BANNER_128 = "| NVIDIA-SMI 570.133.07   Driver Version: 570.133.07   CUDA Version: 12.8     |\n"
BANNER_130 = "| NVIDIA-SMI 580.82.07    Driver Version: 580.82.07    CUDA Version: 13.0     |\n"


def test_newest_cuda_build_the_driver_supports() -> None:
    report = parse_nvidia_smi(RTX_4090, BANNER_128)
    assert report.cuda == (12, 8) and report.gpus[0].compute == (8, 9) and report.driver == "575.64.03"
    choice = choose("linux", report)
    assert choice.variant == "cu128"
    assert choice.index_url == "https://download.pytorch.org/whl/cu128"
    assert "RTX 4090" in choice.reason and "12.8" in choice.reason
    assert choose("windows", parse_nvidia_smi(RTX_4090, BANNER_130)).variant == "cu130"


def test_old_gpu_skips_the_build_that_dropped_it() -> None:
    pascal = "NVIDIA GeForce GTX 1080 Ti, 11264, 6.1, 580.82.07\n"
    assert choose("linux", parse_nvidia_smi(pascal, BANNER_130)).variant == "cu128"


def test_old_driver_gets_the_cpu_build_and_is_told_to_update() -> None:
    banner = "| NVIDIA-SMI 535.104.05   Driver Version: 535.104.05   CUDA Version: 12.2     |\n"
    choice = choose("linux", parse_nvidia_smi("NVIDIA GeForce RTX 3060, 12288, 8.6, 535.104.05\n", banner))
    assert choice.variant == "cpu" and choice.index_url == "https://download.pytorch.org/whl/cpu"
    assert "Update the NVIDIA driver" in choice.reason and "12.2" in choice.reason


def test_driver_version_alone_gives_the_cuda_version() -> None:
    proc = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.133.07  Fri Mar 14 2025\n"
    assert parse_nvidia_smi("", "", proc).cuda == (12, 8)
    assert parse_nvidia_smi("NVIDIA RTX A4000, 16376, 8.6, 560.35.03\n").cuda == (12, 6)


def test_no_gpu_and_explicit_choices() -> None:
    none = GpuReport(problem="no NVIDIA driver found")
    cpu = choose("linux", none)
    assert cpu.variant == "cpu" and "no NVIDIA driver found" in cpu.reason
    assert choose("windows", none).index_url is None  # PyPI's Windows build is the CPU build
    assert choose("macos", none).variant == "default"
    assert choose("macos", parse_nvidia_smi(RTX_4090, BANNER_128)).variant == "default"
    assert choose("linux", none, "cu126").index_url.endswith("/cu126")  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="NVIDIA driver"):
        choose("linux", none, "cuda")
    with pytest.raises(ValueError, match="use auto, cpu, cuda"):
        choose("linux", none, "rocm")


def test_installed_build_is_read_from_the_version() -> None:
    assert torch_choice.installed_variant("2.13.0+cu128") == "cu128"
    assert torch_choice.installed_variant("2.13.0+cpu") == "cpu"
    assert torch_choice.installed_variant("2.13.0") == "default"


def test_installer_pins_the_same_torch_as_the_package() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"torch=={torch_choice.TORCH_VERSION}"' in pyproject


LDD = """\
\tlinux-vdso.so.1 (0x00007ffd)
\tlibQt6XcbQpa.so.6 => /x/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f)
\tlibxcb-cursor.so.0 => not found
\tlibxkbcommon-x11.so.0 => not found
\tlibxcb-icccm.so.4 => not found
\tlibxcb.so.1 => /lib/x86_64-linux-gnu/libxcb.so.1 (0x00007f)
"""


def test_missing_qt_libraries_become_the_package_command() -> None:
    missing = qt_libs.missing_from_ldd(LDD)
    assert missing == ["libxcb-cursor.so.0", "libxkbcommon-x11.so.0", "libxcb-icccm.so.4"]
    ubuntu = 'NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\n'
    manager = qt_libs.package_manager(ubuntu)
    report = qt_libs.report_for(missing + missing, manager)
    assert report.command(as_root=False) == [
        "sudo", "apt-get", "install", "-y", "libxcb-cursor0", "libxkbcommon-x11-0", "libxcb-icccm4"]
    assert report.command(as_root=True)[0] == "apt-get"
    fedora = qt_libs.report_for(missing, qt_libs.package_manager("ID=fedora\n"))
    assert fedora.command(True) == ["dnf", "install", "-y", "xcb-util-cursor", "libxkbcommon-x11", "xcb-util-wm"]
    arch = qt_libs.report_for(missing, qt_libs.package_manager('ID="endeavouros"\nID_LIKE="arch"\n'))
    assert arch.command(True)[:4] == ["pacman", "-S", "--needed", "--noconfirm"]
    unknown = qt_libs.report_for(missing, qt_libs.package_manager("ID=nixos\n", which={}))
    assert unknown.manager is None and unknown.command(True) == []
    assert unknown.unmapped == tuple(missing) and unknown.packages == ()
    odd = qt_libs.report_for(["libxcb-cursor.so.0", "libfuture-qt-dep.so.3"], "apt")
    assert odd.command(True) == ["apt-get", "install", "-y", "libxcb-cursor0"]
    assert odd.unmapped == ("libfuture-qt-dep.so.3",)


def test_every_library_qt_names_has_a_package_for_each_manager() -> None:
    for lib, names in qt_libs.PACKAGES.items():
        assert set(names) == set(qt_libs.INSTALL_COMMANDS), lib


def test_the_real_plugin_is_checked(tmp_path: Path) -> None:
    """ldd on the PySide6 this suite runs with: the check finds the plugin and runs."""
    import PySide6

    report = qt_libs.check(Path(PySide6.__file__).parent)
    assert report.checked and not report.problem
    assert all(re.match(r"lib.+\.so", lib) for lib in report.missing)


def test_folders_match_the_app(home: Path) -> None:
    from engine import paths

    assert locations.data_dir() == paths.data_dir()
    assert locations.cache_dir() == paths.cache_dir()
    layout = locations.Layout.current()
    assert layout.data == home / ".local" / "share" / "specchat"
    assert layout.venv == layout.data / "runtime" / "venv"
    assert layout.models == paths.models_dir()


def test_windows_and_macos_folders(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALAPPDATA", r"C:\Users\ann\AppData\Local")
    windows = locations.Layout("windows", locations.data_dir("windows"), locations.cache_dir("windows"))
    assert str(windows.data).endswith("specchat") and "AppData" in str(windows.data)
    assert windows.gui_program.name == "specchat-gui.exe" and windows.venv_bin.name == "Scripts"
    assert windows.uninstaller.name == "uninstall.ps1"
    assert locations.data_dir("macos") == home / "Library" / "Application Support" / "specchat"


def fake_plugin(tmp_path: Path) -> Path:
    """A PySide6 folder whose xcb plugin is a real shared object linked against a library that
    no longer exists (built with the C compiler, then the library deleted)."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler to build a plugin with a missing dependency")
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "dep.c").write_text("int specchat_dep(void) { return 1; }\n")
    (stub / "plugin.c").write_text("int specchat_dep(void);\nint plugin(void) { return specchat_dep(); }\n")
    missing = "libspecchat-test-missing.so.0"
    subprocess.run([gcc, "-shared", "-fPIC", f"-Wl,-soname,{missing}", "-o", str(stub / missing), str(stub / "dep.c")],
                   check=True)
    pyside = tmp_path / "PySide6"
    plugin = pyside / "Qt" / "plugins" / "platforms" / "libqxcb.so"
    plugin.parent.mkdir(parents=True)
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(plugin), str(stub / "plugin.c"), str(stub / missing)],
                   check=True)
    (stub / missing).unlink()
    return pyside


def test_a_plugin_with_a_missing_library_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specchat_setup import cli

    pyside = fake_plugin(tmp_path)
    report = qt_libs.check(pyside)
    assert report.missing == ("libspecchat-test-missing.so.0",) and not report.ok
    assert report.unmapped == report.missing
    args = cli.build_parser().parse_args(["install", "--yes"])
    layout = locations.Layout("linux", tmp_path / "data", tmp_path / "cache")
    warnings = cli.check_qt_libraries(layout, pyside, args)
    shown = capsys.readouterr().out
    assert "Qt needs system libraries this computer lacks: libspecchat-test-missing.so.0" in shown
    assert "could not load the Qt platform plugin xcb" in shown
    assert warnings == ["install the packages that provide libspecchat-test-missing.so.0 with your package manager"]
