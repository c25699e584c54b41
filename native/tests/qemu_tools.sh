# Sourced by native/tests/neon_qemu.sh, native_qemu.sh, wine_parity.sh and cross_build_windows.sh (set TOOL, the script's name, first): the
# Python to use and the cross tools, installed with apt-get when missing and running as root.

# PYTHON: as given, else the repository's .venv, else python3
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=$(command -v python3 || command -v python); fi
fi

skip() { echo "$TOOL: SKIP: $*" >&2; exit 77; }

# a missing tool: installed with apt-get when we are root, else a clear message and exit 77
need() { # need COMMAND DEBIAN_PACKAGE [APT_OPTION...]
    command -v "$1" >/dev/null && return 0
    local cmd=$1 pkg=$2
    shift 2
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "$TOOL: $cmd not found; installing $pkg with apt-get" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q "$@" "$pkg" >/dev/null 2>&1 ||
            { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$@" "$pkg" >/dev/null 2>&1; } || true
        command -v "$cmd" >/dev/null && return 0
        skip "$cmd not found, even after trying 'apt-get install $pkg'"
    fi
    skip "$cmd not found (install the Debian package $pkg: apt-get install $pkg, as root)"
}
