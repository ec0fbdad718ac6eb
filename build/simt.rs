//! simt: compiles the kernel sources as host C++ under the `emulate` feature (owned by the SIMT
//! work).

use std::path::Path;

pub fn run(_root: &Path, _out: &Path) {}
