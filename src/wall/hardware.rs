//! The devices the memory-wall report knows: memory bandwidth and capacity, dense peak FLOP/s,
//! on-chip SRAM, each figure from the vendor's datasheet or architecture document (source in the
//! comment beside it), plus devices built from a measured bandwidth ("this machine").
//!
//! Units: bandwidth in bytes/s and capacity in bytes, both decimal as the datasheets state them
//! (1 TB/s = 1e12 B/s, 1 GB = 1e9 B); FLOP/s dense (the datasheets' "with sparsity" figures
//! halved); SRAM in bytes from the per-unit sizes of the architecture documents, which are binary
//! (a "256 KB" register file is 256 KiB = 262144 bytes).

use serde::Serialize;

use super::Error;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const TB: f64 = 1e12;
const GB: f64 = 1e9;
const TFLOPS: f64 = 1e12;

/// The `--device` key of the machine `memwall` runs on (its bandwidth measured, not looked up).
pub const THIS_MACHINE: &str = "this";

/// On-chip SRAM of a device, by level, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Sram {
    /// Register files of all SMs / CUs (NVIDIA: 64K 32-bit registers per SM; AMD: the VGPR file).
    pub registers: u64,
    /// L1 data cache and shared memory (NVIDIA's combined L1/shared; AMD's LDS plus vector L1).
    pub l1_shared: u64,
    /// L2 cache.
    pub l2: u64,
    /// A last-level cache in front of HBM (AMD Infinity Cache, "L3"); 0 if none.
    pub last_level: u64,
}

impl Sram {
    /// `units` identical SMs or CUs with the given per-unit registers and L1/shared, plus the
    /// device-wide caches.
    const fn per_unit(units: u64, registers: u64, l1_shared: u64, l2: u64, last_level: u64) -> Sram {
        Sram { registers: units * registers, l1_shared: units * l1_shared, l2, last_level }
    }

    pub fn total(&self) -> u64 {
        self.registers + self.l1_shared + self.l2 + self.last_level
    }
}

/// Where a device's figures come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// The vendor's datasheet.
    Datasheet,
    /// A bandwidth measured on this machine (`memwall peak` or `--bandwidth-gbs`).
    Measured,
}

/// A device as the memory-wall arithmetic sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Device {
    /// The key the command line accepts (`h100-sxm`).
    pub key: String,
    /// The name printed in reports (`H100 SXM`).
    pub name: String,
    /// Memory bandwidth, bytes/s (decimal).
    pub bandwidth: f64,
    /// Memory capacity, bytes (decimal, as the datasheet states it); `None` when unknown.
    pub capacity: Option<f64>,
    /// Dense bf16 FLOP/s on the matrix units; `None` when unknown.
    pub bf16_flops: Option<f64>,
    /// Dense fp8 FLOP/s; `None` when the device has no fp8 matrix units (or it is unknown).
    pub fp8_flops: Option<f64>,
    /// On-chip SRAM; `None` where the vendor has not published the sizes.
    pub sram: Option<Sram>,
    pub source: Source,
}

impl Device {
    /// The datasheet devices, in the order reports list them.
    pub fn table() -> Vec<Device> {
        DATASHEET.iter().map(DatasheetEntry::device).collect()
    }

    /// A datasheet device by key or name, ignoring case and punctuation (`h100-sxm`, `H100 SXM`).
    pub fn find(name: &str) -> Result<Device, Error> {
        let key = normalize(name);
        DATASHEET
            .iter()
            .find(|d| normalize(d.key) == key || normalize(d.name) == key)
            .map(DatasheetEntry::device)
            .ok_or_else(|| Error::UnknownDevice {
                name: name.to_string(),
                known: DATASHEET.iter().map(|d| d.key).collect::<Vec<_>>().join(", "),
            })
    }

    /// The datasheet device a GPU driver reports by `driver_name` (`NVIDIA H200`,
    /// `NVIDIA H100 80GB HBM3`, `AMD Instinct MI300X`) with `total_memory` bytes, when the table
    /// has exactly that part; `None` for parts it lacks or cannot tell apart (H100 NVL, A100 PCIe,
    /// whose bandwidths differ from the SXM columns).
    pub fn for_driver_name(driver_name: &str, total_memory: u64) -> Option<Device> {
        let n = normalize(driver_name);
        let key = if n.contains("h200") {
            "h200"
        } else if n.contains("h100") {
            if n.contains("nvl") {
                return None;
            }
            if n.contains("pcie") { "h100-pcie" } else { "h100-sxm" }
        } else if n.contains("a100") {
            if n.contains("pcie") {
                return None;
            }
            // The driver reports binary bytes: 40 GB parts hold about 40 GiB, 80 GB ones 80 GiB.
            if total_memory < 60 << 30 { "a100-40gb" } else { "a100-80gb" }
        } else if n.contains("b200") {
            "b200"
        } else if n.contains("mi325x") {
            "mi325x"
        } else if n.contains("mi300x") {
            "mi300x"
        } else if n.contains("mi250x") {
            "mi250x"
        } else if n.contains("mi250") {
            "mi250"
        } else {
            return None;
        };
        Device::find(key).ok()
    }

    /// A device known only by a measured bandwidth (bytes/s): no capacity, no compute peak, so its
    /// time floor is the memory time alone.
    pub fn measured(name: &str, bandwidth: f64) -> Result<Device, Error> {
        check_bandwidth(bandwidth)?;
        Ok(Device {
            key: normalize(name),
            name: name.to_string(),
            bandwidth,
            capacity: None,
            bf16_flops: None,
            fp8_flops: None,
            sram: None,
            source: Source::Measured,
        })
    }

    /// "This machine": the read bandwidth `memwall::peak` measured here (bytes/s) and, when known,
    /// an estimated compute peak (`memwall::peak::FlopsEstimate`, f32 FMA, used for bf16 and fp8
    /// alike since the CPU backends compute in f32). No capacity.
    pub fn this_machine(read_bandwidth: f64, estimated_flops: Option<f64>) -> Result<Device, Error> {
        check_bandwidth(read_bandwidth)?;
        if let Some(f) = estimated_flops.filter(|f| !(f.is_finite() && *f > 0.0)) {
            return Err(Error::InvalidArgument {
                what: "estimated peak FLOP/s",
                reason: format!("{f}: must be finite and positive"),
            });
        }
        let flops = match estimated_flops {
            Some(f) => format!(", {:.0} GFLOP/s estimated", f / 1e9),
            None => String::new(),
        };
        Ok(Device {
            key: THIS_MACHINE.to_string(),
            name: format!("this machine (read {:.1} GB/s measured{flops})", read_bandwidth / GB),
            bandwidth: read_bandwidth,
            capacity: None,
            bf16_flops: estimated_flops,
            fp8_flops: None,
            sram: None,
            source: Source::Measured,
        })
    }

    /// This device with its bandwidth replaced by a measured one (bytes/s); the other figures stay
    /// the datasheet's.
    pub fn with_measured_bandwidth(&self, bandwidth: f64) -> Result<Device, Error> {
        check_bandwidth(bandwidth)?;
        Ok(Device {
            key: format!("{}-measured", self.key),
            name: format!("{} (measured {:.0} GB/s)", self.name, bandwidth / GB),
            bandwidth,
            source: Source::Measured,
            ..self.clone()
        })
    }

    /// `count` of these devices working as one (ideal tensor parallelism: bandwidth, compute and
    /// capacity add up, communication is free). Used to size systems for models that do not fit.
    pub fn times(&self, count: u64) -> Device {
        if count == 1 {
            return self.clone();
        }
        let n = count as f64;
        Device {
            key: format!("{count}x{}", self.key),
            name: format!("{count} x {}", self.name),
            bandwidth: self.bandwidth * n,
            capacity: self.capacity.map(|c| c * n),
            bf16_flops: self.bf16_flops.map(|f| f * n),
            fp8_flops: self.fp8_flops.map(|f| f * n),
            sram: self.sram.map(|s| Sram {
                registers: s.registers * count,
                l1_shared: s.l1_shared * count,
                l2: s.l2 * count,
                last_level: s.last_level * count,
            }),
            source: self.source,
        }
    }
}

fn check_bandwidth(bandwidth: f64) -> Result<(), Error> {
    if bandwidth.is_finite() && bandwidth > 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            what: "bandwidth",
            reason: format!("{bandwidth} bytes/s: must be finite and positive"),
        })
    }
}

pub(crate) fn normalize(s: &str) -> String {
    s.chars().filter(|c| c.is_ascii_alphanumeric()).map(|c| c.to_ascii_lowercase()).collect()
}

struct DatasheetEntry {
    key: &'static str,
    name: &'static str,
    bandwidth: f64,
    capacity: f64,
    bf16_flops: f64,
    fp8_flops: Option<f64>,
    sram: Option<Sram>,
}

impl DatasheetEntry {
    fn device(&self) -> Device {
        Device {
            key: self.key.to_string(),
            name: self.name.to_string(),
            bandwidth: self.bandwidth,
            capacity: Some(self.capacity),
            bf16_flops: Some(self.bf16_flops),
            fp8_flops: self.fp8_flops,
            sram: self.sram,
            source: Source::Datasheet,
        }
    }
}

// NVIDIA register files are 64K x 32-bit = 256 KiB per SM (H100 and A100 architecture whitepapers).
const NV_REGS_PER_SM: u64 = 256 * KIB;

// Hopper GH100 in the H100 SXM5 and the H200: 132 SMs, 256 KiB combined L1/shared per SM, 50 MB
// L2 ("NVIDIA H100 Tensor Core GPU Architecture" whitepaper, 2022, table 3; the L2 is 50 MiB as
// cudaDeviceProp::l2CacheSize reports it).
const HOPPER_SXM_SRAM: Sram = Sram::per_unit(132, NV_REGS_PER_SM, 256 * KIB, 50 * MIB, 0);

// MI300X and MI325X: 304 CUs, each with a 512 KiB VGPR file, 64 KiB LDS and 32 KiB vector L1;
// 32 MiB of L2 (4 per XCD) and 256 MiB of Infinity Cache (ROCm documentation, "Accelerator and
// GPU hardware specifications" table). The seed's "152 MB" is the register files: 304 x 512 KiB.
const MI300_SRAM: Sram = Sram::per_unit(304, 512 * KIB, (64 + 32) * KIB, 32 * MIB, 256 * MIB);

// CDNA2 CUs (MI250X, MI250): 512 KiB VGPR file (VGPRs and AccVGPRs), 64 KiB LDS, 16 KiB vector L1;
// 8 MiB of L2 per GCD (same ROCm table).
const fn cdna2_sram(cus: u64, gcds: u64) -> Sram {
    Sram::per_unit(cus, 512 * KIB, (64 + 16) * KIB, gcds * 8 * MIB, 0)
}

#[rustfmt::skip]
const DATASHEET: &[DatasheetEntry] = &[
    // NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column: 80 GB HBM3, 3.35 TB/s, BF16 Tensor
    // Core 1,979 TFLOPS and FP8 3,958 TFLOPS "with sparsity", i.e. 989.5 and 1,979 dense.
    DatasheetEntry {
        key: "h100-sxm", name: "H100 SXM", bandwidth: 3.35 * TB, capacity: 80.0 * GB,
        bf16_flops: 989.5 * TFLOPS, fp8_flops: Some(1979.0 * TFLOPS), sram: Some(HOPPER_SXM_SRAM),
    },
    // Same datasheet, "H100 PCIe" column: 80 GB HBM2e, 2 TB/s, BF16 1,513 and FP8 3,026 TFLOPS with
    // sparsity. 114 SMs (H100 whitepaper, table 3), same per-SM SRAM and 50 MiB L2.
    DatasheetEntry {
        key: "h100-pcie", name: "H100 PCIe", bandwidth: 2.0 * TB, capacity: 80.0 * GB,
        bf16_flops: 756.5 * TFLOPS, fp8_flops: Some(1513.0 * TFLOPS),
        sram: Some(Sram::per_unit(114, NV_REGS_PER_SM, 256 * KIB, 50 * MIB, 0)),
    },
    // NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM": 141 GB HBM3e, 4.8 TB/s, BF16 1,979 and FP8
    // 3,958 TFLOPS with sparsity. The same GH100 die as the H100 SXM.
    DatasheetEntry {
        key: "h200", name: "H200", bandwidth: 4.8 * TB, capacity: 141.0 * GB,
        bf16_flops: 989.5 * TFLOPS, fp8_flops: Some(1979.0 * TFLOPS), sram: Some(HOPPER_SXM_SRAM),
    },
    // NVIDIA A100 Tensor Core GPU datasheet, "A100 40GB SXM": 1,555 GB/s HBM2, BF16 312 TFLOPS
    // dense; no fp8. A100 whitepaper: 108 SMs, 192 KiB L1/shared per SM, 40 MiB L2.
    DatasheetEntry {
        key: "a100-40gb", name: "A100 40GB", bandwidth: 1555.0 * GB, capacity: 40.0 * GB,
        bf16_flops: 312.0 * TFLOPS, fp8_flops: None,
        sram: Some(Sram::per_unit(108, NV_REGS_PER_SM, 192 * KIB, 40 * MIB, 0)),
    },
    // Same datasheet, "A100 80GB SXM": 2,039 GB/s HBM2e.
    DatasheetEntry {
        key: "a100-80gb", name: "A100 80GB", bandwidth: 2039.0 * GB, capacity: 80.0 * GB,
        bf16_flops: 312.0 * TFLOPS, fp8_flops: None,
        sram: Some(Sram::per_unit(108, NV_REGS_PER_SM, 192 * KIB, 40 * MIB, 0)),
    },
    // NVIDIA HGX platform specifications, "HGX B200" per-GPU column: 180 GB HBM3e, 7.7 TB/s, FP8
    // 9 PFLOPS and FP16/BF16 4.5 PFLOPS with sparsity (4.5 and 2.25 dense). (The 2024 launch figures
    // were 192 GB and 8 TB/s.) NVIDIA has not published the B200's SM count or cache sizes.
    DatasheetEntry {
        key: "b200", name: "B200", bandwidth: 7.7 * TB, capacity: 180.0 * GB,
        bf16_flops: 2250.0 * TFLOPS, fp8_flops: Some(4500.0 * TFLOPS), sram: None,
    },
    // AMD Instinct MI250X datasheet: 128 GB HBM2e, 3.2768 TB/s, peak bf16 383 TFLOPS (matrix, dense);
    // no fp8. 220 CUs over 2 GCDs.
    DatasheetEntry {
        key: "mi250x", name: "MI250X", bandwidth: 3.2768 * TB, capacity: 128.0 * GB,
        bf16_flops: 383.0 * TFLOPS, fp8_flops: None, sram: Some(cdna2_sram(220, 2)),
    },
    // AMD Instinct MI250 datasheet: 128 GB HBM2e, "3.2 TB/s" (3.2768 TB/s to five figures: 8192 bits
    // at 3.2 Gb/s; the seed uses 3.2), peak bf16 362.1 TFLOPS. 208 CUs over 2 GCDs. Software sees
    // the two GCDs as two devices; this row is the whole package, as the seed counts it.
    DatasheetEntry {
        key: "mi250", name: "MI250", bandwidth: 3.2 * TB, capacity: 128.0 * GB,
        bf16_flops: 362.1 * TFLOPS, fp8_flops: None, sram: Some(cdna2_sram(208, 2)),
    },
    // One GCD of the MI250 (what one HIP device is): half the package: 64 GB, 1.6384 TB/s,
    // 181.05 TFLOPS bf16, 104 CUs and 8 MiB of L2.
    DatasheetEntry {
        key: "mi250-gcd", name: "MI250 (one GCD)", bandwidth: 1.6384 * TB, capacity: 64.0 * GB,
        bf16_flops: 181.05 * TFLOPS, fp8_flops: None, sram: Some(cdna2_sram(104, 1)),
    },
    // AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s, peak bf16 1,307.4 TFLOPS and fp8 2,614.9
    // TFLOPS dense (e4m3fnuz). (ROCm's table states the HBM as 192 GiB; we keep the datasheet's GB,
    // which the seed's "~96 B parameters" divides.)
    DatasheetEntry {
        key: "mi300x", name: "MI300X", bandwidth: 5.3 * TB, capacity: 192.0 * GB,
        bf16_flops: 1307.4 * TFLOPS, fp8_flops: Some(2614.9 * TFLOPS), sram: Some(MI300_SRAM),
    },
    // AMD Instinct MI325X datasheet: 256 GB HBM3E, 6 TB/s, same compute die as the MI300X.
    DatasheetEntry {
        key: "mi325x", name: "MI325X", bandwidth: 6.0 * TB, capacity: 256.0 * GB,
        bf16_flops: 1307.4 * TFLOPS, fp8_flops: Some(2614.9 * TFLOPS), sram: Some(MI300_SRAM),
    },
];
