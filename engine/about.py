"""Which SpecChat this is: its version and the PyTorch build it runs on, read from package
metadata (no torch import), for `specchat --version` and the app's settings."""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from engine import paths


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


@dataclass(frozen=True)
class Installation:
    version: str
    torch: str  # e.g. 2.13.0+cu128
    python: str
    prefix: Path  # the Python environment SpecChat runs in (the installer's private venv)
    data: Path

    @property
    def torch_build(self) -> str:
        """'CPU build', 'CUDA 12.8 build' or 'PyPI build', from the version's local label."""
        label = self.torch.partition("+")[2]
        if label == "cpu":
            return "CPU build"
        if label.startswith("cu") and label[2:].isdigit() and len(label) >= 4:
            return f"CUDA {label[2:-1]}.{label[-1]} build"
        return "PyPI build"

    def summary(self) -> str:
        return f"SpecChat {self.version} · PyTorch {self.torch} ({self.torch_build}) · Python {self.python}"


def installation() -> Installation:
    return Installation(_version("specchat"), _version("torch"), platform.python_version(),
                        Path(sys.prefix), paths.data_dir())
