//! SRAM arithmetic: how many chips it takes to hold a model's weights in on-chip SRAM, the way
//! Groq and Cerebras serve models, and how SRAM compares with HBM.
//!
//! Units decide these figures, so every size says its own: `MB`/`GB` are decimal (1e6, 1e9 bytes),
//! `MiB`/`KiB` binary (2^20, 2^10). Vendors mix them: "512 KB" of registers per CU is 512 KiB,
//! while "230 MB" of GroqChip SRAM may be either.

use serde::Serialize;

/// How a size was stated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Prefix {
    /// Powers of 1000: kB, MB, GB.
    Decimal,
    /// Powers of 1024: KiB, MiB, GiB.
    Binary,
}

/// `value` megabytes in the given prefix, in bytes.
pub fn megabytes(value: f64, prefix: Prefix) -> f64 {
    match prefix {
        Prefix::Decimal => value * 1e6,
        Prefix::Binary => value * (1u64 << 20) as f64,
    }
}

/// `value` gigabytes in the given prefix, in bytes.
pub fn gigabytes(value: f64, prefix: Prefix) -> f64 {
    match prefix {
        Prefix::Decimal => value * 1e9,
        Prefix::Binary => value * (1u64 << 30) as f64,
    }
}

/// A chip and its on-chip SRAM as its maker states it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SramChip {
    pub name: &'static str,
    /// The figure as stated, e.g. 230 for "230 MB".
    pub stated: f64,
    /// "MB" or "GB".
    pub unit: &'static str,
}

// GroqChip: "230 MB of on-die SRAM" (Groq, GroqChip processor product brief). Groq does not say
// which megabyte, and the answer moves the seed's figure across 600 (see tests/wall.rs).
pub const GROQCHIP: SramChip = SramChip { name: "GroqChip", stated: 230.0, unit: "MB" };
// Cerebras WSE-3: "44 GB of on-chip SRAM" (Cerebras, WSE-3 announcement, March 2024).
pub const WSE3: SramChip = SramChip { name: "Cerebras WSE-3", stated: 44.0, unit: "GB" };

impl SramChip {
    /// The SRAM in bytes, reading the stated unit with the given prefix.
    pub fn bytes(&self, prefix: Prefix) -> f64 {
        match self.unit {
            "GB" => gigabytes(self.stated, prefix),
            _ => megabytes(self.stated, prefix),
        }
    }
}

/// Chips whose SRAM together holds `model_bytes`: `ceil(model / sram)`.
pub fn chips_to_hold(model_bytes: f64, sram_bytes: f64) -> u64 {
    if !(model_bytes > 0.0 && sram_bytes > 0.0) {
        return 0;
    }
    (model_bytes / sram_bytes).ceil() as u64
}

/// One line of the SRAM report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SramRow {
    pub chip: String,
    /// How the chip's SRAM was read, e.g. "230 MB = 230e6 B".
    pub sram: String,
    pub sram_bytes: f64,
    pub model_bytes: f64,
    /// `model_bytes / sram_bytes`, before rounding up.
    pub ratio: f64,
    pub chips: u64,
}

/// The chips needed to hold `model_bytes` in SRAM: each GPU's register files (from the device
/// table), the GroqChip read both ways, the WSE-3.
pub fn report(model_bytes: f64, devices: &[super::Device]) -> Vec<SramRow> {
    let mut rows = Vec::new();
    let mut push = |chip: String, sram: String, sram_bytes: f64| {
        rows.push(SramRow {
            chip,
            sram,
            sram_bytes,
            model_bytes,
            ratio: model_bytes / sram_bytes,
            chips: chips_to_hold(model_bytes, sram_bytes),
        });
    };
    for d in devices {
        if let Some(s) = d.sram {
            let mib = s.registers as f64 / (1u64 << 20) as f64;
            push(format!("{} register files", d.name), format!("{mib:.1} MiB"), s.registers as f64);
            let total_mib = s.total() as f64 / (1u64 << 20) as f64;
            push(format!("{} all on-chip SRAM", d.name), format!("{total_mib:.1} MiB"), s.total() as f64);
        }
    }
    for chip in [GROQCHIP, WSE3] {
        for (prefix, unit) in [(Prefix::Decimal, chip.unit), (Prefix::Binary, binary_unit(chip.unit))] {
            push(chip.name.to_string(), format!("{} {unit}", chip.stated), chip.bytes(prefix));
        }
    }
    rows
}

fn binary_unit(unit: &str) -> &'static str {
    if unit == "GB" { "GiB" } else { "MiB" }
}
