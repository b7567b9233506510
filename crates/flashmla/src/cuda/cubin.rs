//! The kernel entry points of a cubin, read from its ELF64 symbol table (no driver needed), so a CPU test can
//! check every symbol a launcher asks for against what `build.rs` embedded.

use crate::error::{Error, Result};

/// `SHT_SYMTAB`.
const SECTION_SYMTAB: u32 = 2;
/// `STT_FUNC`.
const SYMBOL_FUNC: u8 = 2;
/// `STB_GLOBAL`.
const BIND_GLOBAL: u8 = 1;
/// `SHN_UNDEF`.
const SECTION_UNDEF: u16 = 0;
/// Bytes of an ELF64 section header and symbol.
const SECTION_HEADER_BYTES: usize = 64;
const SYMBOL_BYTES: usize = 24;

fn malformed(what: impl std::fmt::Display) -> Error {
    Error::invalid("cubin", "an ELF64 little-endian image", what)
}

fn bytes<const N: usize>(image: &[u8], at: usize) -> Result<[u8; N]> {
    at.checked_add(N)
        .and_then(|end| image.get(at..end))
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| malformed(format!("{} bytes, read past at {at}", image.len())))
}

fn u16_at(image: &[u8], at: usize) -> Result<u16> {
    Ok(u16::from_le_bytes(bytes(image, at)?))
}

fn u32_at(image: &[u8], at: usize) -> Result<u32> {
    Ok(u32::from_le_bytes(bytes(image, at)?))
}

fn usize_at(image: &[u8], at: usize) -> Result<usize> {
    let v = u64::from_le_bytes(bytes(image, at)?);
    usize::try_from(v).map_err(|_| malformed(format!("offset {v}")))
}

/// A section header's type, file offset, size and link.
fn section_header(image: &[u8], headers: usize, index: usize) -> Result<(u32, usize, usize, u32)> {
    let h = index
        .checked_mul(SECTION_HEADER_BYTES)
        .and_then(|o| o.checked_add(headers))
        .ok_or_else(|| malformed(format!("section {index}")))?;
    Ok((
        u32_at(image, h + 4)?,
        usize_at(image, h + 0x18)?,
        usize_at(image, h + 0x20)?,
        u32_at(image, h + 0x28)?,
    ))
}

/// The file bytes of a section (sections without file data, e.g. shared memory, are never read).
fn section_bytes(image: &[u8], offset: usize, size: usize) -> Result<&[u8]> {
    offset
        .checked_add(size)
        .and_then(|end| image.get(offset..end))
        .ok_or_else(|| malformed(format!("a section at {offset} + {size}")))
}

/// The names of the functions `image` defines with global binding: a cubin's kernel entry points (device
/// functions that were not inlined are local or weak). Sorted. Errors: [`Error::InvalidArgument`] naming
/// `cubin` when the image is not a well-formed little-endian ELF64 file.
pub fn kernel_symbols(image: &[u8]) -> Result<Vec<String>> {
    if image.get(..6) != Some(b"\x7fELF\x02\x01".as_slice()) {
        return Err(malformed("no ELF64 little-endian header"));
    }
    let headers = usize_at(image, 0x28)?;
    let entry_size = usize::from(u16_at(image, 0x3a)?);
    let count = usize::from(u16_at(image, 0x3c)?);
    if entry_size != SECTION_HEADER_BYTES {
        return Err(malformed(format!("section headers of {entry_size} bytes")));
    }
    let mut names = Vec::new();
    for index in 0..count {
        let (kind, offset, size, link) = section_header(image, headers, index)?;
        if kind != SECTION_SYMTAB {
            continue;
        }
        let symbols = section_bytes(image, offset, size)?;
        let (_, strings, strings_size, _) = section_header(image, headers, link as usize)?;
        let table = section_bytes(image, strings, strings_size)?;
        for sym in symbols.chunks_exact(SYMBOL_BYTES) {
            let (info, shndx) = (sym[4], u16::from_le_bytes([sym[6], sym[7]]));
            if info & 0xf != SYMBOL_FUNC || info >> 4 != BIND_GLOBAL || shndx == SECTION_UNDEF {
                continue;
            }
            let name_at = u32::from_le_bytes([sym[0], sym[1], sym[2], sym[3]]) as usize;
            let name = table
                .get(name_at..)
                .and_then(|s| s.split(|&b| b == 0).next())
                .ok_or_else(|| malformed(format!("symbol name at {name_at}")))?;
            names.push(String::from_utf8_lossy(name).into_owned());
        }
    }
    names.sort();
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 image: null section, `.symtab`, `.strtab`; symbols as (name, info, section index).
    fn image(symbols: &[(&str, u8, u16)]) -> Vec<u8> {
        let mut strtab = vec![0u8];
        let mut symtab = vec![0u8; SYMBOL_BYTES]; // the null symbol
        for (name, info, shndx) in symbols {
            let at = strtab.len() as u32;
            strtab.extend_from_slice(name.as_bytes());
            strtab.push(0);
            let mut s = [0u8; SYMBOL_BYTES];
            s[..4].copy_from_slice(&at.to_le_bytes());
            s[4] = *info;
            s[6..8].copy_from_slice(&shndx.to_le_bytes());
            symtab.extend_from_slice(&s);
        }
        let mut img = vec![0u8; 64];
        img[..6].copy_from_slice(b"\x7fELF\x02\x01");
        let symtab_at = img.len();
        img.extend_from_slice(&symtab);
        let strtab_at = img.len();
        img.extend_from_slice(&strtab);
        let headers_at = img.len();
        let header = |kind: u32, offset: usize, size: usize, link: u32| {
            let mut h = [0u8; SECTION_HEADER_BYTES];
            h[4..8].copy_from_slice(&kind.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&(offset as u64).to_le_bytes());
            h[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
            h[0x28..0x2c].copy_from_slice(&link.to_le_bytes());
            h
        };
        img.extend_from_slice(&header(0, 0, 0, 0));
        img.extend_from_slice(&header(SECTION_SYMTAB, symtab_at, symtab.len(), 2));
        img.extend_from_slice(&header(3, strtab_at, strtab.len(), 0));
        img[0x28..0x30].copy_from_slice(&(headers_at as u64).to_le_bytes());
        img[0x3a..0x3c].copy_from_slice(&(SECTION_HEADER_BYTES as u16).to_le_bytes());
        img[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        img
    }

    #[test]
    fn only_defined_global_functions_are_kernels() {
        let global_func = (BIND_GLOBAL << 4) | SYMBOL_FUNC;
        let weak_func = (2 << 4) | SYMBOL_FUNC;
        let img = image(&[
            ("zeta_kernel", global_func, 5),
            ("alpha_kernel", global_func, 4),
            ("$__internal_0_helper", weak_func, 4),
            ("undefined_import", global_func, SECTION_UNDEF),
            ("a_global_object", (BIND_GLOBAL << 4) | 1, 4),
        ]);
        assert_eq!(
            kernel_symbols(&img).unwrap(),
            ["alpha_kernel", "zeta_kernel"]
        );
    }

    #[test]
    fn malformed_images_are_errors_not_panics() {
        let good = image(&[("k", (BIND_GLOBAL << 4) | SYMBOL_FUNC, 1)]);
        assert!(kernel_symbols(b"not an elf").is_err());
        // Cut inside the header, before the section headers, inside the last one's size field.
        let last_size_field = good.len() - SECTION_HEADER_BYTES + 0x24;
        for cut in [10, 40, 64, last_size_field] {
            assert_eq!(
                kernel_symbols(&good[..cut]).unwrap_err().arg(),
                Some("cubin"),
                "cut at {cut}"
            );
        }
        // A section that points past the end.
        let mut bad = good.clone();
        let headers = u64::from_le_bytes(bad[0x28..0x30].try_into().unwrap()) as usize;
        bad[headers + SECTION_HEADER_BYTES + 0x20] = 0xff;
        assert!(kernel_symbols(&bad).is_err());
    }
}
