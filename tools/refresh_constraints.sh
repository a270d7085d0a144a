#!/usr/bin/env bash
# Rewrite constraints.txt from a fresh resolution: a new venv, the README's install without the
# constraints, and pip freeze of the result (the project itself left out). Review the diff, run the
# tests, and commit it with the README's figures measured again (a new stack can move them).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q torch==2.13.0
"$work/venv/bin/pip" install -q -e ".[dev,launch]"
{
    echo "# Every package the README's commands install (pip install torch==2.13.0, then -e \".[dev,launch]\"), at the"
    echo "# versions a fresh install resolved on $(date +%F) (Python $("$work/venv/bin/python" -c 'import platform; print(platform.python_version())'), $(uname -m)). pip install -c constraints.txt holds a"
    echo "# fresh machine to them. Refresh: tools/refresh_constraints.sh (README, \"Tests\")."
    # the local label of the CPU build (+cpu) would refuse any other build of the same release
    "$work/venv/bin/pip" freeze --exclude-editable | sed -E 's/^(torch==[0-9.]+)\+[a-z0-9]+$/\1/'
} > constraints.txt
echo "constraints.txt: $(grep -c '==' constraints.txt) packages"
