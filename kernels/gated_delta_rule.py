"""The gated delta rule (gated DeltaNet's linear attention) and its short causal convolution.

Algorithm: Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta
Rule" (arXiv 2412.06464). Per head, a state S [K, V] (fp32) is carried over the tokens:

    S   = exp(g_t) * S                      # gated decay, g_t <= 0 (log space)
    d_t = beta_t * (v_t - S^T k_t)          # delta rule: the correction of what S predicts
    S   = S + k_t d_t^T
    o_t = S^T (scale * q_t)

`gated_delta_rule_recurrent_ref` runs that loop token by token (decode, verify);
`gated_delta_rule_chunked_ref` computes the same in chunks of 64 tokens (prefill): within a
chunk the deltas solve one unit lower-triangular system (the WY / UT-transform form of the
paper's §3), across chunks the state is carried once a chunk.

Layouts (fla-core's, so that the dispatchers hand tensors to it unchanged):
q, k [B, T, Hk, K]; v [B, T, Hv, V] with Hv a multiple of Hk (value head h reads key head
h // (Hv // Hk), a grouped head repeat); g [B, T, Hv] fp32 (log decay); beta [B, T, Hv];
state [N, Hv, K, V] fp32. Varlen batches: B = 1 and `cu_seqlens [N+1]`, one state per sequence.

Dispatchers `gated_delta_rule_prefill` / `gated_delta_rule_decode` take fla-core's Triton
kernels (`chunk_gated_delta_rule`, `fused_recurrent_gated_delta_rule`; package `fla`, the
`gpu` extra) for CUDA tensors when fla imports, else the references. fla is imported on the
first CUDA call only (it probes the device at import).

The short convolution (`causal_conv1d_ref`, `causal_conv1d_update_ref`) is depthwise over
channels, width W, causal, with a per-sequence state of the last W-1 inputs [N, C, W-1]; its
dispatchers keep the references for now (fla's convolution keeps a state of width W: a
different slot layout).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # the chunked form's chunk length (fla's default)
L2NORM_EPS = 1e-6  # q/k L2 norm: x / sqrt(sum(x^2) + eps), as fla computes it


# ---------------------------------------------------------------- gated delta rule: references

def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             scale: float | None, use_qk_l2norm: bool):
    """fp32, heads first ([B, Hv, T, *]), key heads repeated to Hv, q/k normed, q scaled."""
    hk, hv = k.shape[2], v.shape[2]
    if q.shape != k.shape or hv % hk or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"bad shapes: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be {tuple(v.shape[:3])}")
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    return q, k, v, g.float().transpose(1, 2), beta.float().transpose(1, 2)


def _initial(initial_state: torch.Tensor | None, b: int, hv: int, kd: int, vd: int,
             device: torch.device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(b, hv, kd, vd, dtype=torch.float32, device=device)
    if tuple(initial_state.shape) != (b, hv, kd, vd):
        raise ValueError(f"initial_state {tuple(initial_state.shape)} must be {(b, hv, kd, vd)}")
    return initial_state.float().clone()


def gated_delta_rule_recurrent_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                                   scale: float | None = None, use_qk_l2norm: bool = False,
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time (the recurrence of the module docstring).

    q, k: [B, T, Hk, K]; v: [B, T, Hv, V], Hv a multiple of Hk; g: [B, T, Hv] log decay (<= 0,
    fp32); beta: [B, T, Hv] in (0, 1); initial_state: [B, Hv, K, V] (None: zeros); scale: the
    query scale (None: K ** -0.5); use_qk_l2norm: L2-normalise q and k first (in fp32).
    Returns (o [B, T, Hv, V] in v's dtype, final_state [B, Hv, K, V] fp32); all math in fp32.
    Raises ValueError on inconsistent shapes.
    """
    b, t, hv, vd = v.shape
    q, k, v32, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    s = _initial(initial_state, b, hv, k.shape[-1], vd, v.device)
    o = torch.empty(b, hv, t, vd, dtype=torch.float32, device=v.device)
    decay = g.exp()
    for i in range(t):
        s = s * decay[:, :, i, None, None]
        k_i = k[:, :, i]
        delta = (v32[:, :, i] - torch.einsum("bhkv,bhk->bhv", s, k_i)) * beta[:, :, i, None]
        s = s + k_i[..., :, None] * delta[..., None, :]
        o[:, :, i] = torch.einsum("bhkv,bhk->bhv", s, q[:, :, i])
    return o.transpose(1, 2).to(v.dtype), s


def gated_delta_rule_chunked_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                                 scale: float | None = None, use_qk_l2norm: bool = False,
                                 chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule_recurrent_ref` in the chunked (WY / UT transform) form, for prefill.

    Same arguments, shapes, dtypes and result (equal within fp32 rounding). Per chunk of L
    tokens, with G_t the cumulative log decay inside the chunk and S0 the state entering it:
    the deltas D [L, V] solve (I + A) D = diag(beta) V - diag(beta exp(G)) K S0, where
    A[t, i] = beta_t exp(G_t - G_i) k_t.k_i for i < t (unit lower triangular system, solved
    once for both right-hand sides); then O = diag(exp(G)) Q S0 + (Q K^T o decay, causal) D and
    S_L = exp(G_L) S0 + (K o exp(G_L - G))^T D. T need not be a multiple of the chunk: the tail
    is padded with k = v = beta = g = 0, which leaves outputs and state unchanged.
    """
    b, t, hv, vd = v.shape
    q, k, v32, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    kd = k.shape[-1]
    s = _initial(initial_state, b, hv, kd, vd, v.device)
    pad = (-t) % chunk_size
    if pad:
        q, k, v32 = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v32))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    nc, c = (t + pad) // chunk_size, chunk_size
    q, k, v32 = (x.reshape(b, hv, nc, c, -1) for x in (q, k, v32))
    g, beta = g.reshape(b, hv, nc, c), beta.reshape(b, hv, nc, c)

    cum = g.cumsum(-1)  # [b, hv, nc, c]: log decay from the chunk's start through token t
    causal = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
    # decay[t, i] = exp(G_t - G_i) for i <= t, else 0 (masked before the exp: no overflow)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    a = (k_beta @ k.transpose(-1, -2)) * decay
    a = a.masked_fill(~causal.tril(-1), 0.0) + torch.eye(c, dtype=a.dtype, device=a.device)
    rhs = torch.cat([v32 * beta[..., None], k_beta * cum.exp()[..., None]], dim=-1)
    sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u, w = sol[..., :vd], sol[..., vd:]  # D = u - w @ S0
    qk = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]  # decay from token i to the chunk's end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [b, hv, nc, 1, 1]

    o = torch.empty(b, hv, nc, c, vd, dtype=torch.float32, device=v.device)
    for n in range(nc):
        delta = u[:, :, n] - w[:, :, n] @ s
        o[:, :, n] = q_dec[:, :, n] @ s + qk[:, :, n] @ delta
        s = s * chunk_decay[:, :, n] + k_dec[:, :, n].transpose(-1, -2) @ delta
    o = o.reshape(b, hv, nc * c, vd)[:, :, :t]
    return o.transpose(1, 2).to(v.dtype), s


def _varlen_ref(ref, q, k, v, g, beta, initial_state, scale, use_qk_l2norm, cu_seqlens):
    """Run a [B, T] reference over each sequence of a varlen batch (B = 1, cu_seqlens [N+1])."""
    if q.shape[0] != 1:
        raise ValueError(f"a varlen batch has B = 1, not {q.shape[0]}")
    bounds = cu_seqlens.tolist()
    n = len(bounds) - 1
    hv, kd, vd = v.shape[2], k.shape[3], v.shape[3]
    if initial_state is not None and initial_state.shape[0] != n:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states for {n} sequences")
    o = torch.empty_like(v)
    states = torch.empty(n, hv, kd, vd, dtype=torch.float32, device=v.device)
    for i in range(n):
        lo, hi = bounds[i], bounds[i + 1]
        h0 = None if initial_state is None else initial_state[i:i + 1]
        o[:, lo:hi], states[i:i + 1] = ref(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi],
                                           h0, scale, use_qk_l2norm)
    return o, states


# ---------------------------------------------------------------- gated delta rule: dispatchers

_FLA: Any = None  # None: not tried yet; False: fla does not import; else its two functions


def fla_ops() -> tuple[Any, Any] | None:
    """fla-core's (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule), or None when the
    package does not import (imported once, on first use)."""
    global _FLA
    if _FLA is None:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
            _FLA = (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)
        except Exception:  # not installed, or its Triton set-up fails on this platform
            _FLA = False
    return _FLA or None


def _fla_for(x: torch.Tensor) -> tuple[Any, Any] | None:
    return fla_ops() if x.is_cuda else None


def gated_delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                             scale: float | None = None, use_qk_l2norm: bool = False,
                             cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule: fla's `chunk_gated_delta_rule` on CUDA, else
    `gated_delta_rule_chunked_ref` (see there for shapes and dtypes).

    cu_seqlens: None, or [N+1] int (cumulative sequence lengths) for a varlen batch with B = 1;
    then initial_state is [N, Hv, K, V] (None: zeros) and the final state [N, Hv, K, V].
    Returns (o [B, T, Hv, V] in v's dtype, final_state fp32). Nothing is written in place.
    """
    fla = _fla_for(q)
    if fla is not None:
        return fla[0](q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                      use_qk_l2norm_in_kernel=use_qk_l2norm,
                      cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())
    if cu_seqlens is None:
        return gated_delta_rule_chunked_ref(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
    return _varlen_ref(gated_delta_rule_chunked_ref, q, k, v, g, beta, initial_state, scale, use_qk_l2norm,
                       cu_seqlens)


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                            scale: float | None = None, use_qk_l2norm: bool = False,
                            cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule (decode: T = 1 a sequence; verify: a few tokens): fla's
    `fused_recurrent_gated_delta_rule` on CUDA, else `gated_delta_rule_recurrent_ref`.

    Shapes and dtypes as `gated_delta_rule_prefill` (decode of N sequences: q [N, 1, Hk, K],
    initial_state [N, Hv, K, V], no cu_seqlens). Returns (o, final_state fp32).
    """
    fla = _fla_for(q)
    if fla is not None:
        return fla[1](q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                      output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
                      cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())
    if cu_seqlens is None:
        return gated_delta_rule_recurrent_ref(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
    return _varlen_ref(gated_delta_rule_recurrent_ref, q, k, v, g, beta, initial_state, scale,
                       use_qk_l2norm, cu_seqlens)


# ---------------------------------------------------------------- short causal convolution

def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(y)
    if activation is None:
        return y
    raise ValueError(f"unsupported activation {activation!r} (silu or None)")


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      conv_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                      activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over a varlen batch, each sequence continuing its state.

    x: [T, C], the tokens of N sequences back to back (cu_seqlens [N+1] int; None: one
    sequence); weight: [C, W]; bias: [C] or None; conv_state: [N, C, W-1], the W-1 inputs that
    came before each sequence, oldest first (None: zeros); activation: "silu" or None.
    y[t, c] = act(bias[c] + sum_j weight[c, j] * x'[t - (W-1) + j, c]), x' the sequence's
    inputs preceded by its state (the convolution of `torch.nn.Conv1d` with groups = C and
    left padding W-1, as Qwen3-Next's short convolution). Math in fp32.
    Returns (y [T, C] in x's dtype, final_state [N, C, W-1] in conv_state's dtype, else x's:
    the last W-1 inputs of each sequence, state included where a sequence is shorter).
    No host sync: positions are gathered with tensor indices. Raises ValueError on shapes.
    """
    t, c = x.shape
    w = weight.shape[-1]
    if weight.shape != (c, w):
        raise ValueError(f"weight {tuple(weight.shape)} must be [{c}, W]")
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, t], dtype=torch.int64, device=x.device)
    n = cu_seqlens.numel() - 1
    if conv_state is None:
        conv_state = torch.zeros(n, c, w - 1, dtype=x.dtype, device=x.device)
    if tuple(conv_state.shape) != (n, c, w - 1):
        raise ValueError(f"conv_state {tuple(conv_state.shape)} must be {(n, c, w - 1)}")
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
    # one buffer: the N states' W-1 columns as rows, then the T tokens
    buf = torch.cat([conv_state.float().transpose(1, 2).reshape(n * (w - 1), c), x.float()])

    def rows(seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Buffer rows of positions `pos` (negative: into the state) of sequences `seq`."""
        return torch.where(pos >= 0, n * (w - 1) + cu[seq] + pos, seq * (w - 1) + (w - 1) + pos)

    tok = torch.arange(t, device=x.device)
    seq = torch.searchsorted(cu[1:], tok, right=True)
    pos = tok - cu[seq]
    wf = weight.float()
    y = torch.zeros(t, c, dtype=torch.float32, device=x.device) if bias is None else bias.float().expand(t, c)
    for j in range(w):  # tap j reads position pos - (W-1) + j
        y = y + buf[rows(seq, pos - (w - 1) + j)] * wf[:, j]
    seqs = torch.arange(n, device=x.device)
    lens = cu[1:] - cu[:-1]
    last = lens[:, None] - (w - 1) + torch.arange(w - 1, device=x.device)  # [N, W-1]
    final = buf[rows(seqs[:, None].expand_as(last), last)].transpose(1, 2)  # [N, C, W-1]
    return _activate(y, activation).to(x.dtype), final.to(conv_state.dtype)


def causal_conv1d_update_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None = None, activation: str | None = "silu",
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence through `causal_conv1d_ref`'s convolution.

    x: [N, C]; conv_state: [N, C, W-1]; weight: [C, W]; bias: [C] or None.
    Returns (y [N, C] in x's dtype, new_state [N, C, W-1] in conv_state's dtype: the state
    shifted left by one with x appended). Math in fp32; nothing is written in place.
    """
    n, c = x.shape
    w = weight.shape[-1]
    if weight.shape != (c, w) or tuple(conv_state.shape) != (n, c, w - 1):
        raise ValueError(f"x {tuple(x.shape)}, conv_state {tuple(conv_state.shape)}, weight "
                         f"{tuple(weight.shape)} do not agree")
    window = torch.cat([conv_state.float(), x.float()[:, :, None]], dim=-1)  # [N, C, W]
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return _activate(y, activation).to(x.dtype), window[:, :, 1:].to(conv_state.dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  conv_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                  activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher for `causal_conv1d_ref` (see there): the reference on every device for now."""
    return causal_conv1d_ref(x, weight, bias, conv_state, cu_seqlens, activation)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = "silu",
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher for `causal_conv1d_update_ref` (see there): the reference for now."""
    return causal_conv1d_update_ref(x, conv_state, weight, bias, activation)
