#!/usr/bin/env bash
# native/tests/cross_build.sh --target windows (see there): the native library built for x86-64
# Windows with MinGW-w64 gcc, as bitsplit_llama.native.build builds it there, checked, and loaded
# under wine. Exit status: 0 PASS, 1 FAIL, 77 the cross compiler is missing and cannot be installed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TOOL=cross_build
# shellcheck source=native/tests/qemu_tools.sh
. "$ROOT/native/tests/qemu_tools.sh" # PYTHON, skip, need
WIN_CC=${WIN_CC:-x86_64-w64-mingw32-gcc}
PREFIX=${WIN_CC%gcc}                       # x86_64-w64-mingw32-
need "$WIN_CC" gcc-mingw-w64-x86-64 --no-install-recommends
NM=${PREFIX}nm OBJDUMP=${PREFIX}objdump
INC=$("$PYTHON" -c 'from bitsplit_llama.native.build import _llama_paths; print(_llama_paths()[0])') ||
    { echo "cross_build: ggml headers of llama-cpp-python not found (is bitsplit-llama installed for $PYTHON?)" >&2; exit 1; }
OUT=$(mktemp -d "${TMPDIR:-/tmp}/bitsplit-cross-win.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
cd "$ROOT"
mkdir -p "$OUT/obj" "$OUT/ggml"

# 1. every source the library's Windows build compiles, with its flags (build.cflags(windows=True)), -Werror
read -r -a FLAGS <<<"$("$PYTHON" -c 'from bitsplit_llama.native import build; print(" ".join(build.cflags(windows=True)))')"
SRCS=(native/*.c native/arch/x86/*.c)
printf '%s\n' "${SRCS[@]}" | xargs -P "$(nproc)" -I{} sh -c \
    'out=$1 src=$2 cc=$3; shift 3; o="$out/obj/$(echo "$src" | tr / _).o"
     "$cc" "$@" -c "$src" -o "$o" 2>"$o.err" || { cat "$o.err" >&2; exit 255; }' \
    _ "$OUT" {} "$WIN_CC" "${FLAGS[@]}" -Werror -Inative -Inative/arch/x86 -I"$INC" ||
    { echo "cross_build: FAIL: native/ does not compile for Windows with $WIN_CC ${FLAGS[*]} -Werror" >&2; exit 1; }
OBJS=("$OUT"/obj/*.o)

# 2. a stand-in ggml-base.dll exporting the ggml functions the objects import (each ends the process
# if called: nothing model-free may reach ggml), built like the real one would be linked to
"$NM" -u "${OBJS[@]}" | awk '$1 == "U" && $2 ~ /^(ggml|gguf)_/ { print $2 }' | sort -u >"$OUT/ggml/imports.txt"
[[ -s "$OUT/ggml/imports.txt" ]] || { echo "cross_build: FAIL: the objects import no ggml function (unexpected)" >&2; exit 1; }
{
    echo '#include <stdio.h>'
    echo '#include <stdlib.h>'
    while read -r f; do
        echo "void $f(void) { fputs(\"stand-in ggml-base.dll: $f called\\n\", stderr); exit(3); }"
    done <"$OUT/ggml/imports.txt"
} >"$OUT/ggml/stub.c"
"$WIN_CC" -shared -O1 "$OUT/ggml/stub.c" -o "$OUT/ggml/ggml-base.dll" -static-libgcc

# 3. the link, by the very command build.py runs on Windows (link_command, export_def)
"$PYTHON" - "$OUT" "$WIN_CC" "${OBJS[@]}" >"$OUT/link.txt" <<'PY'
import sys
from pathlib import Path
from bitsplit_llama.native import build
out, cc, objs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
d = out / "bitsplit.def"
d.write_text(build.export_def(build.source_dir() / "bitsplit.h"))
cmd = build.link_command(cc, objs, out / "bitsplit.dll", out / "ggml", out / "ggml" / "ggml-base.dll", d, windows=True)
print("\0".join(cmd), end="")
PY
mapfile -d '' LINK <"$OUT/link.txt"
"${LINK[@]}" || { echo "cross_build: FAIL: linking bitsplit.dll: ${LINK[*]}" >&2; exit 1; }
DLL="$OUT/bitsplit.dll"

# 4. what it is, exports, imports
if command -v file >/dev/null; then
    file "$DLL" | grep -q "PE32+ executable (DLL).*x86-64" || { echo "cross_build: FAIL: $(file "$DLL")" >&2; exit 1; }
fi
"$OBJDUMP" -p "$DLL" >"$OUT/pe.txt"
exports=$(awk '/\[Ordinal\/Name Pointer\] Table/ { on = 1; next } on && NF == 0 { on = 0 } on { print $NF }' "$OUT/pe.txt" | sort)
wanted=$(grep -oE '^\s+bitsplit_\w+' "$OUT/bitsplit.def" | tr -d ' ' | sort)
if [[ "$exports" != "$wanted" ]]; then
    echo "cross_build: FAIL: bitsplit.dll exports differ from bitsplit.h's functions:" >&2
    diff <(echo "$wanted") <(echo "$exports") >&2 || true
    exit 1
fi
imports=$(awk '/DLL Name:/ { print $3 }' "$OUT/pe.txt" | sort -u | tr '\n' ' ')
for dll in $imports; do
    case "${dll,,}" in
        ggml-base.dll|kernel32.dll|msvcrt.dll|ucrtbase.dll|api-ms-win-crt-*.dll) ;;
        *) echo "cross_build: FAIL: bitsplit.dll imports $dll (a DLL a Windows user would have to ship)" >&2; exit 1 ;;
    esac
done
n_ggml=$(wc -l <"$OUT/ggml/imports.txt")
summary="native/ builds for Windows x86-64 with $("$WIN_CC" --version | head -1) ($(stat -c %s "$DLL") bytes; $(wc -w <<<"$exports") functions exported; imports ${imports% }; $n_ggml ggml functions)"

# 5. loaded and run under wine: CPU detection, the policy, each family's instructions
if ! command -v wine >/dev/null; then
    (need wine wine --no-install-recommends) || true
fi
if command -v wine >/dev/null; then
    "$WIN_CC" -std=c11 -O1 -Wall -Werror native/tests/win_smoke.c -o "$OUT/win_smoke.exe" -static
    cp "$OUT/ggml/ggml-base.dll" "$OUT/"
    wine_env
    set +e
    (cd "$OUT" && wine win_smoke.exe bitsplit.dll) >"$OUT/smoke.log" 2>&1
    rc=$?
    set -e
    line=$(tr -d '\r' <"$OUT/smoke.log" | grep "^win_smoke:" | tail -1 || true)
    if [[ $rc -ne 0 || "$line" != "win_smoke: PASS"* ]]; then
        echo "cross_build: FAIL: bitsplit.dll under wine (exit $rc): $(tr -d '\r' <"$OUT/smoke.log" | tail -5)" >&2
        exit 1
    fi
    echo "$line"
else
    summary="$summary; not loaded: wine not found"
fi
echo "cross_build: PASS: $summary"
