//! Bytes each op moves: re-exported from `memwall_runtime::cost`, the one place they are counted
//! (benches, the memory-wall report and the model's `OpCost` all call it).

pub use memwall_runtime::cost::{LinearBytes, ScaleLayout, linear_bytes, linear_traffic};
