#!/usr/bin/env python3
"""Code size of every kernel in one or more cubins: the bytes of each `.text.<kernel>` section of the ELF file and
the SASS instructions they hold (16 bytes each on sm_90), largest first. No CUDA tool is needed.

Usage:
    scripts/kernel-sizes.py CUBIN [CUBIN ...] [--filter TEXT]

The build keeps each family's cubin beside its ptxas report in the flashmla-kernels build directory, e.g.
`find target -path '*flashmla-kernels*/out/decode.cubin'`.
"""

from __future__ import annotations

import argparse
import struct
import sys
from typing import List, Tuple


def text_sections(path: str) -> List[Tuple[str, int]]:
    """(kernel name, bytes) of every `.text.*` section of the 64-bit little-endian ELF file at `path`."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = headers[shstrndx][4]

    def name(offset: int) -> str:
        end = data.index(b"\x00", strtab_off + offset)
        return data[strtab_off + offset:end].decode("ascii", "replace")

    out = []
    for h in headers:
        section = name(h[0])
        if section.startswith(".text."):
            out.append((section[len(".text."):], h[5]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cubins", nargs="+")
    ap.add_argument("--filter", default="", help="only kernels whose name contains this text")
    args = ap.parse_args()
    rows = []
    for path in args.cubins:
        try:
            rows += [(size, kernel) for kernel, size in text_sections(path) if args.filter in kernel]
        except (OSError, ValueError, struct.error) as e:
            print(f"kernel-sizes: {path}: {e}", file=sys.stderr)
            return 2
    for size, kernel in sorted(rows, reverse=True):
        print(f"{size / 1024:8.1f} KB {size // 16:7d} instructions  {kernel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
