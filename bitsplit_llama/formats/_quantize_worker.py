"""Child process that runs llama.cpp's own quantizer (``llama_model_quantize``) for the base.

It runs apart from the caller so that (a) a Ctrl-C or a kill of the split can stop it at once
(a ctypes call cannot be interrupted), (b) a llama.cpp abort on a malformed file ends this child,
not the user's process, and (c) llama.cpp's progress log can be read line by line from its stderr.

Usage (internal): ``python -m bitsplit_llama.formats._quantize_worker JSON`` where JSON holds
``src``, ``dst``, ``ftype``, ``nthread`` and optionally ``imatrix`` (a path). Exit status 0 on success.
"""

from __future__ import annotations

import ctypes
import json
import sys

from .._platform import die_with_parent


def main(argv: list[str]) -> int:
    args = json.loads(argv[1])
    if args.get("parent"):
        die_with_parent(int(args["parent"]))  # no orphan quantizer if the split is killed
    import llama_cpp  # loads libllama; its default logger prints llama.cpp's log to stderr

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(args["ftype"])
    params.nthread = int(args["nthread"])
    params.allow_requantize = True
    params.quantize_output_tensor = True
    keep_alive = []
    if args.get("imatrix"):
        from .imatrix import load_imatrix

        entries = load_imatrix(args["imatrix"])
        arr = (llama_cpp.llama_model_imatrix_data * (len(entries) + 1))()
        for i, (name, values) in enumerate(entries.items()):
            name_b = name.encode()
            keep_alive.append((name_b, values))
            arr[i].name = name_b
            arr[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = values.size
        arr[len(entries)].name = None  # the list ends at a NULL name
        params.imatrix = ctypes.cast(arr, type(params.imatrix))
        keep_alive.append(arr)
        print(f"bitsplit: loaded {len(entries)} imatrix entries", file=sys.stderr, flush=True)
    rc = llama_cpp.llama_model_quantize(args["src"].encode(), args["dst"].encode(), ctypes.byref(params))
    sys.stderr.flush()
    return 0 if rc == 0 else 3


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except Exception as exc:  # reported to the parent through stderr, which it shows in one line
        print(f"bitsplit-error: {exc}", file=sys.stderr, flush=True)
        sys.exit(4)
