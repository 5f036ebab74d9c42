"""Multi-query (verify-step) attention with the rotary embedding, the per-head q/k RMSNorm
(Qwen3) and the KV-cache write of the step's new tokens fused in: the verify-step analogue of
`kernels.rope_decode` (docs/ARCHITECTURE.md §5.5, issue 15).

`rope_paged_verify` is `rotary_and_store_kv` followed by `paged_attention` for a step whose
sequences each run a few queries (a verify step: [last token, k drafts], q_len = 1 + k; every
sequence's new tokens are its last q_len tokens, as paged attention assumes): same inputs,
same result. On CUDA, with the switch ROPE_VERIFY on, full rotary and max_q_len x G rows
within one program (`kernels.attention_multi_query.fits_multi_query`), it is one launch of
`_rope_verify_kernel` plus the split merge (`kernels.decode_merge`: the `_merge_kernel`
launch, or with "fused_merge" in the kernel); otherwise the two dispatchers in turn (the
reference on the CPU).

Why: a verify layer ran the rotary kernel (one program per token, ~190 us of a Qwen3-0.6B verify
step under PDL on an H100) between the qkv projection and the multi-query kernel, on the step's
critical path; a decode layer runs one kernel (`kernels.rope_decode`). Here program (seq,
kv_head, split) of the multi-query layout (`kernels.attention_multi_query`: the q_len x G rows
of one KV head over one partition of the context) rotates the rows of q it attends itself
(their own positions, a few KB); the new tokens' keys and values (positions seq_len - q_len ..
seq_len - 1) are rotated, quantized as the cache stores them, attended from registers by the
program whose partition holds their positions (with the causal mask among them: row i sees new
key j <= i), and written to their slots by that program alone (partitions are disjoint, so
each token is written once). Cached keys come from the cache below seq_len - q_len only: no
program reads a slot that is being written, and no barrier is needed. The kernel before (the
qkv projection) writes no KV cache, so with programmatic dependent launch (`kernels.pdl`)
each program loads the step's metadata (query offsets, lengths, positions, slots), the angles,
the norm weights and, with PREFETCH, its first tile of cached keys and values and the block
table entries before its wait; q, k and v after it.

Rounding as `rotary_and_store_kv_ref` (`kernels.rope_decode._rope_rows`: normalised x rounded
to the dtype, times the weight rounded, the rotation in fp32 rounded once); the attention math
is the multi-query kernel's (`kernels.attention_triton._attend_masked`, online softmax in
fp32). An fp8_e4m3 cache (KV_QUANT 1): the owner stores the rotated key and the value as e4m3
bytes with the layer's scales (`fp8_bytes`), and the new tokens are attended through the same
e4m3 values widened to q's dtype, as the store then the read would give. An int8 cache
(KV_QUANT 2): each new key and value row quantized per token and KV head (`int8_quantize`, as
`kernels.kv_quant.quantize_int8`), codes and scales stored, and attended through the codes and
their scales. Unmeasured on a GPU (scripts/gpu_roperify.sh measures it): off by default.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.attention import paged_attention
from kernels.rotary import rotary_and_store_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dispatcher runs the two steps
    triton = None

# The switch: False (default) runs a verify layer as before (rotary kernel, then multi-query
# attention). Not measured on a GPU yet (scripts/gpu_roperify.sh; benchmarks/spec_verify_cost.py
# --rope-verify on sets it before the runner loads).
ROPE_VERIFY = False

# launch defaults, the multi-query kernel's (`kernels.attention_multi_query.MQ_DEFAULTS`: block_n
# None = 64 keys a tile, 32 for head_dim > 128; splits None = `multi_query_splits`) but 8 warps: compiled
# for sm90 at Qwen3-0.6B's verify shapes (tests/unit/test_rope_verify_compile.py, bf16, PDL, prefetch, two
# stages), 4 warps spill 248 (q_len 2..8, bf16 cache) to 1,168 bytes (q_len 9, int8) of stack a thread
# (the multi-query kernel itself 128-200 bytes), 8 warps 0-232. prefetch None: with PDL for tiles of at most
# prefetch_max_block_n keys (`kernels.attention_triton._prefetch`). early_angles: q's angle rows loaded
# before the PDL wait (held across it: more spills, 344 against 248 bytes at 4 warps) instead of after.
# None of it timed (scripts/gpu_roperify.sh).
ROPE_VERIFY_DEFAULTS: dict = {"block_n": None, "num_warps": 8, "num_stages": 2, "splits": None,
                              "fused_merge": False, "prefetch": None, "prefetch_max_block_n": 64,
                              "early_angles": False}


def verify_fits(max_q_len: int | None, num_heads: int, num_kv_heads: int) -> bool:
    """Whether a step of at most max_q_len queries a seq (a host bound, None: unknown) may take
    the fused kernel: ROPE_VERIFY on, Triton there, and max_q_len x G rows within one program
    of the multi-query kernel (`kernels.attention_multi_query.fits_multi_query`: 1 < max_q_len,
    at most MAX_ROWS rows). Safe without Triton (False)."""
    fits = _fits_multi_query
    return ROPE_VERIFY and fits is not None and max_q_len is not None and fits(max_q_len, num_heads, num_kv_heads)


def fused_verify_applies(q: torch.Tensor, cos_sin: torch.Tensor, max_q_len: int | None, num_kv_heads: int) -> bool:
    """Whether `rope_paged_verify` runs the fused kernel: q on CUDA, `verify_fits`, and full
    rotary (cos_sin [positions, head_dim], head_dim even)."""
    d = q.shape[-1]
    return q.is_cuda and cos_sin.shape[-1] == d and d % 2 == 0 and verify_fits(max_q_len, q.shape[1], num_kv_heads)


def rope_paged_verify(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, cu_seqlens_q, seq_lens,
                      block_tables, scale, q_norm=None, k_norm=None, eps: float = 1e-6, plan=None,
                      max_q_len: int | None = None, max_seq_len: int | None = None, k_scale=None,
                      v_scale=None) -> torch.Tensor:
    """Rotate q [T, H, D] and k [T, KVH, D] (the tokens at positions [T] int64), store k and v
    [T, KVH, D] at slot_mapping [T] (< 0: skipped), and attend causally over the cache: ->
    [T, H, D] in q's dtype, as `rotary_and_store_kv` then `paged_attention` (see there for
    the other shapes; each sequence's queries are the last q_len of its seq_lens tokens).
    q_norm, k_norm: [D] weights of the per-head RMSNorm, or None. q and k may be left
    rotated or not (the fused kernel does not write them back). max_q_len, max_seq_len: host
    bounds (a CUDA graph passes 1 + K and max_model_len). k_scale, v_scale: the layer's
    scales of a quantized cache (fp8_e4m3: 0-d fp32; int8: fp32 [num_blocks, block_size,
    KVH]), None for a cache in the model dtype. Raises as the paths it takes."""
    if fused_verify_applies(q, cos_sin, max_q_len, k_cache.shape[2]):
        assert rope_verify_triton is not None and max_q_len is not None  # fused_verify_applies checked
        return rope_verify_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, cu_seqlens_q,
                                  seq_lens, block_tables, scale, max_q_len, max_seq_len, q_norm, k_norm, eps, None,
                                  k_scale, v_scale)
    rotary_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps,
                        k_scale, v_scale)
    return paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, plan, max_q_len,
                           max_seq_len, k_scale, v_scale)


rope_verify_triton = None  # set below when Triton imports: the CUDA path (below)
_fits_multi_query: Callable[[int, int, int], bool] | None = None  # likewise (`verify_fits`)

if triton is not None:
    from kernels.attention_multi_query import fits_multi_query, multi_query_splits

    _fits_multi_query = fits_multi_query
    from kernels.attention_triton import _LOG2E, _attend_masked, _attend_range, _attend_tile, _kv_offsets, _prefetch
    from kernels.decode_merge import (_finish_rows, _partition, _store_rows, fused_merge_constants, merge_counters,
                                      merge_splits, split_buffers)
    from kernels.device_info import num_sms
    from kernels.kv_int8_triton import int8_quantize, kv_row_scales
    from kernels.kv_quant_triton import fp8_bytes, kv_operands, kv_tile
    from kernels.pdl import launch_args, pdl_release, pdl_wait, use_pdl
    from kernels.rope_decode import _rope_rows

    @triton.jit(do_not_specialize=["s_bt", "n_splits"])  # both vary from step to step
    def _rope_verify_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, qn_ptr, kn_ptr, slot_ptr, kc_ptr, vc_ptr, bt_ptr,
                            cu_ptr, seqlen_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, ks_ptr, vs_ptr,
                            sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, cs_stride, sc_b, sc_s, sc_h, s_bt, so_t, so_h,
                            qk_scale, block_size, n_splits, n_heads, head_dim, eps,
                            G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr, NORM: tl.constexpr, ONE_SPLIT: tl.constexpr,
                            USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, FUSED_MERGE: tl.constexpr,
                            KV_QUANT: tl.constexpr, MERGE_G: tl.constexpr, BLOCK_S: tl.constexpr,
                            CHUNK_S: tl.constexpr, EARLY_ANGLES: tl.constexpr):
        # no program returns early (a padding seq, seq_len 0, and an empty partition run through
        # with m -inf, l 0): with FUSED_MERGE the live ones arrive on their (seq, kv_head) counter
        # in `_finish_rows`, after the PDL wait
        seq = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        # before the wait: host-written step inputs, the angle table, weights and, with PREFETCH,
        # the first tile of cached keys (no kernel of the step writes them: the new tokens are
        # taken from registers)
        q_start = tl.load(cu_ptr + seq).to(tl.int64)
        q_len = (tl.load(cu_ptr + seq + 1) - q_start).to(tl.int32)
        seq_len = tl.load(seqlen_ptr + seq).to(tl.int32)
        ctx = seq_len - q_len  # cached tokens before this step's queries
        if KV_QUANT == 1:  # the layer's scales: K's on the scores, V's on acc below
            k_sc = tl.load(ks_ptr)
            v_sc = tl.load(vs_ptr)
            qk_scale = qk_scale * k_sc
        partition, n_live = _partition(seq_len, n_splits, BLOCK_N, 1)
        start = split * partition
        end = tl.minimum(start + partition, seq_len)
        cend = tl.maximum(tl.minimum(end, ctx), start)  # cached keys of this partition: [start, cend)
        half = head_dim // 2
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < head_dim
        pd = tl.where(dd < half, dd + half, dd - half)
        ci = tl.where(dd < half, dd, dd - half)
        # rows: query r // G of the seq at head kvh * G + r % G (`kernels.attention_multi_query`)
        rr = tl.arange(0, BLOCK_R)
        qi = rr // G
        heads = kvh * G + rr % G
        rmask = qi < q_len
        tok = q_start + qi
        qm = rmask[:, None] & dmask[None, :]
        # the new tokens: key j at position ctx + j, this program's where its partition holds it
        jj = tl.arange(0, BLOCK_Q)
        ktok = q_start + jj
        mine = (jj < q_len) & (ctx + jj >= start) & (ctx + jj < end)
        km = mine[:, None] & dmask[None, :]
        qpos = tl.load(pos_ptr + tok, mask=rmask, other=0).to(tl.int64)
        kpos = tl.load(pos_ptr + ktok, mask=mine, other=0).to(tl.int64)
        slots = tl.load(slot_ptr + ktok, mask=mine, other=-1).to(tl.int64)
        if NORM:
            qw = tl.load(qn_ptr + dd, mask=dmask, other=0.0).to(tl.float32)[None, :]
            qwp = tl.load(qn_ptr + pd, mask=dmask, other=0.0).to(tl.float32)[None, :]
            kw = tl.load(kn_ptr + dd, mask=dmask, other=0.0).to(tl.float32)[None, :]
            kwp = tl.load(kn_ptr + pd, mask=dmask, other=0.0).to(tl.float32)[None, :]
        else:  # unused without NORM
            qw = tl.zeros([1, BLOCK_D], tl.float32)
            qwp = qw
            kw = qw
            kwp = qw
        if EARLY_ANGLES:  # q's angle rows [BLOCK_R, BLOCK_D] before the wait (registers held across it)
            qcos = tl.load(cs_ptr + qpos[:, None] * cs_stride + ci[None, :], mask=qm, other=0.0)
            qsin = tl.load(cs_ptr + qpos[:, None] * cs_stride + half + ci[None, :], mask=qm, other=0.0)
        if PREFETCH:  # the first tile of cached keys (the new tokens are past cend)
            nn = start + tl.arange(0, BLOCK_N)
            nm = nn < cend
            off = _kv_offsets(bt_ptr, seq, s_bt, nn, nm, block_size, sc_b, sc_s, sc_h, kvh)
            k0 = tl.load(kc_ptr + off[:, None] + dd[None, :], mask=nm[:, None] & dmask[None, :], other=0)
            v0 = tl.load(vc_ptr + off[:, None] + dd[None, :], mask=nm[:, None] & dmask[None, :], other=0)
            ks0 = kv_row_scales(ks_ptr, off, nm, head_dim, KV_QUANT)  # int8's, 1.0 else
            vs0 = kv_row_scales(vs_ptr, off, nm, head_dim, KV_QUANT)
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
        if not EARLY_ANGLES:
            qcos = tl.load(cs_ptr + qpos[:, None] * cs_stride + ci[None, :], mask=qm, other=0.0)
            qsin = tl.load(cs_ptr + qpos[:, None] * cs_stride + half + ci[None, :], mask=qm, other=0.0)
        q = _rope_rows(q_ptr, tok[:, None] * sq_t + heads[:, None] * sq_h, dd, pd, qm, qcos, qsin, qw, qwp, eps,
                       head_dim, NORM)
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        lo = start
        if PREFETCH:  # the prefetched tile first: its registers free before the new tokens' are taken
            m_i, l_i, acc = _attend_tile(q, kv_tile(k0, q, KV_QUANT), kv_tile(v0, q, KV_QUANT), nm, m_i, l_i, acc,
                                         qk_scale, ks0, vs0, KV_QUANT)
            lo = start + BLOCK_N
        # the new tokens of this partition: rotated, stored, attended from registers before the loop
        # over the cached keys (the online softmax takes its tiles in any order), so that their
        # tiles are not held through it
        kcos = tl.load(cs_ptr + kpos[:, None] * cs_stride + ci[None, :], mask=km, other=0.0)
        ksin = tl.load(cs_ptr + kpos[:, None] * cs_stride + half + ci[None, :], mask=km, other=0.0)
        k_new = _rope_rows(k_ptr, ktok[:, None] * sk_t + kvh * sk_h, dd, pd, km, kcos, ksin, kw, kwp, eps, head_dim,
                           NORM)  # [BLOCK_Q, BLOCK_D], 0 outside this program's new tokens
        v_new = tl.load(v_ptr + ktok[:, None] * sv_t + kvh * sv_h + dd[None, :], mask=km, other=0.0)
        if KV_QUANT == 1:  # the tokens as stored: e4m3 bytes, and their values widened for the dots
            k_st = fp8_bytes(k_new, k_sc)
            v_st = fp8_bytes(v_new, v_sc)
            k_new = kv_tile(k_st, q, KV_QUANT)
            v_new = kv_tile(v_st, q, KV_QUANT)
            k_s_new = 1.0
            v_s_new = 1.0
        elif KV_QUANT == 2:  # the tokens as stored: int8 codes and their scales [BLOCK_Q], codes widened
            k_st, k_s_new = int8_quantize(k_new)
            v_st, v_s_new = int8_quantize(v_new)
            k_new = kv_tile(k_st, q, KV_QUANT)
            v_new = kv_tile(v_st, q, KV_QUANT)
        else:
            k_st = k_new
            v_st = v_new
            k_s_new = 1.0
            v_s_new = 1.0
        # this program owns the new tokens of its partition: it alone writes them
        wr = mine & (slots >= 0)
        c = slots * sc_s + kvh * sc_h
        tl.store(kc_ptr + c[:, None] + dd[None, :], k_st, mask=wr[:, None] & dmask[None, :])
        tl.store(vc_ptr + c[:, None] + dd[None, :], v_st, mask=wr[:, None] & dmask[None, :])
        if KV_QUANT == 2:  # their scales at [slot, kv_head] (= c // head_dim: contiguous, `kv_operands`)
            tl.store(ks_ptr + c // head_dim, k_s_new, mask=wr)
            tl.store(vs_ptr + c // head_dim, v_s_new, mask=wr)
        # causal among the new tokens: the row of query i sees new key j <= i
        valid = mine[None, :] & (jj[None, :] <= qi[:, None])
        m_i, l_i, acc = _attend_masked(q, k_new, v_new, valid, m_i, l_i, acc, qk_scale, k_s_new, v_s_new, KV_QUANT)
        # the cached keys: every one precedes every row's position, no causal mask below cend
        m_i, l_i, acc = _attend_range(q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, seq, s_bt, block_size, sc_b, sc_s,
                                      sc_h, kvh, dd, dd, dmask, head_dim, lo, cend, m_i, l_i, acc, qk_scale, BLOCK_N,
                                      BLOCK_D, KV_QUANT, 0)
        if KV_QUANT == 1:
            acc = acc * v_sc
        # the rows' out offsets and partial rows (`kernels.decode_merge`, indexed by token row)
        orow = tok * so_t + heads * so_h
        prow = (tok * n_heads + heads) * n_splits
        if FUSED_MERGE:  # (never with ONE_SPLIT) the last live program merges all q_len x G rows
            _finish_rows(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, seq, kvh, orow, prow, rmask,
                         q_start, q_len * G, dd, dmask, so_t, so_h, n_heads, n_splits, split, n_live, head_dim, G,
                         MERGE_G, BLOCK_S, CHUNK_S, BLOCK_D)
        else:
            _store_rows(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, orow, prow, rmask, dd, dmask, split, head_dim,
                        ONE_SPLIT)

    def rope_verify_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, cu_seqlens_q, seq_lens,
                           block_tables, scale, max_q_len, max_seq_len=None, q_norm=None, k_norm=None, eps=1e-6,
                           config: dict | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
        """The CUDA path of `rope_paged_verify` (full rotary: cos_sin [positions, D] fp32; shapes
        there): one `_rope_verify_kernel` launch over (seqs, KVH, splits), then the split merge
        (`merge_splits`, nothing with one split or "fused_merge"). max_q_len: the host bound of
        the queries a seq; max_seq_len: of seq_lens (None reads it, a device sync; a CUDA graph
        passes max_model_len). config overrides ROPE_VERIFY_DEFAULTS (block_n, num_warps,
        num_stages, splits, fused_merge, prefetch). k_scale, v_scale: an fp8_e4m3 cache's 0-d fp32
        layer scales, or an int8 cache's fp32 per-token scales [num_blocks, block_size, KVH].
        Every token row of q must belong to a sequence (cu_seqlens_q covers [0, T)); the cache
        contiguous per block (slot * stride(1) addresses a slot). Raises ValueError for a strided
        last dim, a partial rotary or odd head_dim, H not a multiple of KVH, max_q_len x G rows
        that do not fit one program (`fits_multi_query`), a cache not contiguous per block, and
        as `kv_operands`."""
        t, h, d = q.shape
        kvh = k_cache.shape[2]
        if h % kvh or not fits_multi_query(max_q_len, h, kvh):
            raise ValueError(f"rope verify: {max_q_len} queries x {h}/{kvh} heads do not fit one program")
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or cos_sin.stride(-1) != 1:
            raise ValueError(f"rope verify: last strides {q.stride(-1)} {k.stride(-1)} {v.stride(-1)} "
                             f"{cos_sin.stride(-1)}")
        if cos_sin.shape[-1] != d or d % 2:
            raise ValueError(f"rope verify: full rotary only (cos_sin {tuple(cos_sin.shape)}, head_dim {d})")
        if k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
            raise ValueError("rope verify: the KV cache must be contiguous per block")
        g = h // kvh
        b = seq_lens.shape[0]
        out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if b else 0
        if t == 0 or b == 0 or max_seq_len == 0:
            return out
        cfg = {**ROPE_VERIFY_DEFAULTS, **(config or {})}
        bd = triton.next_power_of_2(d)
        block_n = cfg["block_n"] or (64 if bd <= 128 else 32)
        splits = cfg["splits"] or multi_query_splits(b, kvh, max_seq_len, num_sms(q.device), block_n)
        pdl = use_pdl(q.device)
        m, l_, acc = split_buffers(out, splits)
        cnt = merge_counters(out, kvh, splits, cfg["fused_merge"], b)
        kc, vc, ks, vs, quant = kv_operands(k_cache, v_cache, k_scale, v_scale)
        norm = q_norm is not None
        _rope_verify_kernel[(b, kvh, splits)](
            q, k, v, positions, cos_sin, q_norm if norm else q, k_norm if norm else q, slot_mapping, kc, vc,
            block_tables, cu_seqlens_q, seq_lens, out, m, l_, acc, out if cnt is None else cnt, ks, vs,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0),
            out.stride(1), scale * _LOG2E, k_cache.shape[1], splits, h, d, eps,
            G=g, BLOCK_R=max(16, triton.next_power_of_2(max_q_len * g)),
            BLOCK_Q=max(16, triton.next_power_of_2(max_q_len)), BLOCK_N=block_n, BLOCK_D=bd, NORM=norm,
            ONE_SPLIT=splits == 1, USE_PDL=pdl, PREFETCH=_prefetch(cfg, pdl, block_n), FUSED_MERGE=cnt is not None,
            KV_QUANT=quant, **fused_merge_constants(h, kvh, d, splits, cnt is not None, max_q_len),
            EARLY_ANGLES=bool(cfg["early_angles"]),
            num_warps=cfg["num_warps"], **({"num_stages": cfg["num_stages"]} if cfg["num_stages"] else {}),
            **launch_args(pdl))
        merge_splits(m, l_, acc, out, splits, pdl, cnt)  # nothing when the kernel merged
        return out
