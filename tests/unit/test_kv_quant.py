"""Quantized KV caches on the CPU path (docs/ARCHITECTURE.md §4.6): the formats' round trips
against independent truths, the quantized paged attention against dense float attention,
the block bytes the KV sizing and the tiers use, the tier copies of quantized blocks, the
checkpoint's fp8 scales, and the configuration-time refusal on CUDA (the CLI's is in
test_model_facts.py).

Truths: fp8_e4m3 against the nearest of all 256 bit patterns of the format (decoded by
torch); int8 against the formula in float64; attention against float64 dense causal SDPA,
on the dequantized K/V (tight) and on the original K/V (within what the quantization error
allows); block bytes against what `KVCache` allocates.
"""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import paged_attention_ref, store_kv_ref
from kernels.kv_quant import (FP8_E4M3_MAX, dequantize_fp8, dequantize_int8, gather_dequantized,
                              quantize_fp8, quantize_int8)
from services.worker.kv_cache import KVCache, PagedKVSpec
from shared.kv_layout import num_blocks_for
from services.worker.kv_transfer import KVTransfer
from shared.config import build_config
from shared.kv_layout import KVLayout, kv_layout_for
from shared.model_spec import load_model_spec
from tests.unit.test_model_facts import LLAMA, _folder

KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}

# ---------------------------------------------------------------- round trips


def _fp8_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value, decoded by torch from its 256 bit patterns, fp64."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
    return vals[torch.isfinite(vals)].unique()


def _log_uniform(n: int, lo: float, hi: float, g: torch.Generator) -> torch.Tensor:
    mag = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(torch.log(torch.tensor(lo)).item(),
                                                                 torch.log(torch.tensor(hi)).item(),
                                                                 generator=g))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (mag * sign).float()


@pytest.mark.parametrize("scale", [1.0, 0.037, 8.0])
def test_fp8_rounds_to_the_nearest_e4m3_value_within_its_error_bound(scale):
    g = torch.Generator().manual_seed(1)
    x = _log_uniform(20000, 1e-4 * scale, 440 * scale, g)
    got = dequantize_fp8(quantize_fp8(x, torch.tensor(scale)), torch.tensor(scale)).double()
    grid = _fp8_grid() * scale
    nearest = (x.double()[:, None] - grid[None, :]).abs().min(dim=1).values
    err = (got - x.double()).abs()
    # round to nearest: no grid value is closer (up to fp32's rounding of x / scale and of
    # the product back; ties may go either way)
    assert (err <= nearest + 1e-6 * x.double().abs()).all()
    # the format's bound: 3 mantissa bits (2^-4 relative), 2^-10 absolute among subnormals
    assert (err <= torch.maximum(x.double().abs() * 2 ** -4, torch.tensor(2 ** -10 * scale))).all()
    assert err.max() > 0  # the values are not all representable: the check can fail


def test_fp8_saturates_outside_its_range_instead_of_overflowing():
    x = torch.tensor([1e4, -1e4, 449.0, 448.0, 0.0])
    q = quantize_fp8(x, torch.tensor(1.0))
    assert dequantize_fp8(q, torch.tensor(1.0)).tolist() == [FP8_E4M3_MAX, -FP8_E4M3_MAX, 448.0, 448.0, 0.0]


def test_int8_per_token_and_head_scales_are_amax_over_127_and_errors_half_a_step():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 3, 64, generator=g) * torch.rand(37, 3, 1, generator=g) * 10
    x[5, 1] = 0.0  # a zero row
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.shape == (37, 3) and s.dtype == torch.float32
    amax = x.double().abs().amax(-1)
    torch.testing.assert_close(s.double(), amax / 127, rtol=1e-6, atol=0)
    assert (q.abs().amax(-1)[amax > 0] == 127).all()  # the whole range is used
    back = dequantize_int8(q, s).double()
    assert (back[5, 1] == 0).all() and s[5, 1] == 0
    err = (back - x.double()).abs()
    assert (err <= s.double()[..., None] / 2 + 1e-6 * amax[..., None]).all()
    assert err.max() > 0


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_store_writes_quantized_rows_and_scales_at_their_slots_only(kind):
    g = torch.Generator().manual_seed(3)
    kv = KVCache([PagedKVSpec(2, 16)], 6, 4, KV_DTYPES[kind], "cpu",
                 fp8_scales=[(0.5, 2.0)] if kind == "fp8_e4m3" else None)
    h = kv.layers[0]
    k, v = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g) * 3
    slots = torch.tensor([22, 3, 9, 4, 17])
    store_kv_ref(k, v, h.k, h.v, slots, h.k_scale, h.v_scale)
    blocks = torch.arange(6)
    kd = gather_dequantized(h.k, h.k_scale, blocks).view(-1, 2, 16)
    vd = gather_dequantized(h.v, h.v_scale, blocks).view(-1, 2, 16)
    if kind == "fp8_e4m3":
        want_k = quantize_fp8(k, torch.tensor(0.5)).float() * 0.5
        want_v = quantize_fp8(v, torch.tensor(2.0)).float() * 2.0
    else:
        want_k, want_v = dequantize_int8(*quantize_int8(k)), dequantize_int8(*quantize_int8(v))
    assert torch.equal(kd[slots], want_k) and torch.equal(vd[slots], want_v)
    others = torch.ones(24, dtype=torch.bool)
    others[slots] = False
    assert (kd[others] == 0).all() and (vd[others] == 0).all()


# ---------------------------------------------------------------- attention


def _dense(q, k, v, prefix, scale):
    """float64 causal attention: q [L, H, D] at positions prefix.. over k/v [prefix+L, KVH, D]."""
    h, kvh = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
    mask = torch.arange(k.shape[0])[None, :] <= (prefix + torch.arange(q.shape[0]))[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k.transpose(0, 1).double(),
                                       v.transpose(0, 1).double(), attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def _dequant_truth(x: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    """What the cache should read back for x, computed independently (fp64)."""
    if kind == "fp8_e4m3":
        grid = _fp8_grid() * scale
        xs = x.double().clamp(-FP8_E4M3_MAX * scale, FP8_E4M3_MAX * scale)
        return grid[(xs[..., None] - grid).abs().argmin(-1)]
    s = x.double().abs().amax(-1, keepdim=True) / 127
    return torch.round(x.double() / s).clamp(-127, 127) * s


def _run_quantized(seqs, heads, kv_heads, head_dim, block_size, kind, q_dtype=torch.float32, seed=0):
    """seqs: (cached prefix, new tokens) each. The prefix is written by one store, the new
    tokens by the step's store; returns the worst errors (vs dequantized truth, vs float)."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-(p + n) // block_size) for p, n in seqs) + 2
    ks, vs = (0.05, 0.02) if kind == "fp8_e4m3" else (1.0, 1.0)  # |K| < 448 * 0.05, |V| < 448 * 0.02
    kv = KVCache([PagedKVSpec(kv_heads, head_dim)], nb, block_size, KV_DTYPES[kind], "cpu",
                 fp8_scales=[(ks, vs)] if kind == "fp8_e4m3" else None)
    h = kv.layers[0]
    perm = torch.randperm(nb, generator=g).tolist()
    tables, data, cu, lens, new_slots, new_k, new_v = [], [], [0], [], [], [], []
    for p, n in seqs:
        table = [perm.pop() for _ in range(-(-(p + n) // block_size))]
        k = torch.randn(p + n, kv_heads, head_dim, generator=g) * 2
        v = torch.randn(p + n, kv_heads, head_dim, generator=g)
        q = torch.randn(n, heads, head_dim, generator=g).to(q_dtype)
        slot = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(p + n)])
        if p:
            store_kv_ref(k[:p], v[:p], h.k, h.v, slot[:p], h.k_scale, h.v_scale)
        new_slots.append(slot[p:]), new_k.append(k[p:]), new_v.append(v[p:])
        tables.append(table), data.append((q, k, v)), cu.append(cu[-1] + n), lens.append(p + n)
    store_kv_ref(torch.cat(new_k), torch.cat(new_v), h.k, h.v, torch.cat(new_slots), h.k_scale, h.v_scale)
    width = max(len(t) for t in tables) + 1
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    scale = head_dim ** -0.5
    out = paged_attention_ref(torch.cat([d[0] for d in data]), h.k, h.v, torch.tensor(cu, dtype=torch.int32),
                              torch.tensor(lens, dtype=torch.int32), bt, scale, None, h.k_scale, h.v_scale)
    assert out.dtype == q_dtype and out.shape == (cu[-1], heads, head_dim)
    vs_deq, vs_float = 0.0, 0.0
    for i, ((p, _n), (q, k, v)) in enumerate(zip(seqs, data)):
        got = out[cu[i]:cu[i + 1]].double()
        deq = _dense(q.double(), _dequant_truth(k, kind, ks), _dequant_truth(v, kind, vs), p, scale)
        vs_deq = max(vs_deq, (got - deq).abs().max().item())
        vs_float = max(vs_float, (got - _dense(q.double(), k, v, p, scale)).abs().max().item())
    return vs_deq, vs_float


SHAPES = [  # (seqs, heads, kv_heads, head_dim, block_size)
    ([(0, 1), (0, 7), (0, 17), (0, 33)], 4, 4, 32, 16),        # odd and block-boundary prefills
    ([(16, 5), (7, 9), (32, 16), (3, 13)], 6, 2, 16, 16),      # prefill chunks on cached prefixes, GQA
    ([(0, 1), (15, 1), (16, 1), (47, 1), (3, 1)], 4, 2, 8, 4),  # decodes of unequal lengths
    ([(10, 1), (0, 11), (20, 1), (4, 6), (63, 1)], 9, 3, 16, 16),  # mixed, GQA 3
    ([(9, 1), (2, 3)], 8, 1, 64, 1),                            # block size 1, MQA
]
# worst |out - float attention| over these shapes (K of std 2, V of std 1): the quantization
# error of K through the softmax and of V; measured max 0.199 (fp8, 3 mantissa bits) and
# 0.031 (int8, per-token scales), bounds x 1.5
FLOAT_BOUND = {"fp8_e4m3": 0.30, "int8": 0.047}


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_quantized_paged_attention_matches_dense_attention_on_the_dequantized_kv(kind, shape):
    seqs, heads, kvh, d, bs = SHAPES[shape]
    vs_deq, vs_float = _run_quantized(seqs, heads, kvh, d, bs, kind)
    assert vs_deq < 2e-5, vs_deq   # the read is exact dequantization + fp32 attention
    assert 0 < vs_float < FLOAT_BOUND[kind], vs_float


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_bf16_queries_over_a_quantized_cache_accumulate_in_fp32(kind):
    # fp32 accumulation: the error against the dequantized truth is the bf16 rounding of q
    # and of the output only (a bf16 softmax and sum would be ~10x worse at 64 keys)
    vs_deq, _ = _run_quantized([(40, 1), (9, 24)], 6, 2, 64, 16, kind, q_dtype=torch.bfloat16)
    assert vs_deq < 0.02, vs_deq


# ---------------------------------------------------------------- block bytes, sizing


@pytest.mark.parametrize("kind", ["auto", "fp8_e4m3", "int8"])
def test_block_bytes_count_what_a_block_holds_and_the_budget_buys_more_blocks(tmp_path, kind):
    spec = load_model_spec(_folder(tmp_path, LLAMA), kv_cache_dtype=kind)
    lay = KVLayout.for_model(spec, 16)
    dtype = KV_DTYPES.get(kind, torch.float32)
    one = KVCache([PagedKVSpec(lay.kv_heads_per_rank, lay.head_dim)] * lay.num_layers, 1, 16, dtype, "meta")
    assert lay.block_bytes == one.bytes  # K, V and int8's per-token scales
    fp32 = KVLayout.for_model(load_model_spec(_folder(tmp_path, LLAMA)), 16).block_bytes
    elems = 2 * 16 * lay.num_kv_heads * lay.head_dim * lay.num_layers
    want = {"auto": elems * 4, "fp8_e4m3": elems, "int8": elems + elems // lay.head_dim * 4}[kind]
    assert lay.block_bytes == want
    ratio = num_blocks_for(0.01, lay.block_bytes) / num_blocks_for(0.01, fp32)
    assert ratio == pytest.approx(fp32 / want, rel=0.01)
    assert lay.model_identity != KVLayout.for_model(load_model_spec(_folder(tmp_path, LLAMA)), 16).model_identity \
        or kind == "auto"


# ---------------------------------------------------------------- tier copies


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_tier_copies_move_quantized_blocks_with_their_scales_byte_for_byte(tmp_path, kind):
    from services.kvstore.cpu_tier import OwnedPool

    spec = load_model_spec(_folder(tmp_path, LLAMA), kv_cache_dtype=kind)
    lay = KVLayout.for_model(spec, 4)
    specs = [PagedKVSpec(lay.kv_heads_per_rank, lay.head_dim)] * lay.num_layers
    kv = KVCache(specs, 8, 4, KV_DTYPES[kind], "cpu")
    g = torch.Generator().manual_seed(4)
    for h in kv.layers:  # random K/V through the real write (int8: per-token scales too)
        store_kv_ref(torch.randn(32, *h.k.shape[2:], generator=g), torch.randn(32, *h.k.shape[2:], generator=g),
                     h.k, h.v, torch.arange(32), h.k_scale, h.v_scale)
    xfer = KVTransfer(kv, lay)
    assert xfer.slot_bytes == lay.block_bytes
    inst = "kvq" + uuid.uuid4().hex[:8]
    pool = OwnedPool.create(inst, 4, lay.slot_bytes, lay.model_identity)
    try:
        def raw(blocks):
            ts = kv.k + kv.v + ([t for t in kv.k_scale + kv.v_scale] if kind == "int8" else [])
            return [t[blocks].contiguous().view(torch.uint8).clone() for t in ts]
        before = raw([1, 6])
        xfer.store(pool.name, 1, [(1, 0), (6, 3)])
        xfer.load(pool.name, 1, [(3, 2), (0, 5)])   # slot 3 -> block 2, slot 0 -> block 5
        after = raw([5, 2])
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        assert any(b.any() for b in before)
    finally:
        xfer.detach()
        pool.close()


# ---------------------------------------------------------------- fp8 scales from the checkpoint


def test_fp8_scales_come_from_the_checkpoint_in_each_writers_names(tmp_path):
    from safetensors.torch import save_file

    from services.worker.loader import read_kv_scales

    f = tmp_path / "m"
    f.mkdir()
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.25),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),
               "model.layers.1.self_attn.k_proj.k_scale": torch.tensor(2.0),
               "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(3.0),
               "model.layers.2.self_attn.kv_scale": torch.tensor(0.125),
               "model.layers.3.self_attn.k_proj.output_scale": torch.tensor(4.0),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}, str(f / "model.safetensors"))
    assert read_kv_scales(str(f)) == {0: {"k": 0.25, "v": 0.5}, 1: {"k": 2.0, "v": 3.0},
                                      2: {"k": 0.125, "v": 0.125}, 3: {"k": 4.0}}
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)}, str(f / "model.safetensors"))
    with pytest.raises(ValueError, match="positive finite"):
        read_kv_scales(str(f))


def test_an_fp8_runner_reads_the_checkpoints_scales_and_reports_them(tmp_path):
    import transformers
    from safetensors.torch import load_file, save_file

    from services.worker.model_runner import ModelRunner

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(0.75)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(1.5)
    save_file(tensors, str(tmp_path / "model.safetensors"))

    def runner(kv):
        return ModelRunner(build_config(cli={"model": str(tmp_path), "device": "cpu", "kv_cache_gib": 0.001,
                                             "kv_cache_dtype": kv, "max_model_len": 64}, env={}))
    r = runner("fp8_e4m3")
    assert [(float(h.k_scale), float(h.v_scale)) for h in r.kv.layers] == [(1.0, 1.0), (0.75, 1.5)]
    rep = r.report()
    assert rep["kv_cache_dtype"] == "fp8_e4m3" and "from the checkpoint (1 of 2 layers" in rep["kv_scales"]
    assert r.kv.k[0].dtype == torch.float8_e4m3fn
    # the scales are no parameter: an fp32-KV runner loads the same folder and ignores them
    plain = runner("auto")
    assert plain.kv.layers[1].k_scale is None
    assert runner("int8").report()["kv_scales"].startswith("per token and head")
    # the attention path reported: the C++ decode attention serves fp32 KV only (where it builds)
    from kernels import cpu_decode
    assert rep["attention"] == "torch reference"
    assert ("decode steps C++" in plain.report()["attention"]) == cpu_decode.available()


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_quantized_kv_is_accepted_on_the_cpu(tmp_path, kind):
    d = _folder(tmp_path, LLAMA)
    cfg = build_config(cli={"model": d, "device": "cpu", "kv_cache_dtype": kind, "profile": "none"}, env={})
    assert kv_layout_for(cfg).kv_dtype == kind


def test_fp8_kv_is_accepted_on_cuda_with_one_byte_elements_in_its_layout_and_identity(tmp_path):
    d = _folder(tmp_path, LLAMA)
    cfg = build_config(cli={"model": d, "device": "cuda", "kv_cache_dtype": "fp8_e4m3", "profile": "none",
                            "dtype": "bfloat16"}, env={})
    auto = build_config(cli={"model": d, "device": "cuda", "profile": "none", "dtype": "bfloat16"}, env={})
    fp8, bf16 = kv_layout_for(cfg), kv_layout_for(auto)
    assert (fp8.kv_dtype, fp8.elem_bytes, bf16.elem_bytes) == ("fp8_e4m3", 1, 2)
    assert 2 * fp8.block_bytes == bf16.block_bytes  # twice the tokens for the same bytes
    assert fp8.model_identity != bf16.model_identity  # tier blocks of one dtype are never read as the other


def test_int8_kv_is_accepted_on_cuda_with_its_scales_in_the_block_bytes_and_its_own_identity(tmp_path):
    """int8 on CUDA (tests/gpu/test_int8_kv_gpu.py passed on an H100): one byte an element plus
    4 bytes of K scale and 4 of V scale per token and head, an identity of its own."""
    d = _folder(tmp_path, LLAMA)
    base = {"model": d, "device": "cuda", "profile": "none", "dtype": "bfloat16"}
    i8 = kv_layout_for(build_config(cli={**base, "kv_cache_dtype": "int8"}, env={}))
    fp8 = kv_layout_for(build_config(cli={**base, "kv_cache_dtype": "fp8_e4m3"}, env={}))
    assert (i8.kv_dtype, i8.elem_bytes) == ("int8", 1)
    per_token_head = 2 * LLAMA["num_hidden_layers"] * LLAMA["num_key_value_heads"]
    assert i8.block_bytes - fp8.block_bytes == per_token_head * i8.block_size * 4
    assert i8.model_identity != fp8.model_identity


def test_fp8_kv_on_cuda_is_accepted_with_speculation_and_for_a_hybrid_model(tmp_path):
    """Both read fp8 KV through the same CUDA backends (the verify kernel; a hybrid's
    attention layers); a drafter's own KV group stays in the model dtype: nothing refused."""
    import json
    import pathlib

    d = _folder(tmp_path, LLAMA)
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    cfg = build_config(cli={"model": d, "device": "cuda", "kv_cache_dtype": "fp8_e4m3", "profile": "none",
                            "dtype": "bfloat16", "speculative_config": spec}, env={})
    assert cfg.speculative is not None and kv_layout_for(cfg).kv_dtype == "fp8_e4m3"
    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    src = pathlib.Path(__file__).resolve().parents[2] / "benchmarks/configs/qwen3-next-80b-a3b.json"
    (hybrid / "config.json").write_text(json.dumps(json.loads(src.read_text())))
    cfg = build_config(cli={"model": str(hybrid), "device": "cuda", "kv_cache_dtype": "fp8_e4m3",
                            "profile": "none", "dtype": "bfloat16"}, env={})
    lay = kv_layout_for(cfg)
    assert (lay.kv_dtype, lay.elem_bytes) == ("fp8_e4m3", 1)
    assert 0 < lay.num_layers < json.loads(src.read_text())["num_hidden_layers"]  # a hybrid: some layers recurrent
