"""SpecChat's installer and uninstaller: standard library only, run by install.sh (Linux,
macOS) or install.ps1 (Windows) with a system Python 3.10+.

It makes a private virtual environment in the user's data folder (no admin rights), installs
SpecChat there with the PyTorch build that fits the machine, and creates the launchers. The
installed copy of this package (in the runtime folder) is what the uninstaller runs.

Modules: locations (where everything goes), torch_choice (which PyTorch build and why),
qt_libs (the system libraries Qt's xcb plugin needs on Linux), launchers (.desktop entry,
macOS .app bundle, Windows shortcuts), environment (venv, pip, running-app check), cli (the
install and uninstall flows).
"""

VERSION_REQUIRED = (3, 10)
