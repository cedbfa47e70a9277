#!/usr/bin/env python3
"""Compiles one CUDA source file with NVRTC to PTX or to a CUBIN, printing NVRTC's log (ptxas's report with
`--ptxas-options=-v`).

A measurement helper (issue 4): session 29 compiled the CubeCL sources `cargo xtask kernels --dump DIR` writes with
the GPU machine's NVRTC (CUDA 13.0) and with pip's 12.8, to PTX (which the driver compiles when it loads it, as it does
the engine's kernels) and to CUBINs, and launched each from `scripts/pdl_probe.py --cubecl DIR`. Needs only a
`libnvrtc.so` (e.g. `target/nvidia-cu12.8/nvidia/cuda_nvrtc/lib/libnvrtc.so.12` after `cargo xtask kernels
--install`, or `/usr/local/cuda/lib64/libnvrtc.so` on the GPU machine); no GPU.

    python3 scripts/nvrtc_compile.py --nvrtc LIB SRC.cu OUT [--ptx] -- --gpu-architecture=sm_90a --include-path=...
"""

import argparse
import ctypes
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvrtc", required=True, help="path of libnvrtc.so")
    ap.add_argument("--ptx", action="store_true", help="write the PTX (default: the CUBIN)")
    ap.add_argument("src", help="CUDA source file")
    ap.add_argument("out", help="file to write")
    ap.add_argument("options", nargs="*", help="NVRTC options (after --)")
    args = ap.parse_args()
    try:
        lib = ctypes.CDLL(args.nvrtc)
    except OSError as e:
        sys.exit(f"nvrtc_compile: cannot load --nvrtc {args.nvrtc}: {e}")
    try:
        src = open(args.src, "rb").read()
    except OSError as e:
        sys.exit(f"nvrtc_compile: cannot read {args.src}: {e}")
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"kernel.cu", 0, None, None) != 0:
        sys.exit(f"nvrtc_compile: nvrtcCreateProgram failed for {args.src}")
    opts = [o.encode() for o in args.options]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    print(f"{args.src} -> {args.out}\n{log.value.decode(errors='replace').strip()}")
    if rc != 0:
        sys.exit(f"nvrtc_compile: {args.src} did not compile (NVRTC error {rc})")
    size, get = (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX) if args.ptx else (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
    if size(prog, ctypes.byref(n)) != 0 or n.value == 0:
        sys.exit(f"nvrtc_compile: no {'PTX' if args.ptx else 'CUBIN'} for {args.src} (a CUBIN needs a real "
                 "--gpu-architecture=sm_XX)")
    buf = ctypes.create_string_buffer(n.value)
    get(prog, buf)
    with open(args.out, "wb") as f:
        f.write(buf.raw.rstrip(b"\0") if args.ptx else buf.raw)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))


if __name__ == "__main__":
    main()
