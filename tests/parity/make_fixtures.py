#!/usr/bin/env python3
"""Builds the parity fixtures under tests/parity/fixtures/: small random checkpoints in the
published Hugging Face layouts, and transformers' logits and greedy continuations for them.

Each case directory holds:
  config.json, model.safetensors (or shards + model.safetensors.index.json)  -- the checkpoint
  expected.json    -- {"prompts": [[ids]...], "greedy": [[ids]...], "max_new_tokens": N, ...}
  prefill_logits_{i}.npy  -- float32 [len(prompt i), vocab]: transformers' logits at every position
  decode_logits_{i}.npy   -- float32 [N, vocab]: row j = logits greedy token j was picked from

The reference is transformers in float32 (weights stored in bf16/f16/fp8 are upcast exactly), a
full forward over the whole sequence at each step (no KV cache), greedy = argmax. For the FP8
case the reference model holds the dequantized weights (fp8 value x scale, exact in f32): that is
what the published weights mean; activation quantization is not part of the comparison.

Run (CPU is enough; CI does not run Python, the outputs are committed):
  python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors numpy
  .venv/bin/python tests/parity/make_fixtures.py
"""

import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures")
MAX_NEW = 8

# Rope settings chosen so that at the fixtures' short positions all three regimes of the llama3
# scaling (kept, divided by factor, blended) change the logits: theta 10000, head_dim 32 gives
# wavelengths from 6.3 to ~56000; original 32 / high_freq_factor 4 = 8 and 32 / 1 = 32 bound the
# blend region.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = [
    # name, arch, dims, dtype, extras
    dict(name="llama31_gqa_bf16", arch="llama", hidden=128, inter=256, layers=2, heads=8, kv_heads=2,
         vocab=512, dtype=torch.bfloat16, rope_scaling=LLAMA3_ROPE, tie=False),
    dict(name="llama_tied_f32", arch="llama", hidden=64, inter=128, layers=2, heads=4, kv_heads=2,
         vocab=256, dtype=torch.float32, rope_scaling=None, tie=True),
    dict(name="llama_mha_f16", arch="llama", hidden=64, inter=128, layers=2, heads=4, kv_heads=4,
         vocab=256, dtype=torch.float16, rope_scaling=None, tie=False),
    dict(name="mixtral_top2_bf16", arch="mixtral", hidden=64, inter=128, layers=2, heads=4, kv_heads=2,
         vocab=256, dtype=torch.bfloat16, experts=8, top_k=2, shards=2),
    dict(name="mixtral_top1_f32", arch="mixtral", hidden=64, inter=64, layers=2, heads=4, kv_heads=2,
         vocab=256, dtype=torch.float32, experts=4, top_k=1),
    dict(name="llama_fp8_channel", arch="llama", hidden=128, inter=256, layers=2, heads=4, kv_heads=2,
         vocab=256, dtype=torch.bfloat16, rope_scaling=LLAMA3_ROPE, tie=False, fp8="channel"),
]

PROMPT_LENGTHS = [7, 4]


def config_for(c):
    cfg = {
        "architectures": ["LlamaForCausalLM" if c["arch"] == "llama" else "MixtralForCausalLM"],
        "model_type": c["arch"],
        "hidden_act": "silu",
        "hidden_size": c["hidden"],
        "intermediate_size": c["inter"],
        "num_hidden_layers": c["layers"],
        "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv_heads"],
        "head_dim": c["hidden"] // c["heads"],
        "vocab_size": c["vocab"],
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "tie_word_embeddings": c.get("tie", False),
        "torch_dtype": {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[c["dtype"]],
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if c["arch"] == "llama":
        cfg["mlp_bias"] = False
        cfg["rope_scaling"] = c.get("rope_scaling")
    else:
        cfg["num_local_experts"] = c["experts"]
        cfg["num_experts_per_tok"] = c["top_k"]
        cfg["sliding_window"] = None
        cfg["router_aux_loss_coef"] = 0.0
    return cfg


def random_weights(c, gen):
    """Legacy (published) tensor names, float32 values; matrices uniform in +-1/sqrt(in)."""
    h, i, v = c["hidden"], c["inter"], c["vocab"]
    hd = h // c["heads"]
    qd, kvd = c["heads"] * hd, c["kv_heads"] * hd

    def mat(n, k):
        return (torch.rand(n, k, generator=gen) * 2 - 1) / math.sqrt(k)

    def norm(n):
        return 1.0 + 0.2 * (torch.rand(n, generator=gen) * 2 - 1)

    w = {"model.embed_tokens.weight": torch.randn(v, h, generator=gen)}
    for l in range(c["layers"]):
        p = f"model.layers.{l}"
        w[f"{p}.input_layernorm.weight"] = norm(h)
        w[f"{p}.self_attn.q_proj.weight"] = mat(qd, h)
        w[f"{p}.self_attn.k_proj.weight"] = mat(kvd, h)
        w[f"{p}.self_attn.v_proj.weight"] = mat(kvd, h)
        w[f"{p}.self_attn.o_proj.weight"] = mat(h, qd)
        w[f"{p}.post_attention_layernorm.weight"] = norm(h)
        if c["arch"] == "llama":
            w[f"{p}.mlp.gate_proj.weight"] = mat(i, h)
            w[f"{p}.mlp.up_proj.weight"] = mat(i, h)
            w[f"{p}.mlp.down_proj.weight"] = mat(h, i)
        else:
            # A router with some spread so the top-k is not decided by rounding.
            w[f"{p}.block_sparse_moe.gate.weight"] = 4 * mat(c["experts"], h)
            for e in range(c["experts"]):
                w[f"{p}.block_sparse_moe.experts.{e}.w1.weight"] = mat(i, h)
                w[f"{p}.block_sparse_moe.experts.{e}.w2.weight"] = mat(h, i)
                w[f"{p}.block_sparse_moe.experts.{e}.w3.weight"] = mat(i, h)
    w["model.norm.weight"] = norm(h)
    if not c.get("tie", False):
        w["lm_head.weight"] = mat(v, h)
    return w


def quantize_fp8_channel(w):
    """Per output channel: scale = absmax / 448, q = fp8(w / scale). Returns (q, scale [n, 1])."""
    amax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    scale = (amax / 448.0).to(torch.float32)
    q = (w / scale).to(torch.float8_e4m3fn)
    return q, scale


def stored_and_reference(c, w32):
    """The tensors to store (published dtype) and the f32 tensors they mean exactly."""
    stored, ref = {}, {}
    for name, t in w32.items():
        is_linear = name.endswith("_proj.weight") or ".experts." in name
        if c.get("fp8") == "channel" and is_linear:
            q, s = quantize_fp8_channel(t)
            stored[name] = q
            stored[name.replace(".weight", ".weight_scale")] = s
            ref[name] = q.to(torch.float32) * s
        else:
            s = t.to(c["dtype"]).contiguous()
            stored[name] = s
            ref[name] = s.to(torch.float32)
    return stored, ref


def save_checkpoint(dir_, tensors, shards=1):
    os.makedirs(dir_, exist_ok=True)
    names = list(tensors.keys())
    if shards == 1:
        save_file(tensors, os.path.join(dir_, "model.safetensors"), metadata={"format": "pt"})
        return
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for s in range(shards):
        part = names[s * per:(s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(dir_, fname), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = fname
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(dir_, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


def write_npy(path, a):
    np.save(path, np.ascontiguousarray(a, dtype=np.float32))


def build(c, seed):
    gen = torch.Generator().manual_seed(seed)
    w32 = random_weights(c, gen)
    stored, ref = stored_and_reference(c, w32)
    cfg = config_for(c)
    case_dir = os.path.join(OUT, c["name"])
    shutil.rmtree(case_dir, ignore_errors=True)
    if c.get("fp8") == "channel":
        cfg_q = dict(cfg)
        cfg_q["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                "dynamic": False},
                    "input_activations": None,
                }
            },
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
        }
        stored_cfg = cfg_q
    else:
        stored_cfg = cfg
    save_checkpoint(case_dir, stored, c.get("shards", 1))
    with open(os.path.join(case_dir, "config.json"), "w") as f:
        json.dump(stored_cfg, f, indent=1)

    # The reference: transformers loading the f32 values the stored tensors mean.
    with tempfile.TemporaryDirectory() as tmp:
        ref_cfg = dict(cfg)
        ref_cfg["torch_dtype"] = "float32"
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(ref_cfg, f)
        save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
        model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        sys.exit(f"{c['name']}: transformers did not load every tensor: {bad}")
    model.eval()
    # Cross-check the loaded parameters against what we wrote (catches a silent name conversion).
    sd = model.state_dict()
    emb = sd["model.embed_tokens.weight"]
    assert torch.equal(emb, ref["model.embed_tokens.weight"]), "embedding differs after load"
    if c.get("tie", False):
        assert torch.equal(sd["lm_head.weight"], emb), "lm_head is not tied"

    prompts, greedy = [], []
    for pi, length in enumerate(PROMPT_LENGTHS):
        prompt = torch.randint(3, c["vocab"], (length,), generator=gen).tolist()
        ids = list(prompt)
        with torch.no_grad():
            prefill = model(torch.tensor([ids])).logits[0].float().numpy()
            decode = []
            out = []
            for _ in range(MAX_NEW):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                decode.append(logits.numpy())
                nxt = int(torch.argmax(logits))
                out.append(nxt)
                ids.append(nxt)
        write_npy(os.path.join(case_dir, f"prefill_logits_{pi}.npy"), prefill)
        write_npy(os.path.join(case_dir, f"decode_logits_{pi}.npy"), np.stack(decode))
        prompts.append(prompt)
        greedy.append(out)
        # Margin between the top two logits of each greedy pick: a tiny margin would make the
        # token comparison depend on rounding.
        margins = [float(np.sort(d)[-1] - np.sort(d)[-2]) for d in decode]
        print(f"{c['name']} prompt {pi}: min top-2 margin {min(margins):.4f}")
    with open(os.path.join(case_dir, "expected.json"), "w") as f:
        json.dump({
            "prompts": prompts,
            "greedy": greedy,
            "max_new_tokens": MAX_NEW,
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "seed": seed,
            # transformers' rotary inverse frequencies (llama3 scaling applied): a targeted check.
            "inv_freq": [float(x) for x in model.model.rotary_emb.inv_freq.double()],
        }, f, indent=1)


TOKENIZER_TEXT = "the cat sat on the mat"
TOKENIZER_CORPUS = [
    "the cat sat on the mat", "a dog lay on the rug", "memory bandwidth bounds decoding",
    "the wall is where the bytes run out", "tokens per second per byte read",
]


def write_tokenizer(case_dir, vocab):
    """A small BPE tokenizer.json (special tokens <unk>=0, <s>=1, </s>=2 as in the configs, <s>
    prepended), so `memwall run --prompt` has something to read. Records the ids of a sentence."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 120), special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok.get_vocab_size() <= vocab
    tok.save(os.path.join(case_dir, "tokenizer.json"))
    ids = tok.encode(TOKENIZER_TEXT).ids
    path = os.path.join(case_dir, "expected.json")
    with open(path) as f:
        exp = json.load(f)
    exp["text_prompt"] = TOKENIZER_TEXT
    exp["text_prompt_ids"] = ids
    with open(path, "w") as f:
        json.dump(exp, f, indent=1)


def main():
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    for seed, c in enumerate(CASES):
        build(c, 1000 + seed)
    write_tokenizer(os.path.join(OUT, "llama_tied_f32"), 256)
    total = 0
    for root, _, files in os.walk(OUT):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    print(f"fixtures: {total / 1e6:.2f} MB in {OUT}")


if __name__ == "__main__":
    main()
