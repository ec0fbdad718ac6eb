//! Fuzzes safetensors header parsing and validation: any bytes give a typed error or tensors that
//! lie inside the file, in order, without overlap.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use memwall_model::checkpoint::parse_header;

fuzz_target!(|data: &[u8]| {
    if let Ok(tensors) = parse_header(Path::new("fuzz"), data, 0) {
        let mut end = 0;
        for (_, r) in tensors {
            assert!(r.offset >= end && r.offset + r.len <= data.len());
            end = r.offset + r.len;
        }
    }
});
