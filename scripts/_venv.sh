# Sourced by scripts/test and scripts/demo: make sure .venv exists and matches the project files.
# The venv is rebuilt when pyproject.toml changes, and the package is re-linked when a module is
# added or removed (the strict editable install that mypy needs does not see new files by itself).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
extras="${VQPOOL_EXTRAS:-test}"

pick_python() {
    for candidate in "${PYTHON:-}" python3.13 python3.12 python3.11 python3; do
        [ -n "$candidate" ] || continue
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "vqpool needs Python 3.11 or newer on PATH (or set PYTHON=/path/to/python3.11)" >&2
    return 1
}

deps_stamp="$( (cat "$root/pyproject.toml"; echo "$extras") | cksum | cut -d' ' -f1)"
files_stamp="$(cd "$root" && find shared daemon worker -name '*.py' | sort | cksum | cut -d' ' -f1)"

if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.deps-stamp" 2>/dev/null)" != "$deps_stamp" ]; then
    python="$(pick_python)"
    echo "setting up $venv (one time, about a minute)" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip "setuptools>=77" wheel
    "$venv/bin/python" -m pip install --quiet --no-build-isolation \
        --config-settings editable_mode=strict -e "$root[$extras]"
    echo "$deps_stamp" > "$venv/.deps-stamp"
    echo "$files_stamp" > "$venv/.files-stamp"
elif [ "$(cat "$venv/.files-stamp" 2>/dev/null)" != "$files_stamp" ]; then
    "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation \
        --config-settings editable_mode=strict -e "$root"
    echo "$files_stamp" > "$venv/.files-stamp"
fi
export PATH="$venv/bin:$PATH"
