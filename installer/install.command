#!/bin/sh
# SpecChat installer for macOS: double-click this file (Finder opens it in Terminal). If macOS
# says it cannot check the file, right-click it and choose Open. Runs install.sh next to it.
cd "$(dirname "$0")" || exit 1
sh ./install.sh "$@"
code=$?
printf '\nPress Enter to close this window. '
read -r _
exit $code
