"""Rotary position embedding (RoPE, Su et al. 2021), "neox" layout.

The rotated pairs are (x[i], x[i + rot_dim/2]), the layout of Hugging Face's `rotate_half`
(Llama checkpoints in HF format are permuted for it). The frequency table comes from
`rope_inv_freq`, with Llama 3 scaling (`rope_type: llama3`) when asked.

Dispatchers `apply_rotary` (out of place) and `rotary_and_store_kv` (q and k rotated in
place, then k and v written to the paged KV cache through the slot mapping, one launch on
the GPU) pick the torch references on the CPU and the Triton kernels at the bottom of this
file on CUDA tensors when Triton imports.
"""

from __future__ import annotations

import math

import torch

from kernels.attention import store_kv_ref, triton_reads
from kernels.norm import rms_norm_ref

apply_rotary_triton = None  # set below when Triton imports: same signature as apply_rotary_ref
rotary_and_store_kv_triton = None  # same signature as rotary_and_store_kv_ref


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/rot_dim), i < rot_dim/2, as fp32 [rot_dim // 2].

    scaling: the config's rope scaling dict, or None. Supported `rope_type`s: "default",
    "llama3" (keys factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings; formula of Meta's Llama 3.1 reference code).
    Raises NotImplementedError for other rope types.
    """
    # fp32, as Hugging Face computes it, so that angles match its reference bit for bit
    inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    cfg = scaling or {}
    kind = cfg.get("rope_type", cfg.get("type", "default"))
    if kind == "default":
        return inv
    if kind != "llama3":
        raise NotImplementedError(f"rope scaling type {kind!r} is not supported")
    factor = float(cfg["factor"])
    low, high = float(cfg["low_freq_factor"]), float(cfg["high_freq_factor"])
    old_len = float(cfg["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int,
                 attention_scaling: float = 1.0) -> torch.Tensor:
    """Table of cos and sin per position: fp32 [max_positions, rot_dim] = cat(cos, sin),
    on inv_freq's device."""
    t = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling


def apply_rotary_ref(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate every head of x by its token's angles (out of place).

    x: [num_tokens, num_heads, head_dim]; pass q and k together as one view of the fused
    qkv output (heads of q then of k) to rotate both in one call.
    cos_sin: [num_tokens, rot_dim] fp32 (the `rope_cos_sin` rows of the tokens' positions);
    rot_dim <= head_dim, the dims past rot_dim pass through (partial rotary).
    Returns [num_tokens, num_heads, head_dim], x's dtype. Math in fp32 then cast, as
    Hugging Face does for fp32; for bf16 HF casts cos/sin first, so results may differ by
    one bf16 ulp.
    """
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    xr = x[..., : 2 * half].float()
    x1, x2 = xr[..., :half], xr[..., half:]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if 2 * half != x.shape[-1]:
        parts.append(x[..., 2 * half:].float())
    return torch.cat(parts, dim=-1).to(x.dtype)


def rope_factors(cos_sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The step's rotary factors for `rotate_with_factors_`, made once per step and shared by
    the layers: (cos2, sin2) fp32 [T, 1, rot_dim], cos2 = [cos, cos], sin2 = [-sin, sin] of
    the tokens' rows of the `rope_cos_sin` table (positions [T] int64). None for an odd
    rot_dim; `rotary_and_store_kv_ref` uses them only where rot_dim == head_dim (no partial
    rotary)."""
    half = cos_sin.shape[-1] // 2
    if 2 * half != cos_sin.shape[-1]:
        return None
    cs = cos_sin.index_select(0, positions)[:, None, :]
    cos, sin = cs[..., :half], cs[..., half:]
    return torch.cat((cos, cos), -1), torch.cat((sin.neg(), sin), -1)


def rotate_with_factors_(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor]) -> None:
    """`apply_rotary_ref` in place for fp32 x [T, H, head_dim] (unit stride in the last dim)
    with full rotary, from `rope_factors`: x * [cos, cos] + [x2, x1] * [-sin, sin]. Bit-equal
    to the reference: x1 * cos + x2 * (-sin) is x1 * cos - x2 * sin in IEEE arithmetic (a
    negated product is the product of the negated factor; a - b is a + (-b)), and each op
    rounds once in fp32 as there; 4 ATen ops instead of ~13."""
    cos2, sin2 = factors
    half = x.shape[-1] // 2
    rot = torch.cat((x[..., half:], x[..., :half]), -1)
    x.mul_(cos2).add_(rot.mul_(sin2))


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Dispatcher for `apply_rotary_ref` (see there for shapes)."""
    if x.is_cuda and apply_rotary_triton is not None:
        return apply_rotary_triton(x, cos_sin)
    return apply_rotary_ref(x, cos_sin)


def rotary_and_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                            eps: float = 1e-6, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None,
                            factors: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Rotate q and k in place by their tokens' angles, then store k and v in the KV cache
    (quantized there when k_scale, v_scale are the scales of a quantized cache: `store_kv_ref`).

    q_norm, k_norm: optional [head_dim] weights of an RMSNorm over each head of q and of k
    applied first (Qwen3's q_norm / k_norm, `kernels.norm.rms_norm_ref` with eps); both or
    neither.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (views
    of the fused qkv output are fine: the last dim must have unit stride).
    positions: [num_tokens] int64. cos_sin: the whole `rope_cos_sin` table, fp32
    [max_positions, rot_dim]. k_cache, v_cache, slot_mapping: see `store_kv_ref`.
    Math as `apply_rotary_ref`. factors: the step's `rope_factors` (fp32 q and k with full
    rotary: the rotation runs in place, `rotate_with_factors_`, same values); None: built
    here. Raises ValueError when only one of q_norm, k_norm is given.
    """
    if q_norm is not None or k_norm is not None:
        if q_norm is None or k_norm is None:
            raise ValueError("rotary: q_norm and k_norm are both given or neither")
        q.copy_(rms_norm_ref(q, q_norm, eps))
        k.copy_(rms_norm_ref(k, k_norm, eps))
    t, h, d = q.shape
    kvh = k.shape[1]
    fast = factors is not None and q.dtype == torch.float32 and factors[0].shape[-1] == d
    f = factors if fast else None
    # q and k adjacent (views of one qkv row: rotate in one call); one token's row stride is
    # moot (a [1, H, d] view of a row may report another), which the factor path uses
    same_strides = q.stride() == k.stride() or (fast and t == 1 and q.stride()[1:] == k.stride()[1:])
    if (k.dim() == 3 and same_strides and k.data_ptr() == q.data_ptr()
            + h * q.stride(1) * q.element_size() and q.stride(1) == d):
        qk = q.as_strided((t, h + kvh, d), q.stride())
        if f is not None:
            rotate_with_factors_(qk, f)
        else:
            qk.copy_(apply_rotary_ref(qk, cos_sin.index_select(0, positions)))
    elif f is not None:
        rotate_with_factors_(q, f)
        rotate_with_factors_(k, f)
    else:
        cs = cos_sin.index_select(0, positions)
        q.copy_(apply_rotary_ref(q, cs))
        k.copy_(apply_rotary_ref(k, cs))
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rotary_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                        q_norm=None, k_norm=None, eps: float = 1e-6, k_scale=None, v_scale=None) -> None:
    """Dispatcher for `rotary_and_store_kv_ref` (see there for shapes); the Triton kernel on
    CUDA for a cache in the model dtype, fp8_e4m3 (quantized with its layer's scales) or int8
    (per token and head), the reference elsewhere."""
    if q.is_cuda and rotary_and_store_kv_triton is not None and triton_reads(k_cache):
        return rotary_and_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                                          q_norm, k_norm, eps, k_scale, v_scale)
    rotary_and_store_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps,
                            k_scale, v_scale)


# ---------------------------------------------------------------- Triton (CUDA)
# One program per token: it rotates the token's q heads and k heads (fp32 math, cast back),
# writes them back in place and, when a cache is given, stores the rotated k and v rows at
# the token's slot. A slot < 0 (padding rows of a CUDA graph) stores nothing. An fp8_e4m3 cache
# (KV_QUANT 1) gets the rows quantized with the layer's scales, an int8 cache (KV_QUANT 2) each
# row quantized per token and head with its scale stored (`kernels.kv_quant_triton`).

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dispatchers keep the references
    triton = None

if triton is not None:
    from kernels.kv_int8_triton import int8_codes, int8_quantize, int8_scale
    from kernels.kv_quant_triton import kv_cast_store, kv_operands
    from kernels.pdl import launch_args, pdl_release, pdl_wait, use_pdl

    @triton.jit
    def _rotate_heads(x_ptr, tok, sx_t, sx_h, n_heads, cos, sin, half,
                      c_ptr, slot, sc_s, sc_h, nw_ptr, eps, c_scale, STORE: tl.constexpr, NORM: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, KV_QUANT: tl.constexpr):
        hh = tl.arange(0, BLOCK_H)[:, None]
        ii = tl.arange(0, BLOCK_HALF)[None, :]
        m = (hh < n_heads) & (ii < half)
        p1 = x_ptr + tok * sx_t + hh * sx_h + ii
        x1 = tl.load(p1, mask=m, other=0.0)
        x2 = tl.load(p1 + half, mask=m, other=0.0)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        if NORM:  # RMSNorm over each head first (full rotary only), rounded as rms_norm_ref
            r = tl.rsqrt((tl.sum(x1f * x1f, 1) + tl.sum(x2f * x2f, 1)) / (2 * half) + eps)[:, None]
            w1 = tl.load(nw_ptr + ii, mask=ii < half, other=0.0).to(tl.float32)
            w2 = tl.load(nw_ptr + half + ii, mask=ii < half, other=0.0).to(tl.float32)
            x1f = ((x1f * r).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
            x2f = ((x2f * r).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
        o1 = (x1f * cos - x2f * sin).to(x1.dtype)
        o2 = (x2f * cos + x1f * sin).to(x1.dtype)
        tl.store(p1, o1, mask=m)
        tl.store(p1 + half, o2, mask=m)
        if STORE:
            c1 = c_ptr + slot * sc_s + hh * sc_h + ii
            tl.store(c1, kv_cast_store(o1, c_scale, KV_QUANT), mask=m)
            tl.store(c1 + half, kv_cast_store(o2, c_scale, KV_QUANT), mask=m)
        return o1, o2  # the rotated halves [BLOCK_H, BLOCK_HALF] in x's dtype (0 in masked lanes)

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, qn_ptr, kn_ptr,
                       ks_ptr, vs_ptr, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc_s, sc_h, cs_stride,
                       n_q, n_k, half, head_dim, eps, HAS_K: tl.constexpr, STORE: tl.constexpr,
                       NORM: tl.constexpr, USE_PDL: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                       KV_QUANT: tl.constexpr):
        # positions and the angle table are written before the step's first kernel (a host
        # copy; a table made at load): read before the wait
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        ii = tl.arange(0, BLOCK_HALF)[None, :]
        cos = tl.load(cs_ptr + pos * cs_stride + ii, mask=ii < half, other=0.0)
        sin = tl.load(cs_ptr + pos * cs_stride + half + ii, mask=ii < half, other=0.0)
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
        _rotate_heads(q_ptr, tok, sq_t, sq_h, n_q, cos, sin, half, q_ptr, 0, 0, 0, qn_ptr, eps, 1.0,
                      False, NORM, BLOCK_H, BLOCK_HALF, False)
        if HAS_K:
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            if STORE and KV_QUANT == 2 and slot >= 0:  # int8: whole rows quantized, scales at [slot, head]
                hh = tl.arange(0, BLOCK_H)[:, None]
                dd = tl.arange(0, BLOCK_D)[None, :]
                m = (hh < n_k) & (dd < head_dim)
                mp = m & (dd >= 2 * half)  # partial rotary: pass-through dims of k
                k1, k2 = _rotate_heads(k_ptr, tok, sk_t, sk_h, n_k, cos, sin, half, kc_ptr, 0, 0, 0,
                                       kn_ptr, eps, 1.0, False, NORM, BLOCK_H, BLOCK_HALF, 0)
                kp = tl.load(k_ptr + tok * sk_t + hh * sk_h + dd, mask=mp, other=0.0)
                amax = tl.maximum(tl.maximum(tl.max(tl.abs(k1.to(tl.float32)), 1), tl.max(tl.abs(k2.to(tl.float32)), 1)),
                                  tl.max(tl.abs(kp.to(tl.float32)), 1))
                k_s, k_inv = int8_scale(amax)
                ii = tl.arange(0, BLOCK_HALF)[None, :]
                mh = (hh < n_k) & (ii < half)
                c1 = kc_ptr + slot * sc_s + hh * sc_h + ii
                tl.store(c1, int8_codes(k1, k_inv[:, None]), mask=mh)
                tl.store(c1 + half, int8_codes(k2, k_inv[:, None]), mask=mh)
                tl.store(kc_ptr + slot * sc_s + hh * sc_h + dd, int8_codes(kp, k_inv[:, None]), mask=mp)
                vv = tl.load(v_ptr + tok * sv_t + hh * sv_h + dd, mask=m, other=0.0)
                v8, v_s = int8_quantize(vv)
                tl.store(vc_ptr + slot * sc_s + hh * sc_h + dd, v8, mask=m)
                hs = tl.arange(0, BLOCK_H)
                tl.store(ks_ptr + slot * n_k + hs, k_s, mask=hs < n_k)
                tl.store(vs_ptr + slot * n_k + hs, v_s, mask=hs < n_k)
            elif STORE and slot >= 0:
                k_sc = 1.0
                v_sc = 1.0
                if KV_QUANT == 1:
                    k_sc = tl.load(ks_ptr)
                    v_sc = tl.load(vs_ptr)
                _rotate_heads(k_ptr, tok, sk_t, sk_h, n_k, cos, sin, half, kc_ptr, slot,
                              sc_s, sc_h, kn_ptr, eps, k_sc, True, NORM, BLOCK_H, BLOCK_HALF, KV_QUANT)
                hh = tl.arange(0, BLOCK_H)[:, None]
                dd = tl.arange(0, BLOCK_D)[None, :]
                m = (hh < n_k) & (dd < head_dim)
                vv = tl.load(v_ptr + tok * sv_t + hh * sv_h + dd, mask=m, other=0.0)
                tl.store(vc_ptr + slot * sc_s + hh * sc_h + dd, kv_cast_store(vv, v_sc, KV_QUANT), mask=m)
                mp = m & (dd >= 2 * half)  # partial rotary: pass-through dims of k
                kp = tl.load(k_ptr + tok * sk_t + hh * sk_h + dd, mask=mp, other=0.0)
                tl.store(kc_ptr + slot * sc_s + hh * sc_h + dd, kv_cast_store(kp, k_sc, KV_QUANT), mask=mp)
            else:
                _rotate_heads(k_ptr, tok, sk_t, sk_h, n_k, cos, sin, half, kc_ptr, 0, 0, 0,
                              kn_ptr, eps, 1.0, False, NORM, BLOCK_H, BLOCK_HALF, False)

    def _launch(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_norm=None, k_norm=None,
                eps=1e-6, k_scale=None, v_scale=None):
        t, nq, d = q.shape
        half = cos_sin.shape[-1] // 2
        has_k, store = k is not None, k_cache is not None
        nk = k.shape[1] if has_k else 0
        if (q.stride(-1) != 1 or (has_k and k.stride(-1) != 1) or (store and v.stride(-1) != 1)
                or cos_sin.stride(-1) != 1):
            raise ValueError("rotary kernel: the last dim of q, k, v and cos_sin needs unit stride")
        if store and (k_cache.stride(2) != k_cache.shape[3] or k_cache.stride(1) != k_cache.shape[2] * k_cache.shape[3]):
            raise ValueError("rotary kernel: the KV cache must be contiguous per block")
        if t == 0:
            return
        kk = k if has_k else q
        vv = v if store else q
        kc, vc, ks, vs, quant = kv_operands(k_cache, v_cache, k_scale, v_scale) if store else (q, q, q, q, 0)
        sl = slot_mapping if store else positions
        norm = q_norm is not None
        pdl = use_pdl(q.device)
        _rotary_kernel[(t,)](
            q, kk, vv, positions, cos_sin, kc, vc, sl, q_norm if norm else q, k_norm if norm else q, ks, vs,
            q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), vv.stride(0), vv.stride(1),
            kc.stride(1) if store else 0, kc.stride(2) if store else 0, cos_sin.stride(0),
            nq, nk, half, d, eps, HAS_K=has_k, STORE=store, NORM=norm, USE_PDL=pdl,
            BLOCK_H=triton.next_power_of_2(max(nq, nk)), BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_D=triton.next_power_of_2(d), KV_QUANT=quant, **launch_args(pdl))

    def rotary_and_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                                   q_norm=None, k_norm=None, eps: float = 1e-6, k_scale=None,
                                   v_scale=None) -> None:
        """Triton `rotary_and_store_kv_ref` (same shapes); one launch, one program per token,
        the per-head q/k RMSNorm fused in when its weights are given (full rotary only: a
        partial rotary normalises first, with `kernels.norm.rms_norm`). k_scale, v_scale: an
        fp8_e4m3 cache's 0-d fp32 layer scales (the rows are stored quantized), or an int8
        cache's fp32 scales [num_blocks, block_size, num_kv_heads] (each rotated K row and V row
        quantized per token and head as `kernels.kv_quant.quantize_int8`, its scale written).
        Slots < 0 are skipped (CUDA-graph padding). Raises ValueError on a strided last dim,
        and as `kernels.kv_quant_triton.kv_operands`."""
        if q_norm is not None and 2 * (cos_sin.shape[-1] // 2) != q.shape[-1]:
            from kernels.norm import rms_norm
            q.copy_(rms_norm(q, q_norm, eps))
            k.copy_(rms_norm(k, k_norm, eps))
            q_norm = k_norm = None
        _launch(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps, k_scale, v_scale)

    def apply_rotary_triton(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """Triton `apply_rotary_ref` (same shapes): cos_sin holds the tokens' rows."""
        out = x.contiguous().clone() if x.is_contiguous() else x.contiguous()
        pos = torch.arange(x.shape[0], device=x.device)
        _launch(out, None, None, pos, cos_sin.contiguous(), None, None, None)
        return out
