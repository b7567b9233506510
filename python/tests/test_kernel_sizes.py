"""scripts/kernel-sizes.py on hand-made ELF files: the `.text.<kernel>` sections' sizes, largest first, and a clear
error for a file that is not a 64-bit ELF."""

import importlib.util
import struct
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kernel-sizes.py"
spec = importlib.util.spec_from_file_location("kernel_sizes", SCRIPT)
kernel_sizes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_sizes)


def elf(sections):
    """A 64-bit little-endian ELF file holding `sections` ((name, size) pairs, no contents) and a name table."""
    names = b"\x00" + b"".join(n.encode() + b"\x00" for n, _ in sections) + b".shstrtab\x00"
    header_size, entry = 64, 64
    strtab_off = header_size
    shoff = strtab_off + len(names) + (-len(names)) % 8
    headers = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]  # SHN_UNDEF
    pos = 1
    for name, size in sections:
        headers.append(struct.pack("<IIQQQQIIQQ", pos, 1, 6, 0, 0, size, 0, 0, 128, 0))
        pos += len(name) + 1
    headers.append(struct.pack("<IIQQQQIIQQ", pos, 3, 0, 0, strtab_off, len(names), 0, 0, 1, 0))
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0, header_size, 0, 0, entry,
                                 len(headers), len(headers) - 1)
    body = names + bytes((-len(names)) % 8)
    return header + body + b"".join(headers)


def test_sizes_of_the_text_sections_only(tmp_path):
    path = tmp_path / "k.cubin"
    path.write_bytes(elf([(".text.small", 320), (".nv.info.small", 64), (".text.big", 16384), (".data", 8)]))
    assert sorted(kernel_sizes.text_sections(str(path))) == [("big", 16384), ("small", 320)]


def test_the_command_prints_largest_first_with_instruction_counts(tmp_path):
    path = tmp_path / "k.cubin"
    path.write_bytes(elf([(".text.small", 320), (".text.big", 16384)]))
    out = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0].split() == ["16.0", "KB", "1024", "instructions", "big"]
    assert lines[1].split() == ["0.3", "KB", "20", "instructions", "small"]
    filtered = subprocess.run([sys.executable, str(SCRIPT), str(path), "--filter", "sma"], capture_output=True,
                              text=True, check=True).stdout
    assert filtered.split()[-1] == "small" and len(filtered.splitlines()) == 1


def test_a_file_that_is_not_elf_is_an_error(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a cubin")
    with pytest.raises(ValueError, match="not a 64-bit"):
        kernel_sizes.text_sections(str(path))
    run = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)
    assert run.returncode == 2 and "not a 64-bit little-endian ELF file" in run.stderr
