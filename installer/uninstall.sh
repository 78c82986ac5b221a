#!/bin/sh
# Removes SpecChat for this user. It asks before deleting models and conversations
# (--remove-models, --remove-conversations, --keep-data and --yes answer without asking).
set -eu
HERE=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)
PYTHON="@SYSTEM_PYTHON@"  # the Python that installed SpecChat
if [ ! -x "$PYTHON" ] || case "$PYTHON" in @*) true ;; *) false ;; esac; then
    PYTHON=$(command -v python3 || true)
fi
if [ -z "$PYTHON" ]; then
    echo "error: no Python 3 found to run the uninstaller; delete $HERE and the SpecChat launchers by hand." >&2
    exit 1
fi
cd "$HOME"
PYTHONPATH="$HERE" exec "$PYTHON" -m specchat_setup uninstall "$@"
