# Sourced by native/tests/neon_qemu.sh, native_qemu.sh, wine_parity.sh and cross_build_windows.sh (set TOOL, the script's name, first): the
# Python to use, the cross tools (installed with apt-get when missing and running as root), the cache of
# the harnesses' builds and wine's prefix.

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

# bitsplit's cache ($BITSPLIT_CACHE, else $XDG_CACHE_HOME/bitsplit-llama, else ~/.cache/bitsplit-llama), and
# under it the parity harnesses' builds (parity/<key>/) and wine's prefix (parity/wineprefix)
BS_CACHE=${BITSPLIT_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/bitsplit-llama}
PARITY_CACHE=$BS_CACHE/parity

# cached_build KEY OUTPUT NO_CACHE COMMAND...: OUTPUT links to the binary cached as PARITY_CACHE/KEY/<its
# name>; COMMAND, which writes OUTPUT.tmp, builds it where none is cached or NO_CACHE is non-empty (without
# a writable cache, OUTPUT links to the fresh build)
cached_build() {
    local key=$1 out=$2 no_cache=$3
    shift 3
    local bin="$PARITY_CACHE/$key/$(basename "$out")"
    if [[ ! -x "$bin" || -n "$no_cache" ]]; then
        "$@" || return 1
        if mkdir -p "$PARITY_CACHE/$key" 2>/dev/null && cp "$out.tmp" "$bin.$BASHPID" 2>/dev/null; then
            mv -f "$bin.$BASHPID" "$bin"
        else
            bin="$out.tmp"
        fi
    fi
    ln -sf "$bin" "$out"
}

# wine_env: wine's prefix (its C: drive and registry, ~6 s to make) kept beside the cached builds, its
# debug log off (unless WINEPREFIX / WINEDEBUG are set)
wine_env() {
    export WINEPREFIX=${WINEPREFIX:-$PARITY_CACHE/wineprefix} WINEDEBUG=${WINEDEBUG:--all}
    mkdir -p "$WINEPREFIX"
}
