#!/bin/sh
# SpecChat installer for Linux and macOS: no admin rights, everything in your user folders.
#
#   sh install.sh                       install, or upgrade an installed SpecChat in place
#   sh install.sh --wheelhouse DIR      install offline from a folder of wheels
#   sh install.sh --torch cpu           force the CPU build of PyTorch (default: auto-detect)
#   sh install.sh --help                every option
#
# It finds Python 3.10+ and runs the installer proper (specchat_setup, next to this script).
# Set SPECCHAT_PYTHON=/path/to/python3 to choose the Python.
set -eu

HERE=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)

python_ok() {
    "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1
}

find_python() {
    if [ -n "${SPECCHAT_PYTHON:-}" ]; then
        if python_ok "$SPECCHAT_PYTHON"; then echo "$SPECCHAT_PYTHON"; return 0; fi
        echo "error: SPECCHAT_PYTHON=$SPECCHAT_PYTHON is not Python 3.10 or newer." >&2
        return 1
    fi
    # PyTorch publishes wheels for these; the newest well-supported one first
    for candidate in python3.12 python3.11 python3.13 python3.10 python3; do
        if command -v "$candidate" >/dev/null 2>&1 && python_ok "$candidate"; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

if ! PYTHON=$(find_python); then
    echo "SpecChat needs Python 3.10 or newer, and none was found." >&2
    case "$(uname -s)" in
        Darwin)
            echo "Install it from https://www.python.org/downloads/macos/ (or: brew install python@3.12)," >&2 ;;
        *)
            if command -v apt-get >/dev/null 2>&1; then
                echo "Install it with: sudo apt-get install python3 python3-venv" >&2
            elif command -v dnf >/dev/null 2>&1; then
                echo "Install it with: sudo dnf install python3" >&2
            elif command -v pacman >/dev/null 2>&1; then
                echo "Install it with: sudo pacman -S python" >&2
            elif command -v zypper >/dev/null 2>&1; then
                echo "Install it with: sudo zypper install python312" >&2
            else
                echo "Install Python 3.10+ with your package manager," >&2
            fi ;;
    esac
    echo "then run this installer again." >&2
    exit 1
fi

if [ "${1:-}" = "uninstall" ] || [ "${1:-}" = "check" ]; then
    COMMAND=$1
    shift
else
    COMMAND=install
fi
PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m specchat_setup "$COMMAND" "$@"
