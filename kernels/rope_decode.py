"""Decode attention with the rotary embedding, the per-head q/k RMSNorm (Qwen3) and the
KV-cache write of the step's token fused in: one kernel where a decode layer ran two.

`rope_paged_decode` is `rotary_and_store_kv` followed by `paged_attention` for a decode-only
step (every sequence has one new token, its last): same inputs, same result. On CUDA with
full rotary it is one launch of `_rope_decode_kernel`, whose last program of each (seq,
kv_head) to finish merges the live splits' partials (`kernels.decode_merge`; with fused_merge
False a second launch, `_merge_kernel`, merges them); otherwise the two dispatchers in turn
(the reference on the CPU).

Why: at batch 1 the rotary kernel is one program that runs ~2.7 us between the qkv
projection and attention, on the step's critical path (H200, Qwen3-0.6B). Here each
attention program (seq, kv_head, split) rotates the G query heads it needs itself (a few
hundred values, cheaper than a launch), and the program whose partition holds the
sequence's last token rotates that token's key, uses it from registers and writes the key
and value to the cache slot. The other programs mask that token out of their tiles, so no
program reads the slot that is being written. The kernel before (the qkv projection)
writes no KV cache, so with programmatic dependent launch (`kernels.pdl`) each program
loads its first tile of cached keys and values, the block table, the angles and the norm
weights before its wait; q, k and v of the step's token after it, and the split counters
of the merge at the end.

RoPE in the "neox" layout (`kernels.rotary`): for i < D/2, out[i] = x[i] cos - x[i+D/2]
sin, out[i+D/2] = x[i+D/2] cos + x[i] sin, done on whole [heads, D] tiles by loading each
element's partner (i +- D/2) as a second, cached load. Rounding follows
`rotary_and_store_kv_ref`: normalised x rounded to the dtype, times the weight rounded,
the rotation in fp32 rounded once. The attention math is `_decode_kernel`'s.

An fp8_e4m3 cache (KV_QUANT, `kernels.kv_quant_triton`): the owner quantizes the token's
rotated key and its value with the layer's scales and stores the e4m3 bytes; every program
attends that token through the same e4m3 values (widened back in registers), so the result
is that of the store followed by the read, as the two-launch path and the reference give.
An int8 cache (KV_QUANT 2) likewise: the owner quantizes the token's rotated key and its value
per KV head (`kernels.kv_quant_triton.int8_quantize`, as `kernels.kv_quant.quantize_int8`) and
stores the codes and the two scales; the programs read the codes with their per-key scales
(`kv_row_scales`), the token's from registers in a prefetched tile.
"""

from __future__ import annotations

import torch

from kernels.attention import paged_attention
from kernels.rotary import rotary_and_store_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dispatcher runs the two steps
    triton = None

# launch defaults (benchmarks/gemv_sweep.py times the alternatives, H200, Qwen3-0.6B heads, 1K
# context, per layer): block_n None = 32 keys per tile while seqs * kv_heads < SMs (b=1: 8.1
# us with PDL, 64: 8.0, 16: 8.3), else 64 (b=256: 252 us, 32: 279; b=64: 67 against 72);
# splits None = programs_per_sm programs per SM over seqs * kv_heads, at most a tile each
# (b=1: 33 splits, 8.1 us; 64 splits 8.9; all timed before fused_merge existed); prefetch:
# see kernels.attention_triton; max_seqs: larger batches run the rotary kernel and attention
# apart (None: no limit). fused_merge: the kernel's last live program of each (seq, kv_head)
# merges the splits, and a context in one live partition stores its output directly
# (kernels.decode_merge._finish_fused), instead of a second launch. Off (the launch) by
# default until measured: the earlier in-kernel merge (every program arrived, the last merged
# every split head by head) measured slower than the launch, its one merging program's serial
# tail costing more than the launch it saved (H200, Qwen3-0.6B, decode_latency.py TPOT on /
# off in one call: 0.917, 0.923, 0.918, 0.956 / 0.871, 0.876 ms; another call 0.921 / 0.876,
# 0.878; offline_throughput.py 18,752 / 19,084 tok/s); this live-split, chunked merge is not
# measured yet (scripts/gpu_moe_check.sh ab turns it on for its "new" variant).
# min_split_tiles: as in kernels.attention_triton.DECODE_DEFAULTS. On Qwen3-30B-A3B's heads (32 / 4)
# at b=1 the kernel alone measured 7.8 us a layer on these defaults and 6.3 with programs_per_sm 1
# (gemv_sweep.py --only rope --config qwen3-30b-a3b), but TPOT did not follow (decode_latency.py
# --ab moe pps1: 2.93 / 2.92 against 3.03 / 2.94 ms; Qwen3-0.6B 0.877 / 0.870 against 0.876 / 0.859),
# so the default stays (benchmarks/results/2026-12-03_h200_*pps*.json).
# fp8_dot: the dots' format over an fp8_e4m3 cache (`kernels.kv_quant_triton.FP8_DOTS`); maxnreg:
# as in kernels.attention_triton.DECODE_DEFAULTS.
ROPE_DECODE_DEFAULTS: dict = {"block_n": None, "num_warps": 4, "num_stages": 2, "splits": None,
                              "programs_per_sm": 2, "prefetch_max_block_n": 32, "prefetch": None,
                              "max_seqs": None, "fused_merge": False, "min_split_tiles": 1, "fp8_dot": "q",
                              "maxnreg": None}
# an fp8_e4m3 cache: overrides of ROPE_DECODE_DEFAULTS (under the caller's decode_config) by
# the launch's class, as kernels.attention_triton.DECODE_FP8_DEFAULTS (docs/ARCHITECTURE.md §4.6).
# From the same sweep: "few" fp16 dots, 128-key tiles, one stage: bf16 / fp8 1.22 (8K) and
# 1.45 (32K) at batch 1 (the "q" format 1.33 / 1.39); "many" two stages: 0.961 / 0.975 at batch
# 64 (one stage 0.88 / 0.89)
# The 2026-12-03 sweep (the same run as kernels.attention_triton.DECODE_FP8_DEFAULTS): with the register
# cap of 128 and one stage, 32K b1 / 32K b64 / 8K b1 / 8K b64: 1.43 / 1.38 / 1.23 / 1.36 (before: 1.42 /
# 0.97 / 1.24 / 0.97). "few" aims at 6 programs an SM (the third session's sweep, 2026-12-03, with
# variants around that default; benchmarks/results/2026-12-03_h200_kv_quant_attention_variants_s28.json):
# 32K b1 1.42 -> 1.58, 8K b1 1.23 -> 1.35; "many" unchanged (6 programs an SM 1.38 / 1.37 there, the same)
ROPE_DECODE_FP8_DEFAULTS: dict = {
    "few": {"fp8_dot": "fp16", "block_n": 128, "num_warps": 4, "num_stages": 1, "maxnreg": 128,
            "programs_per_sm": 6},
    "many": {"fp8_dot": "fp16", "block_n": 128, "num_warps": 4, "num_stages": 1, "maxnreg": 128}}
ENABLED = True  # False: the dispatcher runs the rotary kernel and paged attention in turn


def rope_paged_decode(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, cu_seqlens_q,
                      seq_lens, block_tables, scale, q_norm=None, k_norm=None, eps: float = 1e-6,
                      plan=None, max_seq_len: int | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
    """Rotate q [B, H, D] and k [B, KVH, D] (one token per sequence, at positions [B]),
    store k and v [B, KVH, D] at slot_mapping [B] (< 0: skipped), and attend over the cache:
    -> [B, H, D] in q's dtype, as `rotary_and_store_kv` then `paged_attention` (see there for
    the other shapes). q_norm, k_norm: [D] weights of the per-head RMSNorm, or None.
    q and k may be left rotated or not (the fused kernel does not write them back).
    k_scale, v_scale: the layer's scales of a quantized cache (fp8_e4m3: 0-d fp32; int8: fp32
    [num_blocks, block_size, num_kv_heads], written at the token's slot), None for a cache in
    the model dtype.
    """
    cap = ROPE_DECODE_DEFAULTS["max_seqs"]
    if (q.is_cuda and ENABLED and rope_decode_triton is not None and cos_sin.shape[-1] == q.shape[-1]
            and q.shape[-1] % 2 == 0 and (cap is None or q.shape[0] <= cap)):
        return rope_decode_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, seq_lens,
                                  block_tables, scale, max_seq_len, q_norm, k_norm, eps, None, k_scale, v_scale)
    rotary_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps,
                        k_scale, v_scale)
    return paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, plan, 1,
                           max_seq_len, k_scale, v_scale)


rope_decode_triton = None  # set below when Triton imports: the CUDA path (below)

if triton is not None:
    from kernels.attention_triton import _LOG2E, _attend_range, _attend_tile, _kv_offsets, _prefetch
    from kernels.decode_merge import (_finish_fused, _partition, _store_partial, fused_merge_constants,
                                      merge_counters, merge_splits, split_buffers)
    from kernels.device_info import num_sms
    from kernels.kv_int8_triton import int8_quantize, kv_row_scales
    from kernels.kv_quant_triton import (KV_FP8, fp8_bytes, fp8_dot_code, fp8_dot_q, fp8_overrides, fp8_read_scale,
                                         kv_dot_tile, kv_operands, kv_tile, word_order)
    from kernels.pdl import launch_args, pdl_release, pdl_wait, use_pdl

    @triton.jit
    def _rope_rows(x_ptr, rows, dd, pd, mask, cos, sin, w, wp, eps, head_dim, NORM: tl.constexpr):
        """Rows of x (offsets rows [R, 1], or a scalar for one row, + dd) rotated: values [R, BLOCK_D] in x's dtype
        (normalised per row first with NORM, weights w at dd and wp at the partners pd). cos, sin: the
        angles at dd, [1, BLOCK_D] for rows of one position or [R, BLOCK_D] per row;
        w, wp: [1, BLOCK_D] fp32."""
        x = tl.load(x_ptr + rows + dd[None, :], mask=mask, other=0.0)
        xp = tl.load(x_ptr + rows + pd[None, :], mask=mask, other=0.0)
        xf, xpf = x.to(tl.float32), xp.to(tl.float32)
        if NORM:
            r = tl.rsqrt(tl.sum(xf * xf, 1) / head_dim + eps)[:, None]
            xf = ((xf * r).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)
            xpf = ((xpf * r).to(x.dtype).to(tl.float32) * wp).to(x.dtype).to(tl.float32)
        first = (dd < head_dim // 2)[None, :]
        out = tl.where(first, xf * cos - xpf * sin, xf * cos + xpf * sin)
        return out.to(x.dtype)

    @triton.jit(do_not_specialize=["s_bt", "n_splits"])  # both vary from step to step
    def _rope_decode_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, qn_ptr, kn_ptr, slot_ptr,
                            kc_ptr, vc_ptr, bt_ptr, seqlen_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr,
                            ks_ptr, vs_ptr, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, cs_stride, sc_b, sc_s, sc_h, s_bt,
                            so_t, so_h, qk_scale, block_size, n_splits, n_heads, head_dim, eps,
                            G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr, NORM: tl.constexpr, ONE_SPLIT: tl.constexpr,
                            USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, FUSED_MERGE: tl.constexpr,
                            BLOCK_S: tl.constexpr, KV_QUANT: tl.constexpr, MERGE_G: tl.constexpr,
                            CHUNK_S: tl.constexpr, MIN_TILES: tl.constexpr, FP8_DOT: tl.constexpr):
        # no program returns early (a padding row, seq_len 0, and an empty partition run
        # through with m -inf, l 0): with FUSED_MERGE the live ones arrive on their (seq,
        # kv_head) counter in `_finish_fused`, after the PDL wait
        seq = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        # before the wait: host-written step inputs, weights and, with PREFETCH, the first
        # tile of the cache (no kernel before writes it; the step's token is masked out and
        # taken from registers). The owner writes the token's K/V, then every program loads
        # the rest of its tiles as usual.
        seq_len = tl.load(seqlen_ptr + seq).to(tl.int32)
        last = seq_len - 1
        if KV_QUANT == 1:  # the layer's scales (set at load): K's on the scores, V's on acc below
            k_sc = tl.load(ks_ptr)
            v_sc = tl.load(vs_ptr)
            qk_scale = qk_scale * (k_sc * fp8_read_scale(KV_QUANT, FP8_DOT % 8))
        pos = tl.load(pos_ptr + seq).to(tl.int64)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        half = head_dim // 2
        # dd: the columns of q, k and the K tiles, dv: of v, the V tiles and the output (`word_order`)
        dd = word_order(tl.arange(0, BLOCK_D), FP8_DOT % 8)
        dv = word_order(tl.arange(0, BLOCK_D), FP8_DOT // 8)
        dmask = dd < head_dim
        pd = tl.where(dd < half, dd + half, dd - half)
        ci = tl.where(dd < half, dd, dd - half)
        cos = tl.load(cs_ptr + pos * cs_stride + ci, mask=dmask, other=0.0)
        sin = tl.load(cs_ptr + pos * cs_stride + half + ci, mask=dmask, other=0.0)
        if NORM:
            qw = tl.load(qn_ptr + dd, mask=dmask, other=0.0).to(tl.float32)
            qwp = tl.load(qn_ptr + pd, mask=dmask, other=0.0).to(tl.float32)
            kw = tl.load(kn_ptr + dd, mask=dmask, other=0.0).to(tl.float32)
            kwp = tl.load(kn_ptr + pd, mask=dmask, other=0.0).to(tl.float32)
        else:
            qw = cos  # unused without NORM
            qwp = cos
            kw = cos
            kwp = cos
        partition, n_live = _partition(seq_len, n_splits, BLOCK_N, MIN_TILES)
        start = split * partition
        end = tl.minimum(start + partition, seq_len)
        if PREFETCH:  # the first tile of cached keys, the step's token masked out
            nn = start + tl.arange(0, BLOCK_N)
            nm = nn < end
            off = _kv_offsets(bt_ptr, seq, s_bt, nn, nm, block_size, sc_b, sc_s, sc_h, kvh)
            cached = (nm & (nn < last))[:, None] & dmask[None, :]
            k0 = tl.load(kc_ptr + off[:, None] + dd[None, :], mask=cached, other=0)
            v0 = tl.load(vc_ptr + off[:, None] + dv[None, :], mask=cached, other=0)
            ks0 = kv_row_scales(ks_ptr, off, nm & (nn < last), head_dim, KV_QUANT)  # int8's, 1.0 else
            vs0 = kv_row_scales(vs_ptr, off, nm & (nn < last), head_dim, KV_QUANT)
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
        gg = tl.arange(0, BLOCK_G)
        heads = kvh * G + gg
        q = _rope_rows(q_ptr, seq * sq_t + heads[:, None] * sq_h, dd, pd, (gg < G)[:, None] & dmask[None, :],
                       cos[None, :], sin[None, :], qw[None, :], qwp[None, :], eps, head_dim, NORM)
        k_new = _rope_rows(k_ptr, seq * sk_t + kvh * sk_h, dd, pd, dmask[None, :],
                           cos[None, :], sin[None, :], kw[None, :], kwp[None, :], eps, head_dim, NORM)  # [1, BLOCK_D]
        v_new = tl.load(v_ptr + seq * sv_t + kvh * sv_h + dv[None, :], mask=dmask[None, :], other=0.0)
        # an fp8 cache: q in the dots' format, its scaling undone on the scores
        q, q_undo = fp8_dot_q(q, KV_QUANT, FP8_DOT)
        qk_scale = qk_scale * q_undo
        if KV_QUANT == 1:  # the token as stored: e4m3 bytes, and their values in the dots' format for the tile
            k_st = fp8_bytes(k_new, k_sc)
            v_st = fp8_bytes(v_new, v_sc)
            k_new = kv_dot_tile(k_st, q, 1, FP8_DOT % 8)
            v_new = kv_dot_tile(v_st, q, 1, FP8_DOT // 8)
            k_s_new = 1.0
            v_s_new = 1.0
        elif KV_QUANT == 2:  # the token as stored: int8 codes and their scales [1], codes widened for the tile
            k_st, k_s_new = int8_quantize(k_new)
            v_st, v_s_new = int8_quantize(v_new)
            k_new = kv_tile(k_st, q, KV_QUANT)
            v_new = kv_tile(v_st, q, KV_QUANT)
        else:
            k_st = k_new
            v_st = v_new
            k_s_new = 1.0
            v_s_new = 1.0
        if (start <= last) & (last < end) & (slot >= 0):  # this program owns the step's token
            c = slot * sc_s + kvh * sc_h
            tl.store(kc_ptr + c + dd[None, :], k_st, mask=dmask[None, :])
            tl.store(vc_ptr + c + dv[None, :], v_st, mask=dmask[None, :])
            if KV_QUANT == 2:  # its scales at [slot, kv_head] (= c // head_dim: contiguous, `kv_operands`)
                one = tl.arange(0, 1)
                tl.store(ks_ptr + c // head_dim + one, k_s_new)
                tl.store(vs_ptr + c // head_dim + one, v_s_new)
        tl.debug_barrier()  # the owner's writes are visible to its own loads below
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        lo = start
        if PREFETCH:
            is_new = (nn == last)[:, None]
            if KV_QUANT == 2:  # the token's scales from registers
                ks0 = tl.where(nn == last, k_s_new, ks0)
                vs0 = tl.where(nn == last, v_s_new, vs0)
            m_i, l_i, acc = _attend_tile(q, tl.where(is_new, k_new, kv_dot_tile(k0, q, KV_QUANT, FP8_DOT % 8)),
                                         tl.where(is_new, v_new, kv_dot_tile(v0, q, KV_QUANT, FP8_DOT // 8)), nm,
                                         m_i, l_i, acc, qk_scale, ks0, vs0, KV_QUANT)
            lo = start + BLOCK_N
        m_i, l_i, acc = _attend_range(q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, seq, s_bt, block_size, sc_b, sc_s,
                                      sc_h, kvh, dd, dv, dmask, head_dim, lo, end, m_i, l_i, acc, qk_scale, BLOCK_N, BLOCK_D,
                                      KV_QUANT, FP8_DOT)
        if KV_QUANT == 1:
            acc = acc * (v_sc * fp8_read_scale(KV_QUANT, FP8_DOT // 8))
        if FUSED_MERGE:  # (never with ONE_SPLIT)
            _finish_fused(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, seq, kvh, heads, gg, dv, dmask,
                          so_t, so_h, n_heads, n_splits, split, n_live, head_dim, G, MERGE_G, BLOCK_S, CHUNK_S,
                          BLOCK_D)
        else:
            _store_partial(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, seq, heads, gg, dv, dmask, so_t, so_h,
                           n_heads, n_splits, split, head_dim, G, ONE_SPLIT)

    def rope_decode_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, seq_lens,
                           block_tables, scale, max_seq_len=None, q_norm=None, k_norm=None, eps=1e-6,
                           decode_config: dict | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
        """The CUDA path of `rope_paged_decode` (full rotary: cos_sin [positions, D]).
        decode_config overrides ROPE_DECODE_DEFAULTS (block_n, num_warps, splits, fused_merge,
        fp8_dot, ..; for an fp8 cache ROPE_DECODE_FP8_DEFAULTS come between the two).
        k_scale, v_scale: an fp8_e4m3 cache's 0-d fp32 layer scales, or an int8 cache's fp32 per-token
        scales [num_blocks, block_size, num_kv_heads] (`kernels.kv_quant_triton`: the owner
        quantizes the token's rotated K row and its V row per head and stores codes and scales).
        Raises ValueError for a strided last dim, num_heads not a multiple of num_kv_heads or
        an unknown fp8_dot, and as `kv_operands`."""
        b, h, d = q.shape
        kvh = k_cache.shape[2]
        if h % kvh or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError(f"rope decode: heads {h}/{kvh}, last strides {q.stride(-1)} {k.stride(-1)} "
                             f"{v.stride(-1)}")
        out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
        if b == 0:
            return out
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        kc, vc, ks, vs, quant = kv_operands(k_cache, v_cache, k_scale, v_scale)
        fp8 = quant == KV_FP8
        dc = {**ROPE_DECODE_DEFAULTS, **(fp8_overrides(ROPE_DECODE_FP8_DEFAULTS, b, kvh, d, q.device) if fp8 else {}),
              **(decode_config or {})}
        fp8_dot = fp8_dot_code(dc["fp8_dot"], kc, d, fp8)
        block_n = dc["block_n"] or (32 if b * kvh < num_sms(q.device) else 64)
        n_tiles = triton.cdiv(max(1, max_seq_len), block_n)
        splits = dc["splits"] or max(1, min(n_tiles, triton.cdiv(dc["programs_per_sm"] * num_sms(q.device), b * kvh)))
        m, l_, acc = split_buffers(out, splits)
        cnt = merge_counters(out, kvh, splits, dc["fused_merge"])
        norm = q_norm is not None
        pdl = use_pdl(q.device)
        bd = triton.next_power_of_2(d)
        _rope_decode_kernel[(b, kvh, splits)](
            q, k, v, positions, cos_sin, q_norm if norm else q, k_norm if norm else q, slot_mapping,
            kc, vc, block_tables, seq_lens, out, m, l_, acc, out if cnt is None else cnt, ks, vs,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            out.stride(0), out.stride(1), scale * _LOG2E, k_cache.shape[1], splits, h, d, eps,
            G=h // kvh, BLOCK_G=max(16, triton.next_power_of_2(h // kvh)), BLOCK_N=block_n, BLOCK_D=bd,
            NORM=norm, ONE_SPLIT=splits == 1, USE_PDL=pdl, PREFETCH=_prefetch(dc, pdl, block_n),
            FUSED_MERGE=cnt is not None, KV_QUANT=quant, MIN_TILES=dc["min_split_tiles"],
            **fused_merge_constants(h, kvh, d, splits, cnt is not None),
            FP8_DOT=fp8_dot, num_warps=dc["num_warps"],
            num_stages=dc["num_stages"], **({"maxnreg": dc["maxnreg"]} if dc["maxnreg"] else {}),
            **launch_args(pdl))
        merge_splits(m, l_, acc, out, splits, pdl, cnt)  # nothing when the kernel merged
        return out
