/* Params of kernels-cuda/attention.cu. C only; include after common.cuh. Mirrored in
 * runtime/src/gpu/ops/attention.rs; MW_LAYOUT lets a test compare the two.
 *
 * The caches are paged: [num_blocks, block_size, kv_heads, head_dim] in the dtype the kernel's
 * name gives (k and v independently), so their pointers are untyped here. Position p of slot s is
 * row p % block_size of block block_table[s * max_blocks + p / block_size]; capacity =
 * max_blocks * block_size positions per slot. */
#pragma once

/* kv_store_<k>_<v>: position positions[r] of slot slots[r] = k/v[r], rounded to the cache
 * dtypes; rows with a bad slot, position or table entry are reported and skipped; of rows naming
 * the same place of the cache the last one wins. */
struct KvStoreParams {
    const float* k;              /* [rows, width] */
    const float* v;              /* [rows, width] */
    void* k_cache;               /* [num_blocks, block_size, width] */
    void* v_cache;               /* [num_blocks, block_size, width] */
    const uint32_t* block_table; /* [n_slots, max_blocks] */
    const uint32_t* slots;       /* [rows] */
    const uint32_t* positions;   /* [rows] */
    unsigned int* status;        /* the backend's status word (mw::report) */
    uint64_t rows;
    uint64_t width;              /* kv_heads * head_dim */
    uint32_t n_slots;
    uint32_t capacity;           /* max_blocks * block_size */
    uint32_t block_size;
    uint32_t num_blocks;
    uint32_t max_blocks;
    uint32_t reserved;           /* zero; pads to a multiple of 8 bytes */
};
MW_LAYOUT(KvStoreParams, k, v, k_cache, v_cache, block_table, slots, positions, status, rows, width, n_slots,
          capacity, block_size, num_blocks, max_blocks, reserved)

/* attention_decode_* and attention_prefill_*: one struct, filled per launch (the head chunking
 * differs between the two kernels). */
struct AttentionParams {
    const float* q;            /* [rows, heads, head_dim] */
    const void* k_cache;
    const void* v_cache;
    const uint32_t* block_table; /* [n_slots, max_blocks] */
    const uint32_t* slots;     /* [rows] */
    const uint32_t* positions; /* [rows] */
    float* out;                /* [rows, heads, head_dim] */
    /* Decode with splits > 1 (else unused): per (row, head, split) the block's unnormalised
     * output [head_dim rounded up to 4] and its (max in log2 units, sum of weights); and one
     * arrival counter per (row, kv_head, head chunk), zero before and after every launch. */
    float* partial_acc;        /* [rows, heads, splits, head_dim_4] */
    float* partial_ml;         /* [rows, heads, splits, 2] */
    unsigned int* arrivals;    /* [rows, kv_heads * head_chunks] */
    unsigned int* status;
    uint64_t rows;
    uint32_t heads;
    uint32_t kv_heads;
    uint32_t head_dim;
    uint32_t n_slots;
    uint32_t capacity;         /* max_blocks * block_size */
    uint32_t block_size;
    uint32_t block_shift;      /* log2(block_size) when a power of two, else 32 (divide) */
    uint32_t num_blocks;
    uint32_t max_blocks;
    uint32_t head_chunk;       /* query heads of one kv group per block */
    uint32_t head_chunks;      /* ceil((heads / kv_heads) / head_chunk) */
    uint32_t splits;           /* decode: grid.y */
    uint32_t min_split;        /* decode: fewest positions per split */
    uint32_t prefill_rows;     /* rows per prefill tile; 0 = no prefill kernel in this call */
    float scale_log2;          /* softmax scale * log2(e) */
    uint32_t reserved;         /* zero; pads to a multiple of 8 bytes */
};
MW_LAYOUT(AttentionParams, q, k_cache, v_cache, block_table, slots, positions, out, partial_acc, partial_ml,
          arrivals, status, rows, heads, kv_heads, head_dim, n_slots, capacity, block_size, block_shift,
          num_blocks, max_blocks, head_chunk, head_chunks, splits, min_split, prefill_rows, scale_log2,
          reserved)
