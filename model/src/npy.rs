//! Writing `.npy` files (NumPy format version 1.0): a magic string, a header dict padded so the
//! data starts at a multiple of 64 bytes, then the little-endian f32 data in C order.

use std::io::Write;
use std::path::Path;

/// The bytes of a little-endian f32 `.npy` array of `shape` holding `data`.
pub fn f32_bytes(shape: &[usize], data: &[f32]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_text}, }}");
    // magic (6) + version (2) + header length (2) + header + '\n', a multiple of 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len() * 4);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Writes an f32 `.npy` file.
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    f.write_all(&f32_bytes(shape, data))
}

/// Reads a little-endian f32 `.npy` file written by NumPy or by [`write_f32`]: its shape and data.
pub fn read_f32(bytes: &[u8]) -> Option<(Vec<usize>, Vec<f32>)> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return None;
    }
    let (hlen, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            let b = bytes.get(8..12)?;
            (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize, 12)
        }
        _ => return None,
    };
    let header = std::str::from_utf8(bytes.get(start..start + hlen)?).ok()?;
    if !header.contains("'descr': '<f4'") || header.contains("'fortran_order': True") {
        return None;
    }
    let s = header.split("'shape':").nth(1)?;
    let s = &s[s.find('(')? + 1..s.find(')')?];
    let shape: Vec<usize> = s
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse().ok())
        .collect::<Option<_>>()?;
    let data = bytes.get(start + hlen..)?;
    let n: usize = shape.iter().product();
    if data.len() != n * 4 {
        return None;
    }
    Some((shape, data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
}
