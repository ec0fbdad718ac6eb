//! Every validation error the runtime can return, on both CPU backends.
//!
//! Each test asserts the exact `Error` (variant and fields). The shape and dtype checks run before
//! any kernel (`ops::check_*`); the data-dependent ones (token ids, slots, positions, gather and
//! scatter indices) are the kernels', and must fail before anything is written: those tests
//! poison every output first and check the poison is intact afterwards. Read-only outputs are
//! tensors over a read-only memory map of a temporary file (`HostStorage::mapped`).

mod common;

use std::fs::{self, File};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use memmap2::Mmap;
use memwall_runtime::{
    Backend, DType, Error, Expert, ExpertsDims, ExpertsScratch, HostStorage, HostTensor, KvCacheLayer,
    Linear, Llama3RopeScaling, Rope, SamplingParams, Tensor, WeightScale,
};

type R<T> = memwall_runtime::Result<T>;

/// Generates `#[test] fn NAME()` in `mod reference` and `mod fast` calling the generic `NAME(b)`.
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod reference {
            $(#[test] fn $name() { super::$name(&memwall_runtime::cpu::Reference::default()); })*
        }
        mod fast {
            $(#[test] fn $name() { super::$name(&memwall_runtime::cpu::Fast::default()); })*
        }
    };
}

on_both_backends!(
    memory_errors,
    read_only_and_misaligned_mappings,
    mapped_weights_are_read_in_place,
    linear_errors,
    gate_up_silu_errors,
    qkv_errors,
    rms_norm_errors,
    rope_errors,
    elementwise_errors,
    embedding_errors,
    kv_store_errors,
    attention_errors,
    router_topk_errors,
    pick_errors,
    vocabulary_beyond_u32,
    sample_param_errors,
    gather_scatter_errors,
    read_only_outputs,
    token_out_of_range_writes_nothing,
    cache_rows_out_of_range_write_nothing,
    index_out_of_range_writes_nothing,
    experts_errors,
);

// ---------------------------------------------------------------------------------------------
// Helpers

trait HostBackend: Backend<Storage = HostStorage> {}
impl<B: Backend<Storage = HostStorage>> HostBackend for B {}

/// The error of `r`, failing the test if it succeeded.
fn err<T: std::fmt::Debug>(what: &str, r: R<T>) -> Error {
    match r {
        Ok(v) => panic!("{what}: expected an error, got Ok({v:?})"),
        Err(e) => e,
    }
}

fn expect<T: std::fmt::Debug>(b: &impl HostBackend, what: &str, r: R<T>, want: Error) {
    let got = err(what, r);
    assert_eq!(got, want, "{} {what}", b.name());
}

fn shape(op: &'static str, tensor: &'static str, got: &[usize], expected: &str) -> Error {
    Error::Shape { op, tensor, got: got.to_vec(), expected: expected.to_string() }
}

fn dtype(op: &'static str, tensor: &'static str, got: DType, allowed: &[DType]) -> Error {
    Error::DType { op, tensor, got, allowed: allowed.to_vec() }
}

fn argument(op: &'static str, msg: impl Into<String>) -> Error {
    Error::Argument { op, msg: msg.into() }
}

const F32: &[DType] = &[DType::F32];
const U32S: &[DType] = &[DType::U32];
const SCALES: &[DType] = &[DType::F32, DType::BF16];
const CACHES: &[DType] = &[DType::F32, DType::BF16, DType::F16];

/// A zero-filled tensor (the checks under test never look at values).
fn z(b: &impl HostBackend, dt: DType, shape: &[usize]) -> HostTensor {
    b.alloc(dt, shape).unwrap_or_else(|e| panic!("alloc {dt} {shape:?}: {e}"))
}

/// A tensor of random valid values.
fn rnd(b: &impl HostBackend, rng: &mut Rng, dt: DType, shape: &[usize]) -> HostTensor {
    random_tensor(b, rng, dt, shape).0
}

static FILES: AtomicUsize = AtomicUsize::new(0);

/// A read-only map of a fresh temporary file holding `bytes` (or `len` zero bytes, sparse, when
/// `bytes` is `None`). The file is removed at once; the mapping stays valid.
fn map_file(bytes: Option<&[u8]>, len: u64) -> Arc<Mmap> {
    let path: PathBuf = std::env::temp_dir().join(format!(
        "memwall-validation-{}-{}",
        std::process::id(),
        FILES.fetch_add(1, Ordering::Relaxed)
    ));
    let mut f = File::create(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    match bytes {
        Some(b) => f.write_all(b).expect("write temp file"),
        None => f.set_len(len).expect("size temp file"),
    }
    drop(f);
    let f = File::open(&path).expect("reopen temp file");
    // SAFETY: the file is this test's own, freshly written and unlinked below; nothing else
    // writes or truncates it while it is mapped.
    let map = unsafe { Mmap::map(&f) }.unwrap_or_else(|e| panic!("mmap {}: {e}", path.display()));
    fs::remove_file(&path).expect("remove temp file");
    Arc::new(map)
}

/// A read-only tensor over a mapped file holding `bytes`.
fn mapped(dt: DType, shape: &[usize], bytes: &[u8]) -> HostTensor {
    let map = map_file(Some(bytes), 0);
    let storage = HostStorage::mapped(map, 0, bytes.len(), dt.size()).expect("aligned mapping");
    Tensor::new(storage, dt, shape).expect("mapped tensor of the right length")
}

/// A read-only tensor full of poison.
fn mapped_poison(dt: DType, shape: &[usize]) -> HostTensor {
    mapped(dt, shape, &poison_bytes(dt, shape.iter().product()))
}

// ---------------------------------------------------------------------------------------------
// Memory: alloc, write, upload, read, Tensor::new, reshape, mappings

fn memory_errors(b: &impl HostBackend) {
    // Shape overflow: the element count, then the byte count, then beyond isize::MAX.
    expect(
        b,
        "alloc [MAX, 2]",
        b.alloc(DType::F32, &[usize::MAX, 2]),
        Error::ShapeOverflow { shape: vec![usize::MAX, 2] },
    );
    expect(
        b,
        "alloc [2^62] f32",
        b.alloc(DType::F32, &[1 << 62]),
        Error::ShapeOverflow { shape: vec![1 << 62] },
    );
    let past = isize::MAX as usize / 4 + 1;
    expect(
        b,
        "alloc past isize::MAX",
        b.alloc(DType::F32, &[past]),
        Error::ShapeOverflow { shape: vec![past] },
    );
    // A size that is representable but cannot be mapped.
    match err("alloc 2^62 bytes", b.alloc(DType::F32, &[1 << 60])) {
        Error::OutOfMemory { device, bytes, .. } => {
            assert_eq!((device.as_str(), bytes), ("host", 1 << 62), "{}", b.name());
        }
        e => panic!("{}: alloc 2^62 bytes: expected OutOfMemory, got {e:?}", b.name()),
    }

    // Tensor::new with the wrong byte length, and with an overflowing shape.
    let storage = HostStorage::zeroed(12).expect("12 bytes");
    expect(
        b,
        "Tensor::new 12 bytes as f32 [2, 2]",
        Tensor::new(storage, DType::F32, &[2, 2]),
        Error::ByteLength { dtype: DType::F32, shape: vec![2, 2], expected: 16, got: 12 },
    );
    let storage = HostStorage::zeroed(0).expect("0 bytes");
    expect(
        b,
        "Tensor::new overflow",
        Tensor::new(storage, DType::BF16, &[usize::MAX, 3]),
        Error::ShapeOverflow { shape: vec![usize::MAX, 3] },
    );
    // Reshape to another element count.
    let t = z(b, DType::F16, &[2, 3]);
    expect(
        b,
        "reshape [2, 3] -> [7]",
        t.reshape(&[7]),
        Error::ByteLength { dtype: DType::F16, shape: vec![7], expected: 14, got: 12 },
    );

    // write / upload byte lengths.
    let mut t = z(b, DType::F32, &[3]);
    let want = || Error::ByteLength { dtype: DType::F32, shape: vec![3], expected: 12, got: 11 };
    expect(b, "write 11 bytes", b.write(&mut t, &[0; 11]), want());
    expect(b, "upload 11 bytes", b.upload(DType::F32, &[3], &[0; 11]), want());
    expect(
        b,
        "upload_f32 of 4 values into [3]",
        b.upload_f32(DType::BF16, &[3], &[0.5; 4]),
        Error::ByteLength { dtype: DType::BF16, shape: vec![3], expected: 6, got: 8 },
    );
    expect(
        b,
        "upload_u32 of 2 values into [3]",
        b.upload_u32(&[3], &[1, 2]),
        Error::ByteLength { dtype: DType::U32, shape: vec![3], expected: 12, got: 8 },
    );
    // Float conversions of a u32 tensor, and u32 reads of a float tensor.
    expect(
        b,
        "upload_f32 as u32",
        b.upload_f32(DType::U32, &[1], &[0.5]),
        argument("upload_f32", "u32 is not a float type"),
    );
    let ids = upload_u32(b, &[2], &[1, 2]);
    expect(b, "read_f32 of u32", b.read_f32(&ids), argument("read_f32", "u32 is not a float type"));
    let f = z(b, DType::F32, &[2]);
    expect(b, "read_u32 of f32", b.read_u32(&f), dtype("read_u32", "src", DType::F32, U32S));
    // exec_write / exec_read beyond the storage (the kernels check too). Shorter is a prefix: a
    // tensor whose rows were reduced (`set_rows`) uses the start of its storage only.
    let mut s = HostStorage::zeroed(8).expect("8 bytes");
    expect(
        b,
        "exec_write 9 bytes",
        b.exec_write(&mut s, &[0; 9]),
        Error::OutOfBounds { what: "write".into(), offset: 0, len: 9, size: 8 },
    );
    b.exec_write(&mut s, &[7; 7]).unwrap_or_else(|e| panic!("{}: exec_write 7 of 8 bytes: {e}", b.name()));
    assert_eq!(s.bytes(), [7, 7, 7, 7, 7, 7, 7, 0], "{}: exec_write of a prefix", b.name());
    let mut head = [0u8; 3];
    b.exec_read(&s, &mut head).unwrap_or_else(|e| panic!("{}: exec_read 3 of 8 bytes: {e}", b.name()));
    assert_eq!(head, [7, 7, 7], "{}: exec_read of a prefix", b.name());
    expect(
        b,
        "exec_zero 9 bytes",
        b.exec_zero(&mut s, 9),
        Error::OutOfBounds { what: "zero".into(), offset: 0, len: 9, size: 8 },
    );
    b.exec_zero(&mut s, 5).unwrap_or_else(|e| panic!("{}: exec_zero 5 of 8 bytes: {e}", b.name()));
    assert_eq!(s.bytes(), [0, 0, 0, 0, 0, 7, 7, 0], "{}: exec_zero of a prefix", b.name());
    // zero: the tensor's current rows, not the rest of its storage.
    let mut t =
        b.upload_f32(DType::F32, &[3, 2], &[1.5; 6]).unwrap_or_else(|e| panic!("{}: upload: {e}", b.name()));
    t.set_rows(2).unwrap_or_else(|e| panic!("{}: set_rows 2 of 3: {e}", b.name()));
    b.zero(&mut t).unwrap_or_else(|e| panic!("{}: zero: {e}", b.name()));
    t.set_rows(3).unwrap_or_else(|e| panic!("{}: set_rows 3 of 3: {e}", b.name()));
    let v = b.read_f32(&t).unwrap_or_else(|e| panic!("{}: read: {e}", b.name()));
    assert_eq!(v, [0.0, 0.0, 0.0, 0.0, 1.5, 1.5], "{}: zero of 2 of 3 rows", b.name());

    // Rows: at most what the storage holds; reshape keeps the current element count.
    let mut t = z(b, DType::F32, &[4, 3]);
    t.set_rows(2).unwrap_or_else(|e| panic!("{}: set_rows 2 of 4: {e}", b.name()));
    assert_eq!((t.shape(), t.nbytes(), t.max_rows()), (&[2, 3][..], 24, 4), "{}: set_rows", b.name());
    expect(
        b,
        "set_rows 5 of 4",
        t.set_rows(5),
        argument("set_rows", "5 rows of [3] beyond the 4 its storage holds"),
    );
    expect(
        b,
        "reshape [2, 3] of 4 rows -> [12]",
        z(b, DType::F32, &[4, 3]).reshape(&[4, 3]).and_then(|mut t| {
            t.set_rows(2)?;
            t.reshape(&[12])
        }),
        Error::ByteLength { dtype: DType::F32, shape: vec![12], expected: 48, got: 24 },
    );
    let t = z(b, DType::F32, &[4, 3]).reshape(&[4, 3]).and_then(|mut t| {
        t.set_rows(2)?;
        t.reshape(&[2, 1, 3])
    });
    let t = t.unwrap_or_else(|e| panic!("{}: reshape of reduced rows: {e}", b.name()));
    assert_eq!((t.shape(), t.max_rows()), (&[2, 1, 3][..], 4), "{}: reshape keeps the storage", b.name());
    let mut scalar = z(b, DType::F32, &[]);
    expect(
        b,
        "set_rows of a scalar",
        scalar.set_rows(1),
        argument("set_rows", "a rank-0 tensor has no rows"),
    );
    let mut out = [0u8; 9];
    expect(
        b,
        "exec_read 9 bytes",
        b.exec_read(&s, &mut out),
        Error::OutOfBounds { what: "read".into(), offset: 0, len: 9, size: 8 },
    );
}

fn read_only_and_misaligned_mappings(b: &impl HostBackend) {
    let bytes: Vec<u8> = (0..64u8).collect();
    let map = map_file(Some(&bytes), 0);
    // Misaligned window for 4-byte elements (the map itself is page aligned).
    expect(
        b,
        "mapped at offset 1, align 4",
        HostStorage::mapped(map.clone(), 1, 8, 4),
        Error::Misaligned { what: "mapped tensor".into(), offset: 1, align: 4 },
    );
    expect(
        b,
        "mapped at offset 6, align 4",
        HostStorage::mapped(map.clone(), 6, 8, 4),
        Error::Misaligned { what: "mapped tensor".into(), offset: 6, align: 4 },
    );
    // A window beyond the file, and one whose end overflows.
    expect(
        b,
        "mapped 60..68 of 64",
        HostStorage::mapped(map.clone(), 60, 8, 1),
        Error::OutOfBounds { what: "mapped tensor".into(), offset: 60, len: 8, size: 64 },
    );
    expect(
        b,
        "mapped offset overflow",
        HostStorage::mapped(map.clone(), usize::MAX, 2, 1),
        Error::OutOfBounds { what: "mapped tensor".into(), offset: usize::MAX, len: 2, size: 64 },
    );
    // An aligned window works, reads the file's bytes, and refuses writes.
    let s = HostStorage::mapped(map, 8, 16, 4).expect("aligned window");
    let mut t = Tensor::new(s, DType::U32, &[4]).expect("16 bytes as u32 [4]");
    assert_eq!(read_bytes(b, &t), bytes[8..24].to_vec(), "{}", b.name());
    expect(
        b,
        "write into a mapping",
        b.write(&mut t, &[0; 16]),
        Error::ReadOnly { op: "write", tensor: "dst" },
    );
    assert_eq!(read_bytes(b, &t), bytes[8..24].to_vec(), "{}: mapping unchanged", b.name());
}

fn mapped_weights_are_read_in_place(b: &impl HostBackend) {
    // A weight used in place from a mapped file gives the same result as an owned copy.
    let mut rng = Rng::new(7);
    let wv = random_values(&mut rng, DType::BF16, 5 * 33);
    let bytes = memwall_runtime::dtype::encode_f32(DType::BF16, &wv).expect("bf16");
    let owned = Linear::plain(b.upload(DType::BF16, &[5, 33], &bytes).expect("upload"));
    let in_place = Linear::plain(mapped(DType::BF16, &[5, 33], &bytes));
    let x = rnd(b, &mut rng, DType::F32, &[2, 33]);
    let (mut y1, mut y2) = (poisoned(b, DType::F32, &[2, 5]), poisoned(b, DType::F32, &[2, 5]));
    b.linear(&x, &owned, &mut y1).unwrap_or_else(|e| panic!("{}: owned linear: {e}", b.name()));
    b.linear(&x, &in_place, &mut y2).unwrap_or_else(|e| panic!("{}: mapped linear: {e}", b.name()));
    assert_eq!(read_bytes(b, &y1), read_bytes(b, &y2), "{}: mapped vs owned weight", b.name());
}

// ---------------------------------------------------------------------------------------------
// Shape, dtype and argument checks, op by op

fn linear_errors(b: &impl HostBackend) {
    let op = "linear";
    let (m, n, k) = (2, 5, 7);
    let x = z(b, DType::F32, &[m, k]);
    let mut y = z(b, DType::F32, &[m, n]);
    let w = |dt: DType, shape: &[usize]| Linear::plain(z(b, dt, shape));
    let with = |scale: WeightScale<HostStorage>| Linear { weight: z(b, DType::F8E4M3Fn, &[n, k]), scale };

    // The weight.
    expect(
        b,
        "u32 weight",
        b.linear(&x, &w(DType::U32, &[n, k]), &mut y),
        dtype(op, "weight", DType::U32, &DType::FLOATS),
    );
    expect(
        b,
        "rank-1 weight",
        b.linear(&x, &w(DType::F32, &[n]), &mut y),
        shape(op, "weight", &[n], "[_, _]"),
    );
    expect(
        b,
        "rank-3 weight",
        b.linear(&x, &w(DType::F32, &[1, n, k]), &mut y),
        shape(op, "weight", &[1, n, k], "[_, _]"),
    );
    expect(
        b,
        "empty weight",
        b.linear(&x, &w(DType::F32, &[n, 0]), &mut y),
        shape(op, "weight", &[n, 0], "no zero-sized dimension"),
    );
    expect(
        b,
        "empty weight rows",
        b.linear(&x, &w(DType::BF16, &[0, k]), &mut y),
        shape(op, "weight", &[0, k], "no zero-sized dimension"),
    );
    // Its scale.
    for s in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        expect(
            b,
            "non-finite per-tensor scale",
            b.linear(&x, &with(WeightScale::PerTensor(s)), &mut y),
            argument(op, format!("per-tensor scale {s} is not finite")),
        );
    }
    expect(
        b,
        "f16 per-channel scale",
        b.linear(&x, &with(WeightScale::PerChannel(z(b, DType::F16, &[n]))), &mut y),
        dtype(op, "scale", DType::F16, SCALES),
    );
    expect(
        b,
        "e4m3fn per-channel scale",
        b.linear(&x, &with(WeightScale::PerChannel(z(b, DType::F8E4M3Fn, &[n]))), &mut y),
        dtype(op, "scale", DType::F8E4M3Fn, SCALES),
    );
    for bad in [vec![n + 1], vec![n, 2], vec![1, n], vec![n, 1, 1], vec![k]] {
        expect(
            b,
            "per-channel scale shape",
            b.linear(&x, &with(WeightScale::PerChannel(z(b, DType::F32, &bad))), &mut y),
            shape(op, "scale", &bad, &format!("[{n}] or [{n}, 1]")),
        );
    }
    for (br, bc) in [(0, 128), (128, 0), (0, 0)] {
        let scales = z(b, DType::F32, &[1, 1]);
        expect(
            b,
            "zero block",
            b.linear(&x, &with(WeightScale::Block { block_rows: br, block_cols: bc, scales }), &mut y),
            argument(op, format!("block scale of {br}x{bc}")),
        );
    }
    let block =
        |dt: DType, s: &[usize]| WeightScale::Block { block_rows: 3, block_cols: 5, scales: z(b, dt, s) };
    expect(
        b,
        "f16 block scale",
        b.linear(&x, &with(block(DType::F16, &[2, 2])), &mut y),
        dtype(op, "scale", DType::F16, SCALES),
    );
    // ceil(5 / 3) = 2 block rows, ceil(7 / 5) = 2 block columns.
    for bad in [vec![2, 1], vec![1, 2], vec![3, 2], vec![2], vec![2, 2, 1]] {
        expect(
            b,
            "block scale shape",
            b.linear(&x, &with(block(DType::BF16, &bad)), &mut y),
            shape(op, "scale", &bad, "[2, 2]"),
        );
    }
    // x and y.
    let good = w(DType::BF16, &[n, k]);
    expect(
        b,
        "e4m3fn x",
        b.linear(&z(b, DType::F8E4M3Fn, &[m, k]), &good, &mut y),
        dtype(op, "x", DType::F8E4M3Fn, &DType::ACTIVATIONS),
    );
    expect(
        b,
        "u32 y",
        b.linear(&x, &good, &mut z(b, DType::U32, &[m, n])),
        dtype(op, "y", DType::U32, &DType::ACTIVATIONS),
    );
    expect(
        b,
        "x with the wrong k",
        b.linear(&z(b, DType::F32, &[m, k + 1]), &good, &mut y),
        shape(op, "x", &[m, k + 1], &format!("[_, {k}]")),
    );
    expect(
        b,
        "rank-1 x",
        b.linear(&z(b, DType::F32, &[k]), &good, &mut y),
        shape(op, "x", &[k], &format!("[_, {k}]")),
    );
    expect(
        b,
        "empty x",
        b.linear(&z(b, DType::F32, &[0, k]), &good, &mut z(b, DType::F32, &[0, n])),
        shape(op, "x", &[0, k], "no zero-sized dimension"),
    );
    expect(
        b,
        "y with the wrong m",
        b.linear(&x, &good, &mut z(b, DType::F32, &[m + 1, n])),
        shape(op, "y", &[m + 1, n], &format!("[{m}, {n}]")),
    );
    expect(
        b,
        "y with the wrong n",
        b.linear(&x, &good, &mut z(b, DType::BF16, &[m, n - 1])),
        shape(op, "y", &[m, n - 1], &format!("[{m}, {n}]")),
    );
}

/// gate_up_silu: each weight checked as linear's (named `w_gate` / `gate_scale` and `w_up` /
/// `up_scale`), then the pair (same shape, dtype and scaling), x, the scratch and out.
fn gate_up_silu_errors(b: &impl HostBackend) {
    let op = "gate_up_silu";
    let (m, n, k) = (2, 5, 7);
    let x = z(b, DType::F32, &[m, k]);
    let w = |dt: DType, shape: &[usize]| Linear::plain(z(b, dt, shape));
    let with = |dt: DType, scale: WeightScale<HostStorage>| Linear { weight: z(b, dt, &[n, k]), scale };
    let good = w(DType::BF16, &[n, k]);
    let f = |shape: &[usize]| z(b, DType::F32, shape);
    let (mut g, mut u, mut out) = (f(&[m, n]), f(&[m, n]), f(&[m, n]));
    let mut call = |x: &HostTensor, gate: &Linear<HostStorage>, up: &Linear<HostStorage>| {
        b.gate_up_silu(x, gate, up, (&mut g, &mut u), &mut out)
    };
    // Each weight, as linear's, under its own name.
    expect(
        b,
        "u32 gate",
        call(&x, &w(DType::U32, &[n, k]), &good),
        dtype(op, "w_gate", DType::U32, &DType::FLOATS),
    );
    expect(b, "rank-1 up", call(&x, &good, &w(DType::BF16, &[n])), shape(op, "w_up", &[n], "[_, _]"));
    expect(
        b,
        "empty up",
        call(&x, &good, &w(DType::BF16, &[n, 0])),
        shape(op, "w_up", &[n, 0], "no zero-sized dimension"),
    );
    expect(
        b,
        "f16 gate scale",
        call(&x, &with(DType::BF16, WeightScale::PerChannel(z(b, DType::F16, &[n]))), &good),
        dtype(op, "gate_scale", DType::F16, SCALES),
    );
    expect(
        b,
        "up scale shape",
        call(&x, &good, &with(DType::BF16, WeightScale::PerChannel(z(b, DType::F32, &[n + 1])))),
        shape(op, "up_scale", &[n + 1], &format!("[{n}] or [{n}, 1]")),
    );
    expect(
        b,
        "non-finite up scale",
        call(
            &x,
            &with(DType::BF16, WeightScale::PerTensor(1.0)),
            &with(DType::BF16, WeightScale::PerTensor(f32::NAN)),
        ),
        argument(op, "per-tensor scale NaN is not finite"),
    );
    // The pair: same shape, dtype and scaling.
    expect(
        b,
        "up of another n",
        call(&x, &good, &w(DType::BF16, &[n + 1, k])),
        shape(op, "w_up", &[n + 1, k], &format!("[{n}, {k}] (as w_gate)")),
    );
    expect(
        b,
        "up of another k",
        call(&x, &good, &w(DType::BF16, &[n, k + 1])),
        shape(op, "w_up", &[n, k + 1], &format!("[{n}, {k}] (as w_gate)")),
    );
    expect(
        b,
        "up of another dtype",
        call(&x, &good, &w(DType::F16, &[n, k])),
        dtype(op, "w_up", DType::F16, &[DType::BF16]),
    );
    let mismatch = |got: &str, expected: &str| Error::ScaleMismatch {
        op,
        tensor: "w_up",
        got: got.into(),
        like: "w_gate",
        expected: expected.into(),
    };
    let per_tensor = || WeightScale::PerTensor(0.5);
    let channel = |dt: DType| WeightScale::PerChannel(z(b, dt, &[n]));
    let blocks = |br: usize, bc: usize, dt: DType| WeightScale::Block {
        block_rows: br,
        block_cols: bc,
        scales: z(b, dt, &[n.div_ceil(br), k.div_ceil(bc)]),
    };
    let fp8 = |s: WeightScale<HostStorage>| with(DType::F8E4M3Fn, s);
    for (gate, up, want) in [
        (fp8(WeightScale::None), fp8(per_tensor()), mismatch("per tensor", "unscaled")),
        (fp8(per_tensor()), fp8(channel(DType::F32)), mismatch("per channel (f32)", "per tensor")),
        (
            fp8(channel(DType::F32)),
            fp8(channel(DType::BF16)),
            mismatch("per channel (bf16)", "per channel (f32)"),
        ),
        (
            fp8(blocks(2, 3, DType::F32)),
            fp8(blocks(2, 4, DType::F32)),
            mismatch("in 2x4 blocks (f32)", "in 2x3 blocks (f32)"),
        ),
        (
            fp8(blocks(2, 3, DType::F32)),
            fp8(blocks(2, 3, DType::BF16)),
            mismatch("in 2x3 blocks (bf16)", "in 2x3 blocks (f32)"),
        ),
        (
            fp8(channel(DType::F32)),
            fp8(blocks(1, k, DType::F32)),
            mismatch(&format!("in 1x{k} blocks (f32)"), "per channel (f32)"),
        ),
    ] {
        expect(b, "scaled unlike", call(&x, &gate, &up), want);
    }
    // Alike is fine: per-tensor scales of other values; [n] and [n, 1] per-channel scales.
    call(&x, &fp8(WeightScale::PerTensor(0.25)), &fp8(per_tensor())).expect("per-tensor scales");
    call(&x, &fp8(channel(DType::BF16)), &fp8(WeightScale::PerChannel(z(b, DType::BF16, &[n, 1]))))
        .expect("[n] and [n, 1] scales");
    // x.
    expect(
        b,
        "fp8 x",
        call(&z(b, DType::F8E4M3Fn, &[m, k]), &good, &good),
        dtype(op, "x", DType::F8E4M3Fn, &DType::ACTIVATIONS),
    );
    expect(
        b,
        "x with the wrong k",
        call(&z(b, DType::F32, &[m, k + 1]), &good, &good),
        shape(op, "x", &[m, k + 1], &format!("[_, {k}]")),
    );
    expect(
        b,
        "empty x",
        call(&z(b, DType::F32, &[0, k]), &good, &good),
        shape(op, "x", &[0, k], "no zero-sized dimension"),
    );
    // The scratch and out: f32 [m, n] each.
    let mn = format!("[{m}, {n}]");
    for (name, which) in [("gate", 0), ("up", 1), ("out", 2)] {
        for (bad, want) in [
            (z(b, DType::BF16, &[m, n]), dtype(op, name, DType::BF16, F32)),
            (f(&[m + 1, n]), shape(op, name, &[m + 1, n], &mn)),
            (f(&[m, n - 1]), shape(op, name, &[m, n - 1], &mn)),
            (f(&[m * n]), shape(op, name, &[m * n], &mn)),
        ] {
            let mut t = [f(&[m, n]), f(&[m, n]), f(&[m, n])];
            t[which] = bad;
            let [mut g, mut u, mut o] = t;
            expect(b, "scratch or out", b.gate_up_silu(&x, &good, &good, (&mut g, &mut u), &mut o), want);
        }
    }
}

/// `qkv`: each product checked as `linear`, under its own names (`w_k`, `v_scale`, `y_q`, ...);
/// one x for all three. Nothing is written on an error.
fn qkv_errors(b: &impl HostBackend) {
    let op = "qkv";
    let (m, k, widths) = (2, 7, [6, 3, 3]);
    let x = z(b, DType::F32, &[m, k]);
    let good: Vec<_> = widths.iter().map(|&n| Linear::plain(z(b, DType::BF16, &[n, k]))).collect();
    let ys = || widths.map(|n| poisoned(b, DType::F32, &[m, n]));
    let run = |x: &HostTensor, w: [&Linear<HostStorage>; 3], mut y: [HostTensor; 3]| {
        let [q, kk, v] = &mut y;
        let r = b.qkv(x, w, [q, kk, v]);
        for t in &y {
            assert_poisoned(b, "qkv output after an error", t);
        }
        r
    };
    let [wq, wk, wv] = [&good[0], &good[1], &good[2]];
    let u32_k = Linear::plain(z(b, DType::U32, &[3, k]));
    expect(b, "u32 w_k", run(&x, [wq, &u32_k, wv], ys()), dtype(op, "w_k", DType::U32, &DType::FLOATS));
    let scaled_v =
        Linear { weight: z(b, DType::BF16, &[3, k]), scale: WeightScale::PerChannel(z(b, DType::F32, &[4])) };
    expect(
        b,
        "v scale shape",
        run(&x, [wq, wk, &scaled_v], ys()),
        shape(op, "v_scale", &[4], "[3] or [3, 1]"),
    );
    let narrow_q = Linear::plain(z(b, DType::BF16, &[6, k + 1]));
    expect(
        b,
        "q of another k",
        run(&x, [&narrow_q, wk, wv], ys()),
        shape(op, "x", &[m, k], &format!("[_, {}]", k + 1)),
    );
    expect(
        b,
        "u8-like x",
        run(&z(b, DType::F8E4M3Fn, &[m, k]), [wq, wk, wv], ys()),
        dtype(op, "x", DType::F8E4M3Fn, &DType::ACTIVATIONS),
    );
    for (i, name) in ["y_q", "y_k", "y_v"].into_iter().enumerate() {
        let mut y = ys();
        y[i] = poisoned(b, DType::F32, &[m + 1, widths[i]]);
        let want = shape(op, name, &[m + 1, widths[i]], &format!("[{m}, {}]", widths[i]));
        expect(b, "y shape", run(&x, [wq, wk, wv], y), want);
    }
    let mut y = ys();
    y[2] = poisoned(b, DType::U32, &[m, widths[2]]);
    expect(b, "u32 y_v", run(&x, [wq, wk, wv], y), dtype(op, "y_v", DType::U32, &DType::ACTIVATIONS));
}

fn rms_norm_errors(b: &impl HostBackend) {
    let op = "rms_norm";
    let (rows, cols) = (3, 17);
    let x = z(b, DType::F32, &[rows, cols]);
    let w = z(b, DType::BF16, &[cols]);
    let mut y = z(b, DType::F32, &[rows, cols]);
    let eps = 1e-5;
    expect(
        b,
        "bf16 x",
        b.rms_norm(&z(b, DType::BF16, &[rows, cols]), &w, eps, &mut y),
        dtype(op, "x", DType::BF16, F32),
    );
    expect(
        b,
        "f16 y",
        b.rms_norm(&x, &w, eps, &mut z(b, DType::F16, &[rows, cols])),
        dtype(op, "y", DType::F16, F32),
    );
    expect(
        b,
        "u32 weight",
        b.rms_norm(&x, &z(b, DType::U32, &[cols]), eps, &mut y),
        dtype(op, "weight", DType::U32, &DType::FLOATS),
    );
    expect(
        b,
        "rank-3 x",
        b.rms_norm(&z(b, DType::F32, &[1, rows, cols]), &w, eps, &mut y),
        shape(op, "x", &[1, rows, cols], "[_, _]"),
    );
    expect(
        b,
        "empty x",
        b.rms_norm(&z(b, DType::F32, &[0, cols]), &w, eps, &mut z(b, DType::F32, &[0, cols])),
        shape(op, "x", &[0, cols], "no zero-sized dimension"),
    );
    expect(
        b,
        "weight length",
        b.rms_norm(&x, &z(b, DType::F32, &[cols + 1]), eps, &mut y),
        shape(op, "weight", &[cols + 1], &format!("[{cols}]")),
    );
    expect(
        b,
        "rank-2 weight",
        b.rms_norm(&x, &z(b, DType::F32, &[1, cols]), eps, &mut y),
        shape(op, "weight", &[1, cols], &format!("[{cols}]")),
    );
    expect(
        b,
        "y shape",
        b.rms_norm(&x, &w, eps, &mut z(b, DType::F32, &[rows, cols, 1])),
        shape(op, "y", &[rows, cols, 1], &format!("[{rows}, {cols}]")),
    );
    for bad in [0.0f32, -1e-5, f32::NAN, f32::INFINITY, -0.0] {
        expect(
            b,
            "bad eps",
            b.rms_norm(&x, &w, bad, &mut y),
            argument(op, format!("eps {bad} must be finite and > 0")),
        );
    }
}

fn rope_errors(b: &impl HostBackend) {
    let op = "rope";
    let (rows, heads, hd) = (2, 3, 8);
    let mut x = z(b, DType::F32, &[rows, heads, hd]);
    let pos = z(b, DType::U32, &[rows]);
    let rope = Rope { head_dim: hd, theta: 10_000.0, scaling: None };
    for bad_hd in [0, 3, 7] {
        let r = Rope { head_dim: bad_hd, ..rope.clone() };
        expect(
            b,
            "bad head_dim",
            b.rope(&mut x, &pos, &r),
            argument(op, format!("head_dim {bad_hd} must be even and positive")),
        );
    }
    for theta in [1.0, 0.5, -10.0, f64::NAN, f64::INFINITY] {
        let r = Rope { theta, ..rope.clone() };
        expect(
            b,
            "bad theta",
            b.rope(&mut x, &pos, &r),
            argument(op, format!("theta {theta} must be finite and > 1")),
        );
    }
    let good = Llama3RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    for s in [
        Llama3RopeScaling { factor: 0.5, ..good },
        Llama3RopeScaling { factor: f64::NAN, ..good },
        Llama3RopeScaling { factor: f64::INFINITY, ..good },
        Llama3RopeScaling { low_freq_factor: 0.0, ..good },
        Llama3RopeScaling { high_freq_factor: 1.0, ..good },
        Llama3RopeScaling { original_max_position_embeddings: 0, ..good },
    ] {
        let r = Rope { scaling: Some(s), ..rope.clone() };
        expect(
            b,
            "bad llama3 scaling",
            b.rope(&mut x, &pos, &r),
            argument(op, format!("invalid llama3 rope scaling {s:?}")),
        );
    }
    expect(
        b,
        "bf16 x",
        b.rope(&mut z(b, DType::BF16, &[rows, heads, hd]), &pos, &rope),
        dtype(op, "x", DType::BF16, F32),
    );
    expect(
        b,
        "f32 positions",
        b.rope(&mut x, &z(b, DType::F32, &[rows]), &rope),
        dtype(op, "positions", DType::F32, U32S),
    );
    expect(
        b,
        "x head_dim",
        b.rope(&mut z(b, DType::F32, &[rows, heads, hd + 2]), &pos, &rope),
        shape(op, "x", &[rows, heads, hd + 2], &format!("[_, _, {hd}]")),
    );
    expect(
        b,
        "rank-2 x",
        b.rope(&mut z(b, DType::F32, &[rows, hd]), &pos, &rope),
        shape(op, "x", &[rows, hd], &format!("[_, _, {hd}]")),
    );
    expect(
        b,
        "empty x",
        b.rope(&mut z(b, DType::F32, &[rows, 0, hd]), &pos, &rope),
        shape(op, "x", &[rows, 0, hd], "no zero-sized dimension"),
    );
    expect(
        b,
        "positions length",
        b.rope(&mut x, &z(b, DType::U32, &[rows + 1]), &rope),
        shape(op, "positions", &[rows + 1], &format!("[{rows}]")),
    );
}

fn elementwise_errors(b: &impl HostBackend) {
    let (rows, cols) = (3, 5);
    let f = |s: &[usize]| z(b, DType::F32, s);
    let g = f(&[rows, cols]);
    let u = f(&[rows, cols]);
    let mut out = f(&[rows, cols]);
    let rc = format!("[{rows}, {cols}]");
    let op = "silu_mul";
    expect(
        b,
        "bf16 gate",
        b.silu_mul(&z(b, DType::BF16, &[rows, cols]), &u, &mut out),
        dtype(op, "gate", DType::BF16, F32),
    );
    expect(
        b,
        "f16 up",
        b.silu_mul(&g, &z(b, DType::F16, &[rows, cols]), &mut out),
        dtype(op, "up", DType::F16, F32),
    );
    expect(
        b,
        "bf16 out",
        b.silu_mul(&g, &u, &mut z(b, DType::BF16, &[rows, cols])),
        dtype(op, "out", DType::BF16, F32),
    );
    expect(b, "rank-1 gate", b.silu_mul(&f(&[cols]), &u, &mut out), shape(op, "gate", &[cols], "[_, _]"));
    expect(
        b,
        "empty gate",
        b.silu_mul(&f(&[rows, 0]), &f(&[rows, 0]), &mut f(&[rows, 0])),
        shape(op, "gate", &[rows, 0], "no zero-sized dimension"),
    );
    expect(
        b,
        "up shape",
        b.silu_mul(&g, &f(&[rows, cols + 1]), &mut out),
        shape(op, "up", &[rows, cols + 1], &rc),
    );
    expect(b, "out shape", b.silu_mul(&g, &u, &mut f(&[cols, rows])), shape(op, "out", &[cols, rows], &rc));
    let op = "add_assign";
    expect(
        b,
        "bf16 x",
        b.add_assign(&mut z(b, DType::BF16, &[rows, cols]), &u),
        dtype(op, "x", DType::BF16, F32),
    );
    expect(
        b,
        "u32 y",
        b.add_assign(&mut out, &z(b, DType::U32, &[rows, cols])),
        dtype(op, "y", DType::U32, F32),
    );
    expect(
        b,
        "rank-3 x",
        b.add_assign(&mut f(&[1, rows, cols]), &u),
        shape(op, "x", &[1, rows, cols], "[_, _]"),
    );
    expect(
        b,
        "empty x",
        b.add_assign(&mut f(&[0, cols]), &f(&[0, cols])),
        shape(op, "x", &[0, cols], "no zero-sized dimension"),
    );
    expect(
        b,
        "y shape",
        b.add_assign(&mut out, &f(&[rows + 1, cols])),
        shape(op, "y", &[rows + 1, cols], &rc),
    );
}

fn embedding_errors(b: &impl HostBackend) {
    let op = "embedding";
    let (vocab, cols, rows) = (11, 6, 3);
    let table = Linear::plain(z(b, DType::BF16, &[vocab, cols]));
    let ids = z(b, DType::U32, &[rows]);
    let mut out = z(b, DType::F32, &[rows, cols]);
    expect(
        b,
        "u32 table",
        b.embedding(&Linear::plain(z(b, DType::U32, &[vocab, cols])), &ids, &mut out),
        dtype(op, "weight", DType::U32, &DType::FLOATS),
    );
    expect(
        b,
        "rank-1 table",
        b.embedding(&Linear::plain(z(b, DType::F32, &[vocab])), &ids, &mut out),
        shape(op, "weight", &[vocab], "[_, _]"),
    );
    expect(
        b,
        "empty table",
        b.embedding(&Linear::plain(z(b, DType::F32, &[0, cols])), &ids, &mut out),
        shape(op, "weight", &[0, cols], "no zero-sized dimension"),
    );
    let scaled =
        |s: WeightScale<HostStorage>| Linear { weight: z(b, DType::F8E4M3Fnuz, &[vocab, cols]), scale: s };
    expect(
        b,
        "per-channel scale shape",
        b.embedding(&scaled(WeightScale::PerChannel(z(b, DType::F32, &[cols]))), &ids, &mut out),
        shape(op, "scale", &[cols], &format!("[{vocab}] or [{vocab}, 1]")),
    );
    expect(
        b,
        "nan per-tensor scale",
        b.embedding(&scaled(WeightScale::PerTensor(f32::NAN)), &ids, &mut out),
        argument(op, "per-tensor scale NaN is not finite"),
    );
    let blk = WeightScale::Block { block_rows: 4, block_cols: 4, scales: z(b, DType::F32, &[3, 1]) };
    expect(
        b,
        "block scale shape",
        b.embedding(&scaled(blk), &ids, &mut out),
        shape(op, "scale", &[3, 1], "[3, 2]"),
    );
    expect(
        b,
        "f32 ids",
        b.embedding(&table, &z(b, DType::F32, &[rows]), &mut out),
        dtype(op, "ids", DType::F32, U32S),
    );
    expect(
        b,
        "rank-2 ids",
        b.embedding(&table, &z(b, DType::U32, &[rows, 1]), &mut out),
        shape(op, "ids", &[rows, 1], "[_]"),
    );
    expect(
        b,
        "empty ids",
        b.embedding(&table, &z(b, DType::U32, &[0]), &mut z(b, DType::F32, &[0, cols])),
        shape(op, "ids", &[0], "no zero-sized dimension"),
    );
    expect(
        b,
        "bf16 out",
        b.embedding(&table, &ids, &mut z(b, DType::BF16, &[rows, cols])),
        dtype(op, "out", DType::BF16, F32),
    );
    expect(
        b,
        "out shape",
        b.embedding(&table, &ids, &mut z(b, DType::F32, &[rows, cols + 1])),
        shape(op, "out", &[rows, cols + 1], &format!("[{rows}, {cols}]")),
    );
}

/// `[blocks, block_size, kv_heads, head_dim]` caches of `dt` (with the contiguous table `[[0],
/// [1]]`, `[slots, capacity, kv_heads, head_dim]`).
fn cache(b: &impl HostBackend, dt: DType, s: &[usize]) -> KvCacheLayer<HostStorage> {
    KvCacheLayer { k: z(b, dt, s), v: z(b, dt, s) }
}

fn kv_store_errors(b: &impl HostBackend) {
    let op = "kv_store";
    let (slots, cap, kvh, hd, rows) = (2, 8, 2, 4, 3);
    let cs = [slots, cap, kvh, hd];
    let mut c = cache(b, DType::BF16, &cs);
    let bt = upload_u32(b, &[slots, 1], &[0, 1]);
    let f = |s: &[usize]| z(b, DType::F32, s);
    let k = f(&[rows, kvh, hd]);
    let v = f(&[rows, kvh, hd]);
    let sl = z(b, DType::U32, &[rows]);
    let ps = z(b, DType::U32, &[rows]);
    let mut bad = KvCacheLayer { k: z(b, DType::F8E4M3Fn, &cs), v: z(b, DType::BF16, &cs) };
    expect(
        b,
        "fp8 k cache",
        b.kv_store(&k, &v, &mut bad, &bt, &sl, &ps),
        dtype(op, "k_cache", DType::F8E4M3Fn, CACHES),
    );
    let mut bad = KvCacheLayer { k: z(b, DType::BF16, &cs), v: z(b, DType::U32, &cs) };
    expect(
        b,
        "u32 v cache",
        b.kv_store(&k, &v, &mut bad, &bt, &sl, &ps),
        dtype(op, "v_cache", DType::U32, CACHES),
    );
    expect(
        b,
        "rank-3 cache",
        b.kv_store(&k, &v, &mut cache(b, DType::F32, &[cap, kvh, hd]), &bt, &sl, &ps),
        shape(op, "k_cache", &[cap, kvh, hd], "[_, _, _, _]"),
    );
    expect(
        b,
        "empty cache",
        b.kv_store(&k, &v, &mut cache(b, DType::F32, &[0, cap, kvh, hd]), &bt, &sl, &ps),
        shape(op, "k_cache", &[0, cap, kvh, hd], "no zero-sized dimension"),
    );
    let mut bad = KvCacheLayer { k: z(b, DType::F16, &cs), v: z(b, DType::F16, &[slots, cap + 1, kvh, hd]) };
    expect(
        b,
        "v cache shape",
        b.kv_store(&k, &v, &mut bad, &bt, &sl, &ps),
        shape(op, "v_cache", &[slots, cap + 1, kvh, hd], &format!("{cs:?} (as k_cache)")),
    );
    expect(
        b,
        "bf16 k",
        b.kv_store(&z(b, DType::BF16, &[rows, kvh, hd]), &v, &mut c, &bt, &sl, &ps),
        dtype(op, "k", DType::BF16, F32),
    );
    expect(
        b,
        "f16 v",
        b.kv_store(&k, &z(b, DType::F16, &[rows, kvh, hd]), &mut c, &bt, &sl, &ps),
        dtype(op, "v", DType::F16, F32),
    );
    let kshape = format!("[_, {kvh}, {hd}]");
    expect(
        b,
        "k kv heads",
        b.kv_store(&f(&[rows, kvh + 1, hd]), &v, &mut c, &bt, &sl, &ps),
        shape(op, "k", &[rows, kvh + 1, hd], &kshape),
    );
    expect(
        b,
        "k head_dim",
        b.kv_store(&f(&[rows, kvh, hd - 1]), &v, &mut c, &bt, &sl, &ps),
        shape(op, "k", &[rows, kvh, hd - 1], &kshape),
    );
    expect(
        b,
        "empty k",
        b.kv_store(
            &f(&[0, kvh, hd]),
            &f(&[0, kvh, hd]),
            &mut c,
            &bt,
            &z(b, DType::U32, &[0]),
            &z(b, DType::U32, &[0]),
        ),
        shape(op, "k", &[0, kvh, hd], "no zero-sized dimension"),
    );
    expect(
        b,
        "v rows",
        b.kv_store(&k, &f(&[rows + 1, kvh, hd]), &mut c, &bt, &sl, &ps),
        shape(op, "v", &[rows + 1, kvh, hd], &format!("[{rows}, {kvh}, {hd}]")),
    );
    expect(
        b,
        "f32 slots",
        b.kv_store(&k, &v, &mut c, &bt, &f(&[rows]), &ps),
        dtype(op, "slots", DType::F32, U32S),
    );
    expect(
        b,
        "slots length",
        b.kv_store(&k, &v, &mut c, &bt, &z(b, DType::U32, &[rows - 1]), &ps),
        shape(op, "slots", &[rows - 1], &format!("[{rows}]")),
    );
    expect(
        b,
        "f32 positions",
        b.kv_store(&k, &v, &mut c, &bt, &sl, &f(&[rows])),
        dtype(op, "positions", DType::F32, U32S),
    );
    expect(
        b,
        "positions rank",
        b.kv_store(&k, &v, &mut c, &bt, &sl, &z(b, DType::U32, &[rows, 1])),
        shape(op, "positions", &[rows, 1], &format!("[{rows}]")),
    );
    block_table_errors(op, b, &mut |t| b.kv_store(&k, &v, &mut c, t, &sl, &ps));
}

/// The block table: u32, rank 2, nonempty.
fn block_table_errors(
    op: &'static str,
    b: &impl HostBackend,
    call: &mut dyn FnMut(&HostTensor) -> memwall_runtime::Result<()>,
) {
    expect(
        b,
        "f32 block table",
        call(&z(b, DType::F32, &[2, 1])),
        dtype(op, "block_table", DType::F32, U32S),
    );
    expect(b, "rank-1 block table", call(&z(b, DType::U32, &[2])), shape(op, "block_table", &[2], "[_, _]"));
    expect(
        b,
        "empty block table",
        call(&z(b, DType::U32, &[2, 0])),
        shape(op, "block_table", &[2, 0], "no zero-sized dimension"),
    );
}

fn attention_errors(b: &impl HostBackend) {
    let op = "attention";
    let (slots, cap, kvh, hd, rows, heads) = (2, 8, 2, 4, 3, 4);
    let cs = [slots, cap, kvh, hd];
    let c = cache(b, DType::F16, &cs);
    let bt = upload_u32(b, &[slots, 1], &[0, 1]);
    let f = |s: &[usize]| z(b, DType::F32, s);
    let q = f(&[rows, heads, hd]);
    let sl = z(b, DType::U32, &[rows]);
    let ps = z(b, DType::U32, &[rows]);
    let mut out = f(&[rows, heads, hd]);
    let sc = 0.5;
    let bad = KvCacheLayer { k: z(b, DType::F8E5M2, &cs), v: z(b, DType::F16, &cs) };
    expect(
        b,
        "fp8 k cache",
        b.attention(&q, &bad, &bt, &sl, &ps, sc, &mut out),
        dtype(op, "k_cache", DType::F8E5M2, CACHES),
    );
    let bad = KvCacheLayer { k: z(b, DType::F16, &cs), v: z(b, DType::F16, &[slots, cap, kvh, hd + 1]) };
    expect(
        b,
        "v cache shape",
        b.attention(&q, &bad, &bt, &sl, &ps, sc, &mut out),
        shape(op, "v_cache", &[slots, cap, kvh, hd + 1], &format!("{cs:?} (as k_cache)")),
    );
    expect(
        b,
        "empty cache",
        b.attention(&q, &cache(b, DType::F16, &[slots, 0, kvh, hd]), &bt, &sl, &ps, sc, &mut out),
        shape(op, "k_cache", &[slots, 0, kvh, hd], "no zero-sized dimension"),
    );
    expect(
        b,
        "bf16 q",
        b.attention(&z(b, DType::BF16, &[rows, heads, hd]), &c, &bt, &sl, &ps, sc, &mut out),
        dtype(op, "q", DType::BF16, F32),
    );
    expect(
        b,
        "f16 out",
        b.attention(&q, &c, &bt, &sl, &ps, sc, &mut z(b, DType::F16, &[rows, heads, hd])),
        dtype(op, "out", DType::F16, F32),
    );
    expect(
        b,
        "q head_dim",
        b.attention(&f(&[rows, heads, hd * 2]), &c, &bt, &sl, &ps, sc, &mut out),
        shape(op, "q", &[rows, heads, hd * 2], &format!("[_, _, {hd}]")),
    );
    expect(
        b,
        "rank-2 q",
        b.attention(&f(&[rows, hd]), &c, &bt, &sl, &ps, sc, &mut out),
        shape(op, "q", &[rows, hd], &format!("[_, _, {hd}]")),
    );
    expect(
        b,
        "empty q",
        b.attention(
            &f(&[0, heads, hd]),
            &c,
            &bt,
            &z(b, DType::U32, &[0]),
            &z(b, DType::U32, &[0]),
            sc,
            &mut f(&[0, heads, hd]),
        ),
        shape(op, "q", &[0, heads, hd], "no zero-sized dimension"),
    );
    for bad_heads in [1, 3, 5] {
        expect(
            b,
            "heads not a multiple of kv heads",
            b.attention(&f(&[rows, bad_heads, hd]), &c, &bt, &sl, &ps, sc, &mut f(&[rows, bad_heads, hd])),
            argument(op, format!("{bad_heads} query heads is not a multiple of {kvh} kv heads")),
        );
    }
    expect(
        b,
        "out shape",
        b.attention(&q, &c, &bt, &sl, &ps, sc, &mut f(&[rows, heads + 2, hd])),
        shape(op, "out", &[rows, heads + 2, hd], &format!("[{rows}, {heads}, {hd}]")),
    );
    expect(
        b,
        "f32 slots",
        b.attention(&q, &c, &bt, &f(&[rows]), &ps, sc, &mut out),
        dtype(op, "slots", DType::F32, U32S),
    );
    expect(
        b,
        "slots length",
        b.attention(&q, &c, &bt, &z(b, DType::U32, &[rows + 1]), &ps, sc, &mut out),
        shape(op, "slots", &[rows + 1], &format!("[{rows}]")),
    );
    expect(
        b,
        "bf16 positions",
        b.attention(&q, &c, &bt, &sl, &z(b, DType::BF16, &[rows]), sc, &mut out),
        dtype(op, "positions", DType::BF16, U32S),
    );
    expect(
        b,
        "positions length",
        b.attention(&q, &c, &bt, &sl, &z(b, DType::U32, &[1]), sc, &mut out),
        shape(op, "positions", &[1], &format!("[{rows}]")),
    );
    for bad in [0.0f32, -0.0, -0.125, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        expect(
            b,
            "bad softmax scale",
            b.attention(&q, &c, &bt, &sl, &ps, bad, &mut out),
            argument(op, format!("softmax scale {bad} must be finite and > 0")),
        );
    }
    block_table_errors(op, b, &mut |t| b.attention(&q, &c, t, &sl, &ps, sc, &mut out));
}

fn router_topk_errors(b: &impl HostBackend) {
    let op = "router_topk";
    let (rows, experts, k) = (3, 8, 2);
    let logits = z(b, DType::F32, &[rows, experts]);
    let mut ids = z(b, DType::U32, &[rows, k]);
    let mut w = z(b, DType::F32, &[rows, k]);
    expect(
        b,
        "bf16 logits",
        b.router_topk(&z(b, DType::BF16, &[rows, experts]), k, &mut ids, &mut w),
        dtype(op, "logits", DType::BF16, F32),
    );
    expect(
        b,
        "rank-1 logits",
        b.router_topk(&z(b, DType::F32, &[experts]), k, &mut ids, &mut w),
        shape(op, "logits", &[experts], "[_, _]"),
    );
    expect(
        b,
        "empty logits",
        b.router_topk(&z(b, DType::F32, &[rows, 0]), k, &mut ids, &mut w),
        shape(op, "logits", &[rows, 0], "no zero-sized dimension"),
    );
    for bad_k in [0, experts + 1, usize::MAX] {
        expect(
            b,
            "bad k",
            b.router_topk(&logits, bad_k, &mut ids, &mut w),
            argument(op, format!("top-{bad_k} of {experts} experts")),
        );
    }
    expect(
        b,
        "f32 ids",
        b.router_topk(&logits, k, &mut z(b, DType::F32, &[rows, k]), &mut w),
        dtype(op, "ids", DType::F32, U32S),
    );
    expect(
        b,
        "u32 weights",
        b.router_topk(&logits, k, &mut ids, &mut z(b, DType::U32, &[rows, k])),
        dtype(op, "weights", DType::U32, F32),
    );
    let want = format!("[{rows}, {k}]");
    expect(
        b,
        "ids shape",
        b.router_topk(&logits, k, &mut z(b, DType::U32, &[rows, k + 1]), &mut w),
        shape(op, "ids", &[rows, k + 1], &want),
    );
    expect(
        b,
        "weights shape",
        b.router_topk(&logits, k, &mut ids, &mut z(b, DType::F32, &[rows * k])),
        shape(op, "weights", &[rows * k], &want),
    );
}

fn pick_errors(b: &impl HostBackend) {
    let (rows, vocab) = (2, 17);
    let logits = z(b, DType::F32, &[rows, vocab]);
    let mut out = z(b, DType::U32, &[rows]);
    let p = SamplingParams { temperature: 0.7, top_k: 5, top_p: 0.9 };
    let (seeds, steps) = (upload_u32(b, &[rows], &[1, 1]), upload_u32(b, &[rows], &[2, 3]));
    for op in ["argmax", "sample"] {
        let run = |l: &HostTensor, o: &mut HostTensor| -> R<()> {
            if op == "argmax" { b.argmax(l, o) } else { b.sample(l, &p, &seeds, &steps, o) }
        };
        expect(
            b,
            "f16 logits",
            run(&z(b, DType::F16, &[rows, vocab]), &mut out),
            dtype(op, "logits", DType::F16, F32),
        );
        expect(
            b,
            "rank-3 logits",
            run(&z(b, DType::F32, &[1, rows, vocab]), &mut out),
            shape(op, "logits", &[1, rows, vocab], "[_, _]"),
        );
        expect(
            b,
            "empty logits",
            run(&z(b, DType::F32, &[rows, 0]), &mut out),
            shape(op, "logits", &[rows, 0], "no zero-sized dimension"),
        );
        expect(
            b,
            "f32 out",
            run(&logits, &mut z(b, DType::F32, &[rows])),
            dtype(op, "out", DType::F32, U32S),
        );
        expect(
            b,
            "out length",
            run(&logits, &mut z(b, DType::U32, &[rows + 1])),
            shape(op, "out", &[rows + 1], &format!("[{rows}]")),
        );
    }
    // Sampling's per-row seeds and steps: u32, one per row of the logits.
    let op = "sample";
    let mut out = poisoned(b, DType::U32, &[rows]);
    for (name, other) in [("seeds", &steps), ("steps", &seeds)] {
        let run = |t: &HostTensor, out: &mut HostTensor| -> R<()> {
            if name == "seeds" {
                b.sample(&logits, &p, t, other, out)
            } else {
                b.sample(&logits, &p, other, t, out)
            }
        };
        expect(
            b,
            "f32 seeds/steps",
            run(&z(b, DType::F32, &[rows]), &mut out),
            dtype(op, name, DType::F32, U32S),
        );
        expect(
            b,
            "seeds/steps length",
            run(&z(b, DType::U32, &[rows + 1]), &mut out),
            shape(op, name, &[rows + 1], &format!("[{rows}]")),
        );
        expect(
            b,
            "rank-2 seeds/steps",
            run(&z(b, DType::U32, &[rows, 1]), &mut out),
            shape(op, name, &[rows, 1], &format!("[{rows}]")),
        );
    }
    assert_poisoned(b, "sample with bad seeds or steps", &out);
}

fn vocabulary_beyond_u32(b: &impl HostBackend) {
    // A [1, 2^32] f32 logits tensor: 16 GiB, a read-only map of a sparse file (no memory used; the
    // check refuses it before reading a byte).
    let vocab = 1usize << 32;
    let len = vocab * 4;
    let map = map_file(None, len as u64);
    let storage = HostStorage::mapped(map, 0, len, 4).expect("mapped 16 GiB");
    let logits = Tensor::new(storage, DType::F32, &[1, vocab]).expect("[1, 2^32] f32");
    let mut out = poisoned(b, DType::U32, &[1]);
    let want = |op| shape(op, "logits", &[1, vocab], "a vocabulary that fits u32");
    expect(b, "argmax over 2^32", b.argmax(&logits, &mut out), want("argmax"));
    let (seeds, steps) = (upload_u32(b, &[1], &[0]), upload_u32(b, &[1], &[0]));
    expect(
        b,
        "sample over 2^32",
        b.sample(&logits, &SamplingParams::GREEDY, &seeds, &steps, &mut out),
        want("sample"),
    );
    assert_poisoned(b, "vocabulary beyond u32", &out);
}

fn sample_param_errors(b: &impl HostBackend) {
    let op = "sample";
    let logits = z(b, DType::F32, &[1, 4]);
    let mut out = poisoned(b, DType::U32, &[1]);
    let (seeds, steps) = (upload_u32(b, &[1], &[0]), upload_u32(b, &[1], &[0]));
    for t in [-0.5f32, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let p = SamplingParams { temperature: t, top_k: 0, top_p: 1.0 };
        expect(
            b,
            "bad temperature",
            b.sample(&logits, &p, &seeds, &steps, &mut out),
            argument(op, format!("temperature {t} must be finite and >= 0")),
        );
    }
    for top_p in [0.0f32, -0.1, 1.5, f32::NAN, f32::INFINITY] {
        let p = SamplingParams { temperature: 1.0, top_k: 0, top_p };
        expect(
            b,
            "bad top_p",
            b.sample(&logits, &p, &seeds, &steps, &mut out),
            argument(op, format!("top_p {top_p} must be in (0, 1]")),
        );
    }
    assert_poisoned(b, "sample with bad params", &out);
}

fn gather_scatter_errors(b: &impl HostBackend) {
    let (rows, cols, picked) = (5, 3, 2);
    let f = |s: &[usize]| z(b, DType::F32, s);
    let u = |s: &[usize]| z(b, DType::U32, s);
    let pc = format!("[{picked}, {cols}]");
    let op = "gather_rows";
    let src = f(&[rows, cols]);
    let idx = u(&[picked]);
    let mut out = f(&[picked, cols]);
    expect(
        b,
        "bf16 src",
        b.gather_rows(&z(b, DType::BF16, &[rows, cols]), &idx, &mut out),
        dtype(op, "src", DType::BF16, F32),
    );
    expect(
        b,
        "u32 out",
        b.gather_rows(&src, &idx, &mut u(&[picked, cols])),
        dtype(op, "out", DType::U32, F32),
    );
    expect(b, "rank-1 src", b.gather_rows(&f(&[rows]), &idx, &mut out), shape(op, "src", &[rows], "[_, _]"));
    expect(
        b,
        "empty src",
        b.gather_rows(&f(&[0, cols]), &idx, &mut out),
        shape(op, "src", &[0, cols], "no zero-sized dimension"),
    );
    expect(b, "f32 idx", b.gather_rows(&src, &f(&[picked]), &mut out), dtype(op, "idx", DType::F32, U32S));
    expect(
        b,
        "rank-2 idx",
        b.gather_rows(&src, &u(&[picked, 1]), &mut out),
        shape(op, "idx", &[picked, 1], "[_]"),
    );
    expect(
        b,
        "empty idx",
        b.gather_rows(&src, &u(&[0]), &mut f(&[0, cols])),
        shape(op, "idx", &[0], "no zero-sized dimension"),
    );
    expect(
        b,
        "out shape",
        b.gather_rows(&src, &idx, &mut f(&[picked, cols + 1])),
        shape(op, "out", &[picked, cols + 1], &pc),
    );
    let op = "scatter_add_rows";
    let mut dst = f(&[rows, cols]);
    let s = f(&[picked, cols]);
    let w = f(&[picked]);
    expect(
        b,
        "f16 dst",
        b.scatter_add_rows(&mut z(b, DType::F16, &[rows, cols]), &idx, &s, &w),
        dtype(op, "dst", DType::F16, F32),
    );
    expect(
        b,
        "bf16 src",
        b.scatter_add_rows(&mut dst, &idx, &z(b, DType::BF16, &[picked, cols]), &w),
        dtype(op, "src", DType::BF16, F32),
    );
    expect(
        b,
        "rank-3 dst",
        b.scatter_add_rows(&mut f(&[1, rows, cols]), &idx, &s, &w),
        shape(op, "dst", &[1, rows, cols], "[_, _]"),
    );
    expect(
        b,
        "empty dst",
        b.scatter_add_rows(&mut f(&[rows, 0]), &idx, &f(&[picked, 0]), &w),
        shape(op, "dst", &[rows, 0], "no zero-sized dimension"),
    );
    expect(
        b,
        "f32 idx",
        b.scatter_add_rows(&mut dst, &f(&[picked]), &s, &w),
        dtype(op, "idx", DType::F32, U32S),
    );
    expect(
        b,
        "empty idx",
        b.scatter_add_rows(&mut dst, &u(&[0]), &f(&[0, cols]), &f(&[0])),
        shape(op, "idx", &[0], "no zero-sized dimension"),
    );
    expect(
        b,
        "src shape",
        b.scatter_add_rows(&mut dst, &idx, &f(&[picked + 1, cols]), &w),
        shape(op, "src", &[picked + 1, cols], &pc),
    );
    expect(
        b,
        "u32 weights",
        b.scatter_add_rows(&mut dst, &idx, &s, &u(&[picked])),
        dtype(op, "weights", DType::U32, F32),
    );
    expect(
        b,
        "weights length",
        b.scatter_add_rows(&mut dst, &idx, &s, &f(&[picked + 1])),
        shape(op, "weights", &[picked + 1], &format!("[{picked}]")),
    );
}

// ---------------------------------------------------------------------------------------------
// Read-only outputs: refused before anything is written

fn read_only_outputs(b: &impl HostBackend) {
    let mut rng = Rng::new(3);
    let ro = |op: &'static str, tensor: &'static str| Error::ReadOnly { op, tensor };
    let f = |rng: &mut Rng, s: &[usize]| rnd(b, rng, DType::F32, s);

    let x = f(&mut rng, &[2, 4]);
    let lin = Linear::plain(f(&mut rng, &[3, 4]));
    expect(
        b,
        "linear into a mapping",
        b.linear(&x, &lin, &mut mapped_poison(DType::BF16, &[2, 3])),
        ro("linear", "y"),
    );
    let w = f(&mut rng, &[4]);
    expect(
        b,
        "rms_norm into a mapping",
        b.rms_norm(&x, &w, 1e-5, &mut mapped_poison(DType::F32, &[2, 4])),
        ro("rms_norm", "y"),
    );
    let rope = Rope { head_dim: 4, theta: 10_000.0, scaling: None };
    let pos = upload_u32(b, &[2], &[0, 5]);
    let xv = random_values(&mut rng, DType::F32, 8);
    let bytes = memwall_runtime::dtype::encode_f32(DType::F32, &xv).expect("f32");
    expect(
        b,
        "rope of a mapping",
        b.rope(&mut mapped(DType::F32, &[2, 1, 4], &bytes), &pos, &rope),
        ro("rope", "x"),
    );
    let y = f(&mut rng, &[2, 4]);
    expect(
        b,
        "silu_mul into a mapping",
        b.silu_mul(&x, &y, &mut mapped_poison(DType::F32, &[2, 4])),
        ro("silu_mul", "out"),
    );
    expect(
        b,
        "add_assign into a mapping",
        b.add_assign(&mut mapped(DType::F32, &[2, 4], &bytes), &y),
        ro("add_assign", "x"),
    );
    let ids = upload_u32(b, &[2], &[1, 0]);
    expect(
        b,
        "embedding into a mapping",
        b.embedding(&lin, &ids, &mut mapped_poison(DType::F32, &[2, 4])),
        ro("embedding", "out"),
    );

    // kv_store: a writable k cache and a read-only v cache: refused, and k untouched.
    let cs = [2, 4, 1, 4];
    let (k, v) = (f(&mut rng, &[2, 1, 4]), f(&mut rng, &[2, 1, 4]));
    let slots = upload_u32(b, &[2], &[0, 1]);
    let bt = upload_u32(b, &[2, 1], &[0, 1]);
    // Valid positions (capacity 4), so only the read-only output can be refused.
    let pos = upload_u32(b, &[2], &[0, 3]);
    let mut c = KvCacheLayer { k: poisoned(b, DType::BF16, &cs), v: mapped_poison(DType::BF16, &cs) };
    expect(
        b,
        "kv_store into a mapped v cache",
        b.kv_store(&k, &v, &mut c, &bt, &slots, &pos),
        ro("kv_store", "v_cache"),
    );
    assert_poisoned(b, "kv_store k cache beside a mapped v cache", &c.k);
    let mut c = KvCacheLayer { k: mapped_poison(DType::BF16, &cs), v: poisoned(b, DType::BF16, &cs) };
    expect(
        b,
        "kv_store into a mapped k cache",
        b.kv_store(&k, &v, &mut c, &bt, &slots, &pos),
        ro("kv_store", "k_cache"),
    );
    assert_poisoned(b, "kv_store v cache beside a mapped k cache", &c.v);

    let cache = KvCacheLayer { k: rnd(b, &mut rng, DType::F32, &cs), v: rnd(b, &mut rng, DType::F32, &cs) };
    let q = f(&mut rng, &[2, 2, 4]);
    expect(
        b,
        "attention into a mapping",
        b.attention(&q, &cache, &bt, &slots, &pos, 0.5, &mut mapped_poison(DType::F32, &[2, 2, 4])),
        ro("attention", "out"),
    );

    // router: writable ids with read-only weights, and the other way round.
    let logits = f(&mut rng, &[2, 8]);
    let mut ids = poisoned(b, DType::U32, &[2, 2]);
    expect(
        b,
        "router weights into a mapping",
        b.router_topk(&logits, 2, &mut ids, &mut mapped_poison(DType::F32, &[2, 2])),
        ro("router_topk", "weights"),
    );
    assert_poisoned(b, "router ids beside mapped weights", &ids);
    let mut weights = poisoned(b, DType::F32, &[2, 2]);
    expect(
        b,
        "router ids into a mapping",
        b.router_topk(&logits, 2, &mut mapped_poison(DType::U32, &[2, 2]), &mut weights),
        ro("router_topk", "ids"),
    );
    assert_poisoned(b, "router weights beside mapped ids", &weights);

    expect(
        b,
        "argmax into a mapping",
        b.argmax(&logits, &mut mapped_poison(DType::U32, &[2])),
        ro("argmax", "out"),
    );
    let p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0 };
    let (seeds, steps) = (upload_u32(b, &[2], &[0, 0]), upload_u32(b, &[2], &[0, 1]));
    expect(
        b,
        "sample into a mapping",
        b.sample(&logits, &p, &seeds, &steps, &mut mapped_poison(DType::U32, &[2])),
        ro("sample", "out"),
    );
    let idx = upload_u32(b, &[2], &[1, 1]);
    expect(
        b,
        "gather_rows into a mapping",
        b.gather_rows(&x, &idx, &mut mapped_poison(DType::F32, &[2, 4])),
        ro("gather_rows", "out"),
    );
    let wts = f(&mut rng, &[2]);
    expect(
        b,
        "scatter_add_rows into a mapping",
        b.scatter_add_rows(&mut mapped(DType::F32, &[2, 4], &bytes), &idx, &y, &wts),
        ro("scatter_add_rows", "dst"),
    );
}

// ---------------------------------------------------------------------------------------------
// Data-dependent errors: refused before anything is written

fn token_out_of_range_writes_nothing(b: &impl HostBackend) {
    let mut rng = Rng::new(11);
    let (vocab, cols) = (13, 6);
    for dt in [DType::F32, DType::BF16, DType::F8E4M3Fn] {
        let table = Linear::plain(rnd(b, &mut rng, dt, &[vocab, cols]));
        for (idv, row, id) in
            [(vec![0, 12, 13, 1], 2, 13), (vec![u32::MAX], 0, u32::MAX), (vec![5, 5, 5, 5, 100], 4, 100)]
        {
            let ids = upload_u32(b, &[idv.len()], &idv);
            let mut out = poisoned(b, DType::F32, &[idv.len(), cols]);
            let want = Error::TokenOutOfRange { op: "embedding", row, id, vocab };
            expect(b, "embedding id beyond the vocabulary", b.embedding(&table, &ids, &mut out), want);
            assert_poisoned(b, "embedding output after TokenOutOfRange", &out);
        }
    }
}

fn cache_rows_out_of_range_write_nothing(b: &impl HostBackend) {
    let mut rng = Rng::new(12);
    // Paged: 3 slots of 3 blocks of 2 positions (capacity 6) over 10 blocks, scrambled.
    let (slots, bs, max_blocks, blocks, kvh, hd, heads) = (3, 2, 3, 10, 2, 4, 4);
    let cap = bs * max_blocks;
    let cs = [blocks, bs, kvh, hd];
    let good: Vec<u32> = vec![7, 2, 9, 0, 5, 3, 8, 1, 4];
    // Slot 2's second block is 10 (no such block); slot 1's first is u32::MAX.
    let mut bad = good.clone();
    bad[2 * max_blocks + 1] = 10;
    bad[max_blocks] = u32::MAX;
    let blk = |op, row, block| Error::BlockOutOfRange { op, row, block, blocks };
    // (slots, positions, table, the error); every other row valid.
    let cases = |op: &'static str| {
        vec![
            (vec![0, 3, 1], vec![0, 0, 0], &good, Error::SlotOutOfRange { op, row: 1, slot: 3, slots }),
            (
                vec![2, 1, u32::MAX],
                vec![4, 4, 0],
                &good,
                Error::SlotOutOfRange { op, row: 2, slot: u32::MAX, slots },
            ),
            (
                vec![0, 1, 2],
                vec![0, 1, 6],
                &good,
                Error::ContextOverflow { op, row: 2, pos: 6, capacity: cap },
            ),
            (
                vec![1, 1, 1],
                vec![u32::MAX, 0, 1],
                &good,
                Error::ContextOverflow { op, row: 0, pos: u32::MAX, capacity: cap },
            ),
            // Row 1 stores into (or reads) slot 2's bad second block.
            (vec![0, 2, 2], vec![5, 3, 0], &bad, blk(op, 1, 10)),
            // Slot 1 position 2: its own entry (block 3) is fine, its first is not.
            (vec![0, 1], vec![1, 2], &bad, blk(op, 1, u32::MAX)),
        ]
    };
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for (sv, pv, table, want) in cases("kv_store") {
            let n = sv.len();
            let (k, v) =
                (rnd(b, &mut rng, DType::F32, &[n, kvh, hd]), rnd(b, &mut rng, DType::F32, &[n, kvh, hd]));
            let mut c = KvCacheLayer { k: poisoned(b, dt, &cs), v: poisoned(b, dt, &cs) };
            let (sl, ps) = (upload_u32(b, &[n], &sv), upload_u32(b, &[n], &pv));
            let bt = upload_u32(b, &[slots, max_blocks], table);
            let r = b.kv_store(&k, &v, &mut c, &bt, &sl, &ps);
            if want == blk("kv_store", 1, u32::MAX) {
                // kv_store reads only the entry of each row's own position.
                r.unwrap_or_else(|e| panic!("{}: kv_store through good entries: {e}", b.name()));
                continue;
            }
            expect(b, "kv_store outside the cache", r, want);
            assert_poisoned(b, "k cache after a refused kv_store", &c.k);
            assert_poisoned(b, "v cache after a refused kv_store", &c.v);
        }
        let c = KvCacheLayer { k: rnd(b, &mut rng, dt, &cs), v: rnd(b, &mut rng, dt, &cs) };
        for (sv, pv, table, want) in cases("attention") {
            let n = sv.len();
            let q = rnd(b, &mut rng, DType::F32, &[n, heads, hd]);
            let (sl, ps) = (upload_u32(b, &[n], &sv), upload_u32(b, &[n], &pv));
            let bt = upload_u32(b, &[slots, max_blocks], table);
            let mut out = poisoned(b, DType::F32, &[n, heads, hd]);
            expect(b, "attention outside the cache", b.attention(&q, &c, &bt, &sl, &ps, 0.5, &mut out), want);
            assert_poisoned(b, "attention output after a refused row", &out);
        }
    }
}

fn index_out_of_range_writes_nothing(b: &impl HostBackend) {
    let mut rng = Rng::new(13);
    let (rows, cols) = (4, 3);
    let src = rnd(b, &mut rng, DType::F32, &[rows, cols]);
    for (iv, row, index) in
        [(vec![0, 3, 4], 2, 4), (vec![u32::MAX, 0], 0, u32::MAX), (vec![1, 9, 2, 2], 1, 9)]
    {
        let n = iv.len();
        let idx = upload_u32(b, &[n], &iv);
        let mut out = poisoned(b, DType::F32, &[n, cols]);
        let want = Error::IndexOutOfRange { op: "gather_rows", row, index, len: rows };
        expect(b, "gather_rows index beyond the rows", b.gather_rows(&src, &idx, &mut out), want);
        assert_poisoned(b, "gather_rows output after IndexOutOfRange", &out);

        let s = rnd(b, &mut rng, DType::F32, &[n, cols]);
        let w = rnd(b, &mut rng, DType::F32, &[n]);
        let mut dst = poisoned(b, DType::F32, &[rows, cols]);
        let want = Error::IndexOutOfRange { op: "scatter_add_rows", row, index, len: rows };
        expect(b, "scatter_add_rows index beyond the rows", b.scatter_add_rows(&mut dst, &idx, &s, &w), want);
        assert_poisoned(b, "scatter_add_rows dst after IndexOutOfRange", &dst);
    }
}

/// `experts`: the shapes and dtypes `check_experts` names, and the data errors of the picks
/// (an expert beyond the layer's, a row picking one twice), which write nothing.
fn experts_errors(b: &impl HostBackend) {
    let mut rng = Rng::new(31);
    let (rows, k, e, h, i) = (3, 2, 4, 8, 6);
    let op = "experts";
    let lin = |rng: &mut Rng, n: usize, kk: usize| Linear::plain(rnd(b, rng, DType::BF16, &[n, kk]));
    let mats: Vec<[Linear<HostStorage>; 3]> =
        (0..e).map(|_| [lin(&mut rng, i, h), lin(&mut rng, i, h), lin(&mut rng, h, i)]).collect();
    let experts: Vec<Expert<'_, HostStorage>> =
        mats.iter().map(|[gate, up, down]| Expert { gate, up, down }).collect();
    let x = rnd(b, &mut rng, DType::F32, &[rows, h]);
    let ids = upload_u32(b, &[rows, k], &[0, 1, 2, 3, 1, 0]);
    let w = rnd(b, &mut rng, DType::F32, &[rows, k]);
    let mut scratch =
        ExpertsScratch::alloc(b, ExpertsDims { rows, k, experts: e, hidden: h, inter: i }).expect("scratch");
    let mut out = z(b, DType::F32, &[rows, h]);
    b.experts(&x, &ids, &w, &experts, &mut scratch, &mut out).expect("a valid call");

    expect(b, "no experts", b.experts(&x, &ids, &w, &[], &mut scratch, &mut out), argument(op, "no experts"));
    let wide = lin(&mut rng, i, h + 1);
    let odd = [experts[0], Expert { gate: &wide, up: &wide, down: &mats[0][2] }];
    expect(
        b,
        "experts of two shapes",
        b.experts(&x, &ids, &w, &odd, &mut scratch, &mut out),
        shape(op, "w_gate", &[i, h + 1], &format!("[{i}, {h}] (as expert 0)")),
    );
    let flat = lin(&mut rng, h, i + 1);
    let bad_down = [Expert { down: &flat, ..experts[0] }];
    expect(
        b,
        "down of the wrong shape",
        b.experts(&x, &ids, &w, &bad_down, &mut scratch, &mut out),
        shape(op, "w_down", &[h, i + 1], &format!("[{h}, {i}]")),
    );
    let f16_up = Linear::plain(z(b, DType::F16, &[i, h]));
    let mixed = [Expert { up: &f16_up, ..experts[0] }];
    expect(
        b,
        "gate and up of two dtypes",
        b.experts(&x, &ids, &w, &mixed, &mut scratch, &mut out),
        dtype(op, "w_up", DType::F16, &[DType::BF16]),
    );
    expect(
        b,
        "bf16 x",
        b.experts(&z(b, DType::BF16, &[rows, h]), &ids, &w, &experts, &mut scratch, &mut out),
        dtype(op, "x", DType::BF16, F32),
    );
    expect(
        b,
        "f32 ids",
        b.experts(&x, &z(b, DType::F32, &[rows, k]), &w, &experts, &mut scratch, &mut out),
        dtype(op, "ids", DType::F32, U32S),
    );
    expect(
        b,
        "more picks than experts",
        b.experts(&x, &z(b, DType::U32, &[rows, e + 1]), &w, &experts, &mut scratch, &mut out),
        argument(op, format!("{} picks per row of {e} experts", e + 1)),
    );
    expect(
        b,
        "weights of another shape",
        b.experts(&x, &ids, &z(b, DType::F32, &[rows, k + 1]), &experts, &mut scratch, &mut out),
        shape(op, "weights", &[rows, k + 1], &format!("[{rows}, {k}]")),
    );
    expect(
        b,
        "out of another shape",
        b.experts(&x, &ids, &w, &experts, &mut scratch, &mut z(b, DType::F32, &[rows, h + 1])),
        shape(op, "out", &[rows, h + 1], &format!("[{rows}, {h}]")),
    );
    let mut small =
        ExpertsScratch::alloc(b, ExpertsDims { rows: rows - 1, k, experts: e, hidden: h, inter: i })
            .expect("scratch");
    match err("scratch of fewer rows", b.experts(&x, &ids, &w, &experts, &mut small, &mut out)) {
        Error::Argument { op: "experts", msg } if msg.contains("scratch of 2 rows") => {}
        other => panic!("{} scratch of fewer rows: {other:?}", b.name()),
    }
    let mut fewer_picks =
        ExpertsScratch::alloc(b, ExpertsDims { rows, k: k - 1, experts: e, hidden: h, inter: i })
            .expect("scratch");
    match err("scratch of fewer picks", b.experts(&x, &ids, &w, &experts, &mut fewer_picks, &mut out)) {
        Error::Argument { op: "experts", msg }
            if msg.contains(&format!("scratch of {rows} rows of {} picks", k - 1)) => {}
        other => panic!("{} scratch of fewer picks: {other:?}", b.name()),
    }

    for (picks, want) in [
        (vec![0, 1, 4, 3, 1, 0], Error::IndexOutOfRange { op, row: 1, index: 4, len: e }),
        (vec![0, 1, 2, 3, 1, 1], argument(op, "row 2 picks expert 1 twice")),
    ] {
        let bad = upload_u32(b, &[rows, k], &picks);
        let mut out = poisoned(b, DType::F32, &[rows, h]);
        expect(b, "a bad pick", b.experts(&x, &bad, &w, &experts, &mut scratch, &mut out), want);
        assert_poisoned(b, "experts output after a bad pick", &out);
    }
}
