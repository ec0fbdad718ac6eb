//! The memory-wall model: every figure of the table in MISSION.md (the seed's claims), the exact
//! byte count that replaces the seed's, and the `memwall wall` command.

use std::process::Command;

use memwall::model::ModelConfig;
use memwall::wall::count::{self, WeightDtype};
use memwall::wall::estimate::{self, Bound};
use memwall::wall::scenario::{self, RequestShape, Scenario};
use memwall::wall::sram::{self, GROQCHIP, Prefix, WSE3};
use memwall::wall::{DecodeRecord, Device, Model, report};
use serde_json::Value;

const BF16: WeightDtype = WeightDtype::Bf16;
const FP8: WeightDtype = WeightDtype::Fp8;

fn preset(name: &str) -> ModelConfig {
    ModelConfig::preset(name).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn device(name: &str) -> Device {
    Device::find(name).unwrap_or_else(|e| panic!("{name}: {e}"))
}

// ---------------------------------------------------------------------------------------------
// The seed's single-stream walls: 200 (MI250), 331 (MI300X), 209 (H100 SXM) tok/s

/// The seed's "16 GB" for Llama 3.1 8B in bf16: 8.03e9 parameters x 2 bytes = 16.06e9 bytes,
/// rounded to two significant figures.
fn seed_16_gb() -> f64 {
    let bytes = count::seed_bytes_per_token(&preset("llama-3.1-8b"), BF16);
    assert_eq!(bytes, 16_060_522_496.0);
    (bytes / 1e9).round() * 1e9
}

#[test]
fn seed_walls_need_the_16_gb_rounding() {
    let gb16 = seed_16_gb();
    assert_eq!(gb16, 16e9);
    // bandwidth / 16 GB, rounded to the nearest token/s (truncating gives the same three figures).
    let wall = |d: &str| device(d).bandwidth / gb16;
    assert_eq!(wall("mi250"), 200.0); // 3.2e12 / 16e9
    assert_eq!(wall("mi300x"), 331.25); // 5.3e12 / 16e9
    assert_eq!(wall("h100-sxm"), 209.375); // 3.35e12 / 16e9
    assert_eq!([wall("mi250"), wall("mi300x"), wall("h100-sxm")].map(f64::round), [200.0, 331.0, 209.0]);

    // Unrounded, the seed's own count (every parameter once) gives 199, 330 and 209: the MI250 and
    // MI300X figures depend on rounding 16.06 GB down to 16.
    let config = preset("llama-3.1-8b");
    let unrounded = |d: &str| estimate::seed_wall_tokens_per_s(&config, BF16, &device(d));
    assert_eq!(
        [unrounded("mi250"), unrounded("mi300x"), unrounded("h100-sxm")].map(f64::round),
        [199.0, 330.0, 209.0]
    );
    // 16 GiB (17.18e9 bytes) would give 186, 308 and 195: not the seed's unit.
    let gib16 = 16.0 * (1u64 << 30) as f64;
    assert_eq!((device("mi250").bandwidth / gib16).round(), 186.0);
    // The MI250 datasheet's 3.2 TB/s is 3.2768 TB/s to five figures (as the MI250X row states it):
    // 204.8 tok/s with the same 16 GB.
    assert_eq!(device("mi250x").bandwidth / gb16, 204.8);
    // One GCD, which is what one HIP device of an MI250 is, has half: 102.4 tok/s.
    assert_eq!(device("mi250-gcd").bandwidth / gb16, 102.4);
}

#[test]
fn exact_walls_beside_the_seed_ones() {
    // The exact count reads fewer bytes at context 0 (one embedding row, not 1 GB of table), so
    // the wall is higher than the seed's; at 8192 tokens of context the KV cache more than makes
    // up for it.
    let config = preset("llama-3.1-8b");
    let h100 = device("h100-sxm");
    let at0 = estimate::wall_tokens_per_s(&config, BF16, &h100, 0);
    let at8k = estimate::wall_tokens_per_s(&config, BF16, &h100, 8192);
    assert_eq!(at0, 1.0 / (15_009_857_536.0 / 3.35e12));
    assert!((at0 - 223.19).abs() < 0.01, "{at0}");
    assert!((at8k - 208.29).abs() < 0.01, "{at8k}");
    assert_eq!(estimate::step(&config, BF16, &h100, 1, 0).bound, Bound::Memory);
}

// ---------------------------------------------------------------------------------------------
// SRAM: 152 MB, 1263x, 921 MI300X, the GroqChip, 4 WSE-3

const MIB: f64 = (1u64 << 20) as f64;

#[test]
fn mi300x_sram_is_152_mib_of_registers() {
    let mi300x = device("mi300x");
    let sram = mi300x.sram.expect("MI300X SRAM is published");
    // 304 CUs x 512 KiB of VGPRs = 155648 KiB = 152 MiB exactly: the seed's "152 MB" is binary.
    assert_eq!(sram.registers, 304 * 512 * 1024);
    assert_eq!(sram.registers as f64 / MIB, 152.0);
}

#[test]
fn sram_is_1263_times_smaller_than_hbm_when_both_read_decimal() {
    let capacity = device("mi300x").capacity.expect("datasheet capacity");
    assert_eq!(capacity, 192e9);
    // 192 GB / 152 MB with both prefixes decimal: 1263.16 -> the seed's 1263x.
    let seed = capacity / sram::megabytes(152.0, Prefix::Decimal);
    assert_eq!(seed.floor(), 1263.0);
    // The bytes as they are: 192e9 / (152 MiB) = 1204.6; 192 GiB (what ROCm reports) / 152 MiB
    // = 1293.5. The seed's ratio mixes the decimal reading of a binary figure.
    let registers = device("mi300x").sram.expect("published").registers as f64;
    assert_eq!((capacity / registers).round(), 1205.0);
    assert_eq!((sram::gigabytes(192.0, Prefix::Binary) / registers * 10.0).round() / 10.0, 1293.5);
}

/// The seed's "140 GB" for Llama 3.1 70B in bf16: 70.55e9 parameters x 2 bytes = 141.1e9 bytes,
/// rounded to two significant figures.
fn seed_140_gb() -> f64 {
    let bytes = count::seed_bytes_per_token(&preset("llama-3.1-70b"), BF16);
    assert!((bytes - 141.107e9).abs() < 1e6, "{bytes}");
    (bytes / 1e10).round() * 1e10
}

#[test]
fn mi300x_gpus_to_hold_llama_70b_in_sram() {
    let gb140 = seed_140_gb();
    assert_eq!(gb140, 140e9);
    // 140 GB / 152 MB (decimal) = 921.05: the seed's 921 truncates; 922 GPUs are needed for that
    // arithmetic.
    let ratio = gb140 / sram::megabytes(152.0, Prefix::Decimal);
    assert_eq!(ratio.floor(), 921.0);
    assert_eq!(sram::chips_to_hold(gb140, 152e6), 922);
    // With the register files' true size (152 MiB) and the exact weights (141.1 GB): 886.
    let registers = device("mi300x").sram.expect("published").registers as f64;
    let exact = count::stored_weight_bytes(&preset("llama-3.1-70b"), BF16);
    assert_eq!(sram::chips_to_hold(gb140, registers), 879);
    assert_eq!(sram::chips_to_hold(exact, registers), 886);
}

#[test]
fn groqchips_under_600_only_in_mebibytes() {
    let gb140 = seed_140_gb();
    // GroqChip's "230 MB". Read decimal (230e6 bytes): 140e9 / 230e6 = 608.7 -> 609 chips, "over
    // 600". Read binary (230 MiB = 241.2e6 bytes): 140e9 / 241.2e6 = 580.5 -> 581 chips (580 full
    // chips and part of another), "under 600" as the seed says. The seed's claim holds only with
    // the binary reading of Groq's figure (and the decimal one of the model size: 140 GiB / 230 MiB
    // would be 623.3 -> 624).
    assert_eq!(GROQCHIP.bytes(Prefix::Decimal), 230e6);
    assert_eq!(sram::chips_to_hold(gb140, GROQCHIP.bytes(Prefix::Decimal)), 609);
    assert_eq!(sram::chips_to_hold(gb140, GROQCHIP.bytes(Prefix::Binary)), 581);
    assert_eq!((gb140 / GROQCHIP.bytes(Prefix::Binary)).floor(), 580.0);
    assert_eq!(
        sram::chips_to_hold(sram::gigabytes(140.0, Prefix::Binary), GROQCHIP.bytes(Prefix::Binary)),
        624
    );
    // With the exact 141.1 GB: 614 decimal, 586 binary; the conclusion is the same.
    let exact = count::stored_weight_bytes(&preset("llama-3.1-70b"), BF16);
    assert_eq!(sram::chips_to_hold(exact, GROQCHIP.bytes(Prefix::Decimal)), 614);
    assert_eq!(sram::chips_to_hold(exact, GROQCHIP.bytes(Prefix::Binary)), 586);
}

#[test]
fn four_wafer_scale_engines() {
    // ceil(140 GB / 44 GB) = ceil(3.18) = 4; the exact 141.1 GB also needs 4. (Were Cerebras's
    // 44 GB binary, 44 GiB = 47.2e9 bytes, 3 would do: 141.1 / 47.2 = 2.99.)
    assert_eq!(sram::chips_to_hold(seed_140_gb(), WSE3.bytes(Prefix::Decimal)), 4);
    let exact = count::stored_weight_bytes(&preset("llama-3.1-70b"), BF16);
    assert_eq!(sram::chips_to_hold(exact, WSE3.bytes(Prefix::Decimal)), 4);
    assert_eq!(sram::chips_to_hold(exact, WSE3.bytes(Prefix::Binary)), 3);
}

#[test]
fn hbm_holds_40_and_96_billion_bf16_parameters() {
    let params = |d: &str| device(d).capacity.expect("datasheet capacity") / BF16.seed_bytes_per_param();
    assert_eq!(params("h100-sxm"), 40e9);
    assert_eq!(params("mi300x"), 96e9);
    // So Llama 3.1 70B in bf16 needs 2 H100s, 1 MI300X (weights alone, batch 1, context 0).
    let c = preset("llama-3.1-70b");
    assert_eq!(estimate::devices_needed(&c, BF16, &device("h100-sxm"), 1, 0), Some(2));
    assert_eq!(estimate::devices_needed(&c, BF16, &device("mi300x"), 1, 0), Some(1));
    assert_eq!(
        estimate::devices_needed(&preset("llama-3.1-405b"), BF16, &device("h100-sxm"), 1, 0),
        Some(11)
    );
}

#[test]
fn sram_report_rows() {
    let rows = sram::report(140e9, &[device("mi300x"), device("b200")]);
    // MI300X registers and total SRAM, then Groq and WSE-3 both ways; the B200 has no published SRAM.
    assert_eq!(rows.len(), 6);
    assert_eq!(rows[0].chips, 879);
    assert_eq!(rows.iter().filter(|r| r.chip == "GroqChip").map(|r| r.chips).collect::<Vec<_>>(), [609, 581]);
}

// ---------------------------------------------------------------------------------------------
// The exact count

#[test]
fn llama_3_1_8b_exact_bytes() {
    let c = preset("llama-3.1-8b");
    // KV cache: 2 (k, v) x 32 layers x 8 kv heads x 128 x 2 bytes = 131072 = 128 KiB per token.
    assert_eq!(count::kv_bytes_per_token(&c), 131_072.0);
    // Context 0: every parameter but the embedding table (8_030_261_248 - 128256 x 4096), plus the
    // one row gathered, x 2 bytes.
    let at0 = count::step_bytes(&c, BF16, 1, 0);
    assert_eq!(at0.total(), 2.0 * (8_030_261_248.0 - 525_336_576.0 + 4096.0));
    assert_eq!(at0.total(), 15_009_857_536.0);
    assert_eq!(at0.embedding, 8192.0);
    assert_eq!(at0.lm_head, 1_050_673_152.0);
    assert_eq!(at0.scales, 0.0);
    // Context 8192: plus 8192 x 128 KiB = 1 GiB.
    let at8k = count::step_bytes(&c, BF16, 1, 8192);
    assert_eq!(at8k.kv_cache, (1u64 << 30) as f64);
    assert_eq!(at8k.total(), 16_083_599_360.0);
    // A batch of 4 reads the weights once, 4 rows and 4 caches.
    let b4 = count::step_bytes(&c, BF16, 4, 8192);
    assert_eq!(b4.total() - at8k.total(), 3.0 * (8192.0 + (1u64 << 30) as f64));
}

#[test]
fn llama_3_1_8b_exact_bytes_in_fp8() {
    let c = preset("llama-3.1-8b");
    let fp8 = count::step_bytes(&c, FP8, 1, 0);
    // Per layer: projections 4096x(4096+1024+1024) + 4096x4096 and MLP 3 x 4096 x 14336 at 1 byte,
    // one f32 scale per output row (4096+1024+1024+4096 + 14336+14336+4096), norms 2 x 4096 bf16.
    let values = 2.0 * 4096.0 * 4096.0 + 2.0 * 1024.0 * 4096.0 + 3.0 * 4096.0 * 14336.0;
    let scale_rows = 4096.0 + 1024.0 + 1024.0 + 4096.0 + 14336.0 + 14336.0 + 4096.0;
    let per_layer = values + 4.0 * scale_rows + 2.0 * 2.0 * 4096.0;
    // Embedding row, lm_head and final norm stay bf16.
    let expected = 32.0 * per_layer + 2.0 * (4096.0 + 525_336_576.0 + 4096.0);
    assert_eq!(fp8.total(), expected);
    assert_eq!(fp8.scales, 32.0 * 4.0 * scale_rows);
    // The seed's fp8 count: one byte per parameter.
    assert_eq!(count::seed_bytes_per_token(&c, FP8), 8_030_261_248.0);
}

#[test]
fn mixtral_expected_experts() {
    assert_eq!(count::expected_distinct_experts(8, 2, 1), 2.0);
    assert_eq!(count::expected_distinct_experts(8, 2, 4), 8.0 * (1.0 - 0.75f64.powi(4)));
    assert_eq!(count::expected_distinct_experts(8, 2, 4), 5.46875);
    assert!((count::expected_distinct_experts(8, 2, 64) - 8.0).abs() < 1e-7);
    // A dense model reads its one MLP at any batch.
    assert_eq!(count::expected_distinct_experts(1, 1, 7), 1.0);

    let c = preset("mixtral-8x7b");
    let b1 = count::step_bytes(&c, BF16, 1, 0);
    assert_eq!(b1.experts_per_layer, 2.0);
    let expert = 3.0 * 4096.0 * 14336.0 * 2.0;
    assert_eq!(b1.mlp, 32.0 * 2.0 * expert);
    assert_eq!(b1.router, 32.0 * 8.0 * 4096.0 * 2.0);
    let b4 = count::step_bytes(&c, BF16, 4, 0);
    assert_eq!(b4.mlp, 32.0 * 5.46875 * expert);
    // At batch 1 Mixtral reads 25.5 GB, not the seed's 93.4 GB (every expert).
    assert!((b1.total() / 1e9 - 25.50).abs() < 0.01, "{}", b1.total());
    assert!((count::seed_bytes_per_token(&c, BF16) / 1e9 - 93.41).abs() < 0.01);
}

#[test]
fn flops_per_step() {
    let c = preset("llama-3.1-8b");
    // 2 FLOPs per weight used (all but the gathered embedding; lm_head included), plus attention:
    // 4 x 32 heads x 128 x 32 layers per attended position.
    let f = count::step_flops(&c, 1, 0);
    assert_eq!(f.weights, 2.0 * (8_030_261_248.0 - 525_336_576.0 - 32.0 * 2.0 * 4096.0 - 4096.0));
    assert_eq!(f.attention, 4.0 * 4096.0 * 32.0);
    assert_eq!(count::step_flops(&c, 3, 10).attention, 3.0 * 11.0 * 4.0 * 4096.0 * 32.0);
    // Mixtral: a token multiplies with its 2 experts only.
    let m = count::step_flops(&preset("mixtral-8x7b"), 1, 0);
    let per_layer = 41_943_040.0 + 2.0 * 3.0 * 4096.0 * 14336.0 + 8.0 * 4096.0;
    assert_eq!(m.weights, 2.0 * (32.0 * per_layer + 32000.0 * 4096.0));
}

#[test]
fn compute_bound_batch_is_the_crossing() {
    for (model, dev, dtype) in
        [("llama-3.1-8b", "h100-sxm", BF16), ("mixtral-8x7b", "mi300x", BF16), ("llama-3.1-70b", "h200", FP8)]
    {
        let c = preset(model);
        let d = device(dev);
        let b = estimate::compute_bound_batch(&c, dtype, &d, 0).expect("turns compute-bound at context 0");
        assert_eq!(estimate::step(&c, dtype, &d, b, 0).bound, Bound::Compute, "{model} {dev} at {b}");
        assert_eq!(
            estimate::step(&c, dtype, &d, b - 1, 0).bound,
            Bound::Memory,
            "{model} {dev} at {}",
            b - 1
        );
    }
    // Dense bf16 at context 0: FLOPs and bytes are both ~2 per parameter, so the intensity is about
    // the batch and the crossing sits at the ridge, 989.5e12 / 3.35e12 = 295.4.
    assert_eq!(
        estimate::compute_bound_batch(&preset("llama-3.1-8b"), BF16, &device("h100-sxm"), 0),
        Some(296)
    );
    // At 8192 tokens of context the KV cache (4 FLOPs per byte for Llama 3.1 8B) keeps the step
    // memory-bound at any batch.
    assert_eq!(estimate::compute_bound_batch(&preset("llama-3.1-8b"), BF16, &device("h100-sxm"), 8192), None);
    // No peak, no crossing.
    let measured = Device::measured("this machine", 100e9).expect("valid bandwidth");
    assert_eq!(estimate::compute_bound_batch(&preset("llama-3.1-8b"), BF16, &measured, 0), None);
}

#[test]
fn batch_throughput_and_time_floor() {
    let c = preset("llama-3.1-8b");
    let d = device("h200");
    let s1 = estimate::step(&c, BF16, &d, 1, 0);
    let s64 = estimate::step(&c, BF16, &d, 64, 0);
    // Batching reads the weights once for 64 tokens: ~64x the tokens/s while memory-bound.
    assert!(s64.tokens_per_s > 60.0 * s1.tokens_per_s);
    assert_eq!(s64.time_s, s64.memory_time_s.max(s64.compute_time_s.expect("known peak")));
    // Past the crossing, tokens/s stops growing with the batch: the compute roof.
    let big = estimate::step(&c, BF16, &d, 4096, 0);
    assert_eq!(big.bound, Bound::Compute);
    assert!((big.attainable_flops - 989.5e12).abs() < 1e3);
}

#[test]
fn measured_devices() {
    let h200 = device("h200");
    let measured = h200.with_measured_bandwidth(4.3e12).expect("valid bandwidth");
    assert_eq!(measured.capacity, h200.capacity);
    assert_eq!(measured.bandwidth, 4.3e12);
    assert!(Device::measured("x", 0.0).is_err());
    assert!(Device::measured("x", f64::NAN).is_err());
    assert!(Device::find("tpu-v5").is_err());
    assert_eq!(Device::find("H100 SXM").expect("by name").key, "h100-sxm");
    assert_eq!(Device::table().len(), 11);
}

#[test]
fn scenarios_differ_as_the_seed_says() {
    let c = preset("llama-3.1-8b");
    let d = device("h100-sxm");
    let shape = RequestShape { input_tokens: 1024, output_tokens: 256 };
    let run = |s| scenario::estimate(&c, BF16, &d, shape, s).expect("feasible");
    let single = run(Scenario::SingleStream);
    let server = run(Scenario::Server { tpot_limit_s: 0.1 });
    let offline = run(Scenario::Offline);
    assert_eq!(single.batch, 1);
    // SingleStream is bound by the wall.
    assert!(single.tokens_per_s <= estimate::wall_tokens_per_s(&c, BF16, &d, 1024));
    assert!(server.batch > 1 && server.time_per_output_token_s <= 0.1);
    assert!(server.tokens_per_s > 10.0 * single.tokens_per_s);
    assert!(offline.tokens_per_s >= server.tokens_per_s);
    // A tighter TPOT limit gives a smaller batch.
    let tight = run(Scenario::Server { tpot_limit_s: 0.01 });
    assert!(tight.batch < server.batch && tight.time_per_output_token_s <= 0.01);
    // A limit below the batch-1 floor cannot be met.
    assert!(scenario::estimate(&c, BF16, &d, shape, Scenario::Server { tpot_limit_s: 1e-4 }).is_err());
    // Longer than the model's context.
    let long = RequestShape { input_tokens: 131_000, output_tokens: 1000 };
    assert!(scenario::estimate(&c, BF16, &d, long, Scenario::SingleStream).is_err());
    // Llama 3.1 405B does not fit one H100: the scenarios run on the 11 it needs.
    let big = scenario::estimate(&preset("llama-3.1-405b"), BF16, &d, shape, Scenario::SingleStream)
        .expect("feasible");
    assert_eq!(big.devices, 11);
}

#[test]
fn workload_checks() {
    let m = Model::resolve("mixtral-8x7b").expect("preset");
    let d = device("h100-sxm");
    assert!(report::wall_row(&m, BF16, &d, 0, 0).is_err());
    assert!(report::wall_row(&m, BF16, &d, 1, 32768).is_err());
    let row = report::wall_row(&m, BF16, &d, 1, 32767).expect("last position");
    assert_eq!(row.fits, Some(false));
    assert_eq!(row.devices_needed, Some(2));
    assert!(Model::resolve("no-such-model").is_err());
}

// ---------------------------------------------------------------------------------------------
// The command

/// Runs `memwall` with a target directory that holds no decode record, so a record left by
/// `cargo bench --bench decode` cannot add rows.
fn memwall(args: &[&str]) -> std::process::Output {
    memwall_in(args, &std::env::temp_dir().join("memwall-wall-test-no-target"))
}

fn memwall_in(args: &[&str], target_dir: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_memwall"))
        .args(args)
        .env("CARGO_TARGET_DIR", target_dir)
        .output()
        .expect("run memwall")
}

fn json_rows(args: &[&str]) -> Vec<Value> {
    let out = memwall(args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    match serde_json::from_slice(&out.stdout) {
        Ok(Value::Array(rows)) => rows,
        other => panic!("{args:?}: not a JSON array: {other:?}"),
    }
}

#[test]
fn cli_json_fields_and_filters() {
    let rows = json_rows(&["wall", "--json", "--model", "llama-3.1-8b", "--device", "h100-sxm,mi300x"]);
    assert_eq!(rows.len(), 2);
    for key in [
        "model",
        "dtype",
        "device",
        "batch",
        "context",
        "bytes_per_token",
        "wall_tokens_per_s",
        "bytes_per_token_all_params",
        "wall_tokens_per_s_all_params",
    ] {
        assert!(rows.iter().all(|r| r.get(key).is_some()), "missing {key}");
    }
    assert_eq!(rows[0]["model"], "llama-3.1-8b");
    assert_eq!(rows[0]["device"], "H100 SXM");
    assert_eq!(rows[1]["device"], "MI300X");
    assert_eq!(rows[0]["bytes_per_token"], 15_009_857_536.0);
    assert_eq!(rows[0]["bytes_per_token_all_params"], 16_060_522_496.0);
    assert_eq!(rows[1]["wall_tokens_per_s_all_params"].as_f64().map(f64::round), Some(330.0));

    // Defaults: every preset on every device, bf16, batch 1, context 0.
    let all = json_rows(&["wall", "--json"]);
    assert_eq!(all.len(), 7 * 11);
    assert!(all.iter().all(|r| r["dtype"] == "bf16" && r["batch"] == 1 && r["context"] == 0));

    let rows = json_rows(&[
        "wall",
        "--json",
        "--model",
        "mixtral-8x7b",
        "--device",
        "h200",
        "--dtype",
        "bf16,fp8",
        "--batch",
        "4",
        "--context",
        "8192",
    ]);
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1]["dtype"], "fp8");
    assert_eq!(rows[0]["batch"], 4);
    assert_eq!(rows[0]["bytes_per_step_detail"]["experts_per_layer"], 5.46875);
    assert_eq!(rows[0]["context"], 8192);
}

#[test]
fn cli_model_directory_and_measured_bandwidth() {
    let dir = std::env::temp_dir().join(format!("memwall-wall-test-{}", std::process::id()));
    let ckpt = dir.join("tiny-llama");
    std::fs::create_dir_all(&ckpt).expect("temp dir");
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/configs/tiny-llama.json");
    std::fs::copy(fixture, ckpt.join("config.json")).expect("copy fixture");
    let ckpt_arg = ckpt.to_str().expect("utf-8 path");
    let rows =
        json_rows(&["wall", "--json", "--model", ckpt_arg, "--device", "h200", "--bandwidth-gbs", "4300"]);
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["model"], "tiny-llama");
    // 1000 x 256 embedding twice, 4 layers of (2 x 256 x 256 + 2 x 64 x 256 + 3 x 256 x 768 + 512), final norm.
    let params = 2 * 1000 * 256 + 4 * (2 * 256 * 256 + 2 * 64 * 256 + 3 * 256 * 768 + 512) + 256;
    assert_eq!(rows[0]["params"], params);
    assert_eq!(rows[1]["device_source"], "measured");
    assert_eq!(rows[1]["bandwidth_bytes_per_s"], 4.3e12);

    // A config file by path, and the roofline.
    let svg = dir.join("roof.svg");
    let out = memwall(&[
        "wall",
        "--model",
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/configs/tiny-mixtral.json"),
        "--device",
        "mi300x",
        "--svg",
        svg.to_str().expect("utf-8 path"),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&svg).expect("svg written");
    assert!(
        text.starts_with("<svg")
            && text.contains("Decode roofline on MI300X")
            && text.contains("tiny-mixtral")
    );
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn cli_errors_are_messages_not_panics() {
    let sliding = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/configs/sliding-window-mixtral.json");
    let gelu = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/configs/gelu-llama.json");
    let cases: [(&[&str], &str); 8] = [
        (&["wall", "--device", "tpu-v5"], "unknown device `tpu-v5`"),
        (&["wall", "--model", "gpt-2"], "neither a directory holding config.json nor a known model"),
        (&["wall", "--model", sliding], "sliding_window"),
        (&["wall", "--model", gelu], "hidden_act"),
        (&["wall", "--dtype", "int4"], "expected bf16 or fp8"),
        (&["wall", "--batch", "0"], "invalid batch"),
        (&["wall", "--model", "llama-3.1-8b", "--context", "200000"], "max_position_embeddings"),
        (&["wall", "--svg", "/tmp/never-written.svg"], "name it with --device"),
    ];
    for (args, message) in cases {
        let out = memwall(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    for bad in ["--bandwidth-gbs=-5", "--bandwidth-gbs=0", "--bandwidth-gbs=nan"] {
        let out = memwall(&["wall", bad]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bad}: {stderr}");
        assert!(stderr.contains("invalid bandwidth"), "{bad}: {stderr}");
    }
}

#[test]
fn cli_table_scenarios_and_sram() {
    let out = memwall(&["wall", "--model", "llama-3.1-8b", "--device", "mi250,mi300x,h100-sxm"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    // The seed's (unrounded) walls sit beside the exact ones.
    for wall in ["199.2", "330.0", "208.6", "213.2", "353.1", "223.2"] {
        assert!(text.contains(wall), "{wall} missing from\n{text}");
    }
    let rows =
        json_rows(&["wall", "--scenarios", "--json", "--model", "llama-3.1-8b", "--device", "h100-sxm"]);
    let names: Vec<_> = rows.iter().map(|r| r["scenario"].as_str().unwrap_or("?").to_string()).collect();
    assert_eq!(names, ["SingleStream", "Server", "Offline"]);
    let rows = json_rows(&["wall", "--sram", "--json", "--device", "mi300x"]);
    assert!(rows.iter().any(|r| r["chip"] == "GroqChip" && r["chips"] == 614));
}

#[test]
fn this_machine_and_achieved_rates() {
    let this = Device::this_machine(20e9, Some(5e11)).expect("valid figures");
    assert_eq!(this.key, "this");
    assert_eq!(this.name, "this machine (read 20.0 GB/s measured, 500 GFLOP/s estimated)");
    assert_eq!(this.bf16_flops, Some(5e11));
    assert_eq!(this.capacity, None);
    assert!(Device::this_machine(0.0, None).is_err());
    assert!(Device::this_machine(1e9, Some(f64::INFINITY)).is_err());
    assert_eq!(Device::this_machine(1e9, None).expect("valid").name, "this machine (read 1.0 GB/s measured)");

    let model = Model::resolve("llama-3.1-8b").expect("preset");
    let row = report::wall_row(&model, BF16, &this, 1, 0).expect("row");
    assert_eq!(row.achieved_tokens_per_s, None);
    let row = row.with_achieved(1.0).expect("a rate");
    assert_eq!(row.achieved_tokens_per_s, Some(1.0));
    // Batch 1 is memory-bound here: the fraction of the wall is the bandwidth utilisation.
    let wall = 20e9 / row.bytes_per_token;
    assert!((row.achieved_fraction_of_wall.expect("fraction") - 1.0 / wall).abs() < 1e-12);
    assert!((row.bandwidth_utilisation.expect("utilisation") - row.bytes_per_step / 20e9).abs() < 1e-12);
    // At batch 8 one step serves 8 tokens: 8 tok/s is one step a second.
    let b8 = report::wall_row(&model, BF16, &this, 8, 0).expect("row").with_achieved(8.0).expect("rate");
    assert!((b8.bandwidth_utilisation.expect("utilisation") - b8.bytes_per_step / 20e9).abs() < 1e-12);
    assert!(row.clone().with_achieved(0.0).is_err());
    assert!(row.with_achieved(f64::NAN).is_err());
}

#[test]
fn cli_achieved_tokens_per_s() {
    let rows = json_rows(&[
        "wall",
        "--json",
        "--model",
        "llama-3.1-8b",
        "--device",
        "h200",
        "--achieved-tok-s",
        "200",
    ]);
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(r["achieved_tokens_per_s"], 200.0);
    let wall = r["wall_tokens_per_s"].as_f64().expect("wall");
    assert!((r["achieved_fraction_of_wall"].as_f64().expect("fraction") - 200.0 / wall).abs() < 1e-9);
    let bytes = r["bytes_per_step"].as_f64().expect("bytes");
    assert!((r["bandwidth_utilisation"].as_f64().expect("util") - bytes * 200.0 / 4.8e12).abs() < 1e-9);

    // With a measured device, only its row gets the rate.
    let rows = json_rows(&[
        "wall",
        "--json",
        "--model",
        "llama-3.1-8b",
        "--device",
        "h200",
        "--bandwidth-gbs",
        "4300",
        "--achieved-tok-s",
        "200",
    ]);
    assert_eq!(rows.len(), 2);
    assert!(rows[0]["achieved_tokens_per_s"].is_null());
    assert_eq!(rows[1]["achieved_tokens_per_s"], 200.0);

    let out = memwall(&["wall", "--model", "llama-3.1-8b", "--device", "h200", "--achieved-tok-s", "200"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("achieved tok/s") && text.contains("200.00"), "{text}");
    for bad in ["0", "-3", "nan"] {
        let out = memwall(&["wall", "--device", "h200", &format!("--achieved-tok-s={bad}")]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bad}: {stderr}");
        assert!(stderr.contains("--achieved-tok-s"), "{bad}: {stderr}");
    }
}

#[test]
fn cli_reads_the_benches_record() {
    let dir = std::env::temp_dir().join(format!("memwall-wall-record-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/configs/tiny-llama.json");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture).expect("fixture")).expect("json");
    let record = DecodeRecord {
        model: "tiny-random".into(),
        backend: "cpu::Fast".into(),
        dtype: "bf16".into(),
        batch: 1,
        context: 16,
        steps: 10,
        tokens_per_s: 1000.0,
        bytes_per_step: 4e6,
        flops_per_step: 8e6,
        peak_read_gb_s: 10.0,
        estimated_peak_flops_per_s: Some(2e11),
        config,
    };
    // Where the bench writes it: under the target directory.
    let path = dir.join("target").join(memwall::wall::record::RECORD_FILE);
    record.save(&path).expect("save");

    let out = memwall_in(&["wall", "--json", "--device", "h200"], &dir.join("target"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Value> = serde_json::from_slice(&out.stdout).expect("json");
    assert!(rows.len() > 1);
    let last = rows.last().expect("a row");
    assert_eq!(last["model"], "tiny-random");
    assert_eq!(last["device_source"], "measured");
    assert_eq!(last["bandwidth_bytes_per_s"], 10e9);
    assert_eq!(last["context"], 16);
    assert_eq!(last["achieved_tokens_per_s"], 1000.0);
    assert!(rows[..rows.len() - 1].iter().all(|r| r["achieved_tokens_per_s"].is_null()));

    // A --model filter that leaves it out; an explicit --record path; the text summary.
    let rows = json_rows(&[
        "wall",
        "--json",
        "--model",
        "llama-3.1-8b",
        "--device",
        "h200",
        "--record",
        path.to_str().expect("utf-8"),
    ]);
    assert_eq!(rows.len(), 1);
    let out = memwall(&[
        "wall",
        "--model",
        "tiny-random",
        "--device",
        "h200",
        "--record",
        path.to_str().expect("utf-8"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("decode tiny-random batch 1 context 16: 1000.00 tok/s = 40.0% of the wall 2500.00 tok/s at measured read peak 10.0 GB/s"),
        "{text}"
    );

    // The roofline draws the record's point.
    let svg = dir.join("roof.svg");
    let out = memwall(&[
        "wall",
        "--model",
        "llama-3.2-1b,tiny-random",
        "--device",
        "h200",
        "--record",
        path.to_str().expect("utf-8"),
        "--svg",
        svg.to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&svg).expect("svg");
    assert!(text.contains("measured: tiny-random batch 1 context 16 on cpu::Fast"), "no measured point");

    let missing = dir.join("none.json");
    let out = memwall(&["wall", "--record", missing.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

/// Measures this machine's read ceiling (a few seconds over at least 1 GiB); asserts only what
/// does not depend on timing.
#[test]
fn cli_measures_this_machine() {
    let svg = std::env::temp_dir().join(format!("memwall-wall-this-{}.svg", std::process::id()));
    let rows = json_rows(&[
        "wall",
        "--json",
        "--model",
        "llama-3.2-1b",
        "--device",
        "this",
        "--achieved-tok-s",
        "1",
        "--svg",
        svg.to_str().expect("utf-8"),
    ]);
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(r["device_source"], "measured");
    assert!(r["device"].as_str().is_some_and(|d| d.starts_with("this machine (read ")), "{r}");
    assert!(r["bandwidth_bytes_per_s"].as_f64().is_some_and(|b| b > 0.0));
    assert!(r["peak_flops_per_s"].is_null() || r["peak_flops_per_s"].as_f64().is_some_and(|f| f > 0.0));
    assert_eq!(r["achieved_tokens_per_s"], 1.0);
    let text = std::fs::read_to_string(&svg).expect("svg");
    assert!(
        text.contains("Decode roofline on this machine") && text.contains("measured: llama-3.2-1b batch 1")
    );
    let _ = std::fs::remove_file(&svg);
}

#[test]
fn driver_names_map_to_their_datasheet_parts() {
    let key = |name: &str, gib: u64| Device::for_driver_name(name, gib << 30).map(|d| d.key);
    assert_eq!(key("NVIDIA H200", 141), Some("h200".into()));
    assert_eq!(key("NVIDIA H100 80GB HBM3", 80), Some("h100-sxm".into()));
    assert_eq!(key("NVIDIA H100 PCIe", 80), Some("h100-pcie".into()));
    assert_eq!(key("NVIDIA H100 NVL", 94), None);
    assert_eq!(key("NVIDIA A100-SXM4-40GB", 40), Some("a100-40gb".into()));
    assert_eq!(key("NVIDIA A100-SXM4-80GB", 80), Some("a100-80gb".into()));
    assert_eq!(key("NVIDIA A100-PCIE-40GB", 40), None);
    assert_eq!(key("NVIDIA B200", 180), Some("b200".into()));
    assert_eq!(key("AMD Instinct MI300X", 192), Some("mi300x".into()));
    assert_eq!(key("AMD Instinct MI325X", 256), Some("mi325x".into()));
    assert_eq!(key("AMD Instinct MI250X", 128), Some("mi250x".into()));
    assert_eq!(key("NVIDIA GeForce RTX 4090", 24), None);
    // The SIMT emulator is no datasheet part.
    assert_eq!(key("SIMT emulator", 0), None);
}
