"""llama.cpp's quantizer in a child process: `python -m exporters.llama_quantize_job SRC DST FTYPE [IMATRIX]`.

`llama_model_quantize` is one C call that runs for tens of seconds on a real model; in the exporting
process it would hold off Ctrl-C until it returns. In a child, the parent stays responsive and ends
the child on an interrupt (exporters.gguf._llama_quantize). The exit status is the call's own
(0: done), 2 for bad arguments; stderr carries only a failure's one line (llama.cpp's per-tensor
log goes to /dev/null).
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print("usage: python -m exporters.llama_quantize_job SRC DST FTYPE [IMATRIX]", file=sys.stderr)
        return 2
    import llama_cpp

    from exporters import gguf_imatrix

    src, dst, ftype = argv[0], argv[1], argv[2]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.nthread = os.cpu_count() or 1
    if len(argv) == 4:
        entries = gguf_imatrix.ctypes_entries(llama_cpp, gguf_imatrix.read(Path(argv[3])))  # referenced until the call returns
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)  # ggml prints a line per tensor
    try:
        rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    finally:
        os.dup2(saved, 2)
    if rc != 0:
        print(f"llama_model_quantize returned {rc}", file=sys.stderr)
    return int(rc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
