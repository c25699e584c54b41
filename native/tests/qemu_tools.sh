# Sourced by native/tests/neon_qemu.sh and native_qemu.sh (set TOOL, the script's name, first): the
# Python to use and the cross tools, installed with apt-get when missing and running as root.

# PYTHON: as given, else the repository's .venv, else python3
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=$(command -v python3 || command -v python); fi
fi

skip() { echo "$TOOL: SKIP: $*" >&2; exit 77; }

# a missing tool: installed with apt-get when we are root, else a clear message and exit 77
need() { # need COMMAND DEBIAN_PACKAGE
    command -v "$1" >/dev/null && return 0
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "$TOOL: $1 not found; installing $2 with apt-get" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q "$2" >/dev/null 2>&1 ||
            { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$2" >/dev/null 2>&1; } || true
        command -v "$1" >/dev/null && return 0
        skip "$1 not found, even after trying 'apt-get install $2'"
    fi
    skip "$1 not found (install the Debian package $2: apt-get install $2, as root)"
}
