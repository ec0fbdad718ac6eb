//! The op list's byte count of a decode step, against a count by hand.

mod common;

use common::{TempDir, llama_config, random_weights, store_all, write_model};
use memwall_model::Model;
use memwall_model::graph::StepShape;
use memwall_runtime::cost::{ScaleLayout, linear_traffic};
use memwall_runtime::{DType, cpu};

#[test]
fn decode_step_bytes_equal_a_hand_count() {
    // hidden 32, intermediate 64, 2 layers, 4 query heads and 2 KV heads of 8, vocab 64, untied,
    // every tensor (norm weights too) bf16; activations f32; KV cache f32.
    let (h, i, layers, q_dim, kv_dim, vocab) = (32u64, 64u64, 2u64, 32u64, 16u64, 64u64);
    let cfg = llama_config(vocab as usize, false);
    let dir = TempDir::new("cost");
    write_model(dir.path(), &cfg, &store_all(&random_weights(&cfg, 7), DType::BF16));
    let m = Model::load(cpu::Reference, dir.path(), |_, _| {}).expect("load");

    // One sequence decoding at position 9: it attends to 10 positions.
    let attended = 10u64;
    let shape = StepShape { rows: 1, seqs: 1, attended, expert_rows: Vec::new() };
    let got = m.step_cost(&shape, false, DType::F32).bytes_read;

    let (bf16, f32b) = (2u64, 4u64);
    // A linear layer reads its [n, k] weight and its k inputs.
    let linear = |n: u64, k: u64| n * k * bf16 + k * f32b;
    let norm = h * f32b + h * bf16;
    let per_layer = norm
        + ((q_dim + 2 * kv_dim) * h * bf16 + h * f32b) // qkv: the three weights, the input row once
        + (q_dim * f32b + 4)       // rope on q: the row and its position
        + (kv_dim * f32b + 4)      // rope on k
        + (2 * kv_dim * f32b + 8)  // kv_store: k and v rows, slot and position
        + (2 * attended * kv_dim * f32b + q_dim * f32b + 8) // attention: the live cache, q, slot and length
        + linear(h, q_dim)
        + 2 * h * f32b             // residual add
        + norm
        + (2 * i * h * bf16 + h * f32b) // gate_up_silu: gate and up, and the input row once
        + linear(h, i)             // down
        + 2 * h * f32b; // residual add
    let hand = (h * bf16 + 4)      // one embedding row and its id
        + layers * per_layer
        + norm
        + (h * f32b + 4)           // gather the last row
        + linear(vocab, h); // lm_head
    assert_eq!(got, hand);

    // The linear layers' share is what `memwall_runtime::cost` counts as read.
    let read = |n: usize, k: usize| {
        linear_traffic(1, n, k, DType::BF16, ScaleLayout::None, DType::F32).expect("fits").read()
    };
    assert_eq!(read(q_dim as usize, h as usize), linear(q_dim, h));
    assert_eq!(read(h as usize, i as usize), linear(h, i));
}
