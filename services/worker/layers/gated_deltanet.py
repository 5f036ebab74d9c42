"""Gated DeltaNet, the linear-attention layer of Qwen3-Next (and, in another projection
layout, of Qwen3.5), with the checkpoint's parameter names.

Algorithm: Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks" (arXiv 2412.06464), in the
form of Hugging Face transformers' `Qwen3NextGatedDeltaNet` (transformers 5.24), whose math
and names this layer follows: in_proj_qkvz and in_proj_ba project the hidden state; q, k, v
go through a short depthwise causal convolution (conv1d, SiLU); beta = sigmoid(b), the log
decay g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule runs with L2-normalised
q and k (`kernels.gated_delta_rule`); its output is RMS-normalised per value head and gated
by silu(z) (norm), then out_proj.

Each sequence carries two states between steps (what a state-slot cache group allocates,
`state_shapes`): the convolution's last W-1 inputs [C, W-1] in the model dtype and the
recurrent state [Hv, K, V] in fp32.

Decode (one token a sequence, `IN_PLACE_DECODE`): the convolution and the recurrent step run
on the state slots where they lie (`kernels.gdn_decode`, docs/ARCHITECTURE.md §4.7): no
gather of the step's states and no scatter back, q/k L2 norms, beta and the decay inside the
recurrent kernel; then the gated RMSNorm and out_proj. Prefill chunks take the chunked
kernel over gathered states.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.gated_delta_rule import (
    causal_conv1d,
    causal_conv1d_update,
    gated_delta_rule_decode,
    gated_delta_rule_prefill,
)
from kernels.gdn_decode import conv1d_update_slots, gated_delta_rule_decode_slots
from kernels.norm import rms_norm, rms_norm_gated
from services.worker.layers.linear import Linear
from services.worker.state_cache import StepState
from services.worker.layers.module import Module

# Decode steps update the state slots in place (`GatedDeltaNet._decode`). False: the earlier
# path, kept for A/B measurement (benchmarks/decode_latency.py --variants): the step's states
# gathered, the reference convolution, fla's fused recurrent kernel, scattered back.
IN_PLACE_DECODE = True


@dataclass(frozen=True)
class StateShape:
    """One per-sequence state tensor of a recurrent layer: its shape (without the sequence
    dimension) and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one sequence's state."""
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class _ConvWeight(Module):
    """Holds the checkpoint's `conv1d.weight` [C, 1, W] (a depthwise nn.Conv1d's layout)."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width), requires_grad=False)


class RMSNormGated(Module):
    """Per-head gated RMSNorm with weight [head_v_dim] (`kernels.norm.rms_norm_gated_ref`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated(x, gate, self.weight, self.eps)


class GatedDeltaNet(Module):
    """Qwen3-Next's linear-attention layer over a varlen batch, carrying per-sequence state.

    hidden_size H; num_k_heads Hk and num_v_heads Hv (Hv a multiple of Hk: each key head
    serves Hv/Hk consecutive value heads); head_k_dim K, head_v_dim V; conv_kernel W (the
    short convolution's width); eps: the gated norm's epsilon; activation: the convolution's
    ("silu"). Parameters (uninitialised until loaded), named as in the checkpoint:
    in_proj_qkvz.weight [2*Hk*K + 2*Hv*V, H] (rows grouped per key head: q [K], k [K],
    v [r*V], z [r*V] with r = Hv/Hk), in_proj_ba.weight [2*Hv, H] (per key head: b [r],
    a [r]), conv1d.weight [C, 1, W] with C = 2*Hk*K + Hv*V (channels q, k, v, each flat),
    dt_bias [Hv], A_log [Hv], norm.weight [V], out_proj.weight [H, Hv*V]. layout "qwen3_5"
    (Qwen3.5's checkpoints): in_proj_qkv [2*Hk*K + Hv*V, H] (q, k, v flat, the conv's channel
    order) and in_proj_z [Hv*V, H] stacked as in_proj_qkvz's two shards, in_proj_b and
    in_proj_a [Hv, H] as in_proj_ba's (`QWEN3_5_PACKED` for the model's packed_modules).
    stacked=True: the two projections are one, `in_proj` [rows of in_proj_qkvz + rows of
    in_proj_ba, H] (one launch at batch 1), its shards the checkpoint's tensors in the order
    above (`packed_modules(layout, stacked=True)`); its output is split by views.

    forward(x [T, H], cu_seqlens [N+1] int32, conv_state [N, C, W-1], ssm_state
    [N, Hv, K, V] fp32, has_initial_state [N] bool or None) -> [T, H] in x's dtype.
    T tokens of N sequences back to back, each sequence at least one token; sequence i
    continues from conv_state[i] / ssm_state[i], or from zeros where has_initial_state[i] is
    False (whatever the slot holds, NaN included; None: every sequence continues). Both states
    are updated in place to the states after the sequence's last token. A step of one token
    a sequence (T == N) takes the decode kernels, any other the chunked prefill.
    Raises ValueError from `from_hf_config` on a config without the linear-attention fields.
    """

    LAYOUTS = ("qwen3_next", "qwen3_5")

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel: int, eps: float, activation: str = "silu",
                 layout: str = "qwen3_next", stacked: bool = False):
        super().__init__()
        if layout not in self.LAYOUTS:
            raise ValueError(f"layout {layout!r} is not one of {self.LAYOUTS}")
        self.layout = layout
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads {num_v_heads} is not a multiple of num_k_heads {num_k_heads}")
        self.hidden_size = hidden_size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_kernel = conv_kernel
        self.activation = activation
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        r = num_v_heads // num_k_heads
        self._qkvz_split = [head_k_dim, head_k_dim, r * head_v_dim, r * head_v_dim]
        # the checkpoint's projections, as shards: Qwen3-Next's in_proj_qkvz, in_proj_ba;
        # Qwen3.5's flat q, k, v (the conv's channel order), z, b, a
        qkvz = ([2 * self.key_dim + 2 * self.value_dim] if layout == "qwen3_next"
                else [2 * self.key_dim + self.value_dim, self.value_dim])
        ba = [2 * num_v_heads] if layout == "qwen3_next" else [num_v_heads, num_v_heads]
        self.qkvz_rows = sum(qkvz)
        self.stacked = stacked
        self.in_proj: Linear | None = Linear(hidden_size, qkvz + ba) if stacked else None
        self.in_proj_qkvz: Linear | None = None if stacked else Linear(hidden_size, qkvz if len(qkvz) > 1 else qkvz[0])
        self.in_proj_ba: Linear | None = None if stacked else Linear(hidden_size, ba if len(ba) > 1 else ba[0])
        self.conv1d = _ConvWeight(self.conv_dim, conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_v_heads), requires_grad=False)
        self.norm = RMSNormGated(head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden_size)

    # the Qwen3.5 checkpoints' projections -> (our stacked projection, shard), for a model's
    # packed_modules (layout "qwen3_5")
    QWEN3_5_PACKED: dict[str, tuple[str, int]] = {
        "in_proj_qkv": ("in_proj_qkvz", 0), "in_proj_z": ("in_proj_qkvz", 1),
        "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1),
    }

    @classmethod
    def packed_modules(cls, layout: str, stacked: bool) -> dict[str, tuple[str, int]]:
        """The checkpoint projections of a layer of `layout` -> (our stacked projection,
        shard), for a model's packed_modules: unstacked {} (Qwen3-Next: the checkpoint's
        own two) or `QWEN3_5_PACKED`; stacked, every input projection into `in_proj`."""
        if not stacked:
            return {} if layout == "qwen3_next" else dict(cls.QWEN3_5_PACKED)
        names = (("in_proj_qkvz", "in_proj_ba") if layout == "qwen3_next"
                 else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
        return {n: ("in_proj", i) for i, n in enumerate(names)}

    def project(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (qkvz [T, rows of in_proj_qkvz], ba [T, 2*Hv]): one product when
        stacked (the two are column views of its output, no copy), else two. norm_weight
        [H] / eps: an RMSNorm of x first, inside the (first) projection's kernel
        (`Linear`'s prologue; the fused layer path); apart, that projection also stores the
        normalised x (xn_out) for the second to read."""
        if self.in_proj is not None:
            y = self.in_proj(x) if norm_weight is None else self.in_proj(x, norm_weight=norm_weight, eps=eps)
            return y[:, :self.qkvz_rows], y[:, self.qkvz_rows:]
        assert self.in_proj_qkvz is not None and self.in_proj_ba is not None
        if norm_weight is None:
            return self.in_proj_qkvz(x), self.in_proj_ba(x)
        xn = torch.empty_like(x)
        qkvz = self.in_proj_qkvz(x, norm_weight=norm_weight, eps=eps, xn_out=xn)
        return qkvz, self.in_proj_ba(xn)

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], layout: str = "qwen3_next",
                       stacked: bool = False) -> GatedDeltaNet:
        """Build from a Qwen3-Next config.json mapping (linear_num_key_heads,
        linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
        linear_conv_kernel_dim, hidden_size, rms_norm_eps, hidden_act). Raises ValueError
        naming a missing field."""
        need = ("hidden_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim")
        missing = [f for f in need if f not in cfg]
        if missing:
            raise ValueError(f"config lacks gated DeltaNet fields: {missing}")
        return cls(cfg["hidden_size"], cfg["linear_num_key_heads"], cfg["linear_num_value_heads"],
                   cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"],
                   cfg.get("rms_norm_eps", 1e-6), cfg.get("hidden_act", "silu"), layout, stacked)

    def forward_step(self, x: torch.Tensor, state: StepState, index: int, *,
                     norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` over one runner step, this layer being the model's `index`-th recurrent
        layer (services/worker/state_cache.py). x [T, H] -> [T, H]. A decode step (every seq
        one token, none tracked; `IN_PLACE_DECODE`) updates the seqs' state slots in place
        (`_decode`); any other step gathers the seqs' states from their slots, runs, and
        writes them back.
        The fused layer path (services/worker/fusion.py): norm_weight [H] / eps, an RMSNorm
        of x first; residual [T, H], added to the output. In the in-place decode they run
        inside the projections' kernels (the input projection's prologue, out_proj's
        epilogue); on the other paths as their own ops (the reference's rounding: the sum in
        x's dtype)."""
        if IN_PLACE_DECODE and not state.track and x.shape[0] == len(state.seq_lens_host):
            conv_all, ssm_all = state.cache.layers[index]
            return self._decode(x, conv_all, ssm_all, state.slots, state.has_initial, norm_weight, eps, residual)
        if norm_weight is not None or residual is not None:
            out = self.forward_step(x if norm_weight is None else rms_norm(x, norm_weight, eps), state, index)
            return out if residual is None else out + residual
        conv, ssm = state.gather(index)  # fresh seqs' states already zeros: no second zeroing
        lens = state.seq_lens_host
        if state.track:
            out = self._forward_tracked(x, state, index, conv, ssm)
        elif 1 in lens and max(lens) > 1:  # decodes beside prefill chunks: each kind its own kernel
            out = torch.empty_like(x)
            cu = [0]
            for n in lens:
                cu.append(cu[-1] + n)
            self._forward_group(x, cu, [i for i, n in enumerate(lens) if n == 1], conv, ssm, out)
            self._forward_group(x, cu, [i for i, n in enumerate(lens) if n > 1], conv, ssm, out)
        else:
            out = self.forward(x, state.cu_seqlens, conv, ssm)
        state.scatter(index, (conv, ssm))
        return out

    def _forward_group(self, x: torch.Tensor, cu: list[int], seqs: list[int], conv: torch.Tensor,
                       ssm: torch.Tensor, out: torch.Tensor) -> None:
        """`forward` over the step's seqs `seqs` (indices; cu: the step's token offsets) as one
        varlen batch, their rows of `out` and their states in conv / ssm updated in place.
        Decodes (one token a seq) and prefill chunks run apart, so that a decode takes the
        recurrent kernel whatever else the step holds: fla's chunked and recurrent kernels
        round differently (TF32), and a seq's tokens must not depend on its neighbours."""
        if not seqs:
            return
        rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in seqs]).to(x.device)
        sub_cu = [0]
        for i in seqs:
            sub_cu.append(sub_cu[-1] + cu[i + 1] - cu[i])
        pick = torch.tensor(seqs, device=x.device)
        c, s = conv.index_select(0, pick), ssm.index_select(0, pick)
        out[rows] = self.forward(x.index_select(0, rows), torch.tensor(sub_cu, dtype=torch.int32, device=x.device),
                                 c, s)
        conv.index_copy_(0, pick, c)
        ssm.index_copy_(0, pick, s)

    def _forward_tracked(self, x: torch.Tensor, state: StepState, index: int, conv: torch.Tensor,
                         ssm: torch.Tensor) -> torch.Tensor:
        """A step with verify seqs (state.track): the other seqs as varlen batches (decodes
        and prefill chunks apart, `_forward_group`); each
        tracked seq token by token through the decode path (the same math as plain decoding),
        its state after every token kept (`StepState.keep`) for the rollback to the accepted
        drafts (`StepState.commit`). conv, ssm: the step's gathered states, updated in place."""
        cu = [0]
        for n in state.seq_lens_host:
            cu.append(cu[-1] + n)
        out = torch.empty_like(x)
        lens = state.seq_lens_host
        plain = [i for i, n in enumerate(state.track) if n == 0]
        self._forward_group(x, cu, [i for i in plain if lens[i] == 1], conv, ssm, out)
        self._forward_group(x, cu, [i for i in plain if lens[i] > 1], conv, ssm, out)
        one = torch.tensor([0, 1], dtype=torch.int32, device=x.device)
        for i, n in enumerate(state.track):
            if n == 0:
                continue
            c, s = conv[i:i + 1].clone(), ssm[i:i + 1].clone()
            kept = []
            for t in range(cu[i], cu[i + 1]):
                out[t:t + 1] = self.forward(x[t:t + 1], one, c, s)
                kept.append([c.clone(), s.clone()])
            state.keep(index, i, kept)
            conv[i:i + 1], ssm[i:i + 1] = c, s
        return out

    def state_shapes(self) -> tuple[StateShape, StateShape]:
        """The per-sequence states: (conv [C, W-1] in the model dtype, ssm [Hv, K, V] fp32)."""
        return (StateShape((self.conv_dim, self.conv_kernel - 1), self.dt_bias.dtype),
                StateShape((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32))

    def _split(self, qkvz: torch.Tensor, ba: torch.Tensor):
        """The per-key-head groups of the two projections -> q, k [T, Hk, K], v, z [T, Hv, V],
        b, a [T, Hv]."""
        t = qkvz.shape[0]
        if self.layout == "qwen3_5":  # flat: [q | k | v | z], [b | a]
            q, k, v, z = torch.split(qkvz, [self.key_dim, self.key_dim, self.value_dim, self.value_dim], dim=-1)
            b, a = torch.split(ba, self.num_v_heads, dim=-1)
            return (q.reshape(t, self.num_k_heads, self.head_k_dim), k.reshape(t, self.num_k_heads, self.head_k_dim),
                    v.reshape(t, self.num_v_heads, self.head_v_dim), z.reshape(t, self.num_v_heads, self.head_v_dim),
                    b, a)
        q, k, v, z = torch.split(qkvz.view(t, self.num_k_heads, -1), self._qkvz_split, dim=-1)
        b, a = torch.split(ba.view(t, self.num_k_heads, -1), self.num_v_heads // self.num_k_heads, dim=-1)
        v, z = v.reshape(t, self.num_v_heads, self.head_v_dim), z.reshape(t, self.num_v_heads, self.head_v_dim)
        return q, k, v, z, b.reshape(t, self.num_v_heads), a.reshape(t, self.num_v_heads)

    def _decode_inputs(self, qkvz: torch.Tensor, ba: torch.Tensor):
        """A decode step's projections -> (mixed [N, C]: the convolution's input channels q, k,
        v; z [N, Hv, V]; b, a [N, Hv]). Qwen3.5's flat layout gives them as views (no copy);
        Qwen3-Next's per-key-head groups are gathered (`_split`, one concatenation)."""
        t = qkvz.shape[0]
        if self.layout == "qwen3_5":
            z = qkvz[:, self.conv_dim:].view(t, self.num_v_heads, self.head_v_dim)
            return qkvz[:, :self.conv_dim], z, ba[:, :self.num_v_heads], ba[:, self.num_v_heads:]
        q, k, v, z, b, a = self._split(qkvz, ba)
        return torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1), z, b, a

    def _decode(self, x: torch.Tensor, conv_all: torch.Tensor, ssm_all: torch.Tensor, slots: torch.Tensor,
                has_initial: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each of N seqs, x [N, H] -> [N, H], row i on state slot slots[i] of
        conv_all [S, C, W-1] and ssm_all [S, Hv, K, V] (updated in place; from zeros where
        has_initial[i] is False: `kernels.gdn_decode`). The math of `forward`'s decode.
        norm_weight / eps: RMSNorm x inside the input projection (`project`); residual
        [N, H]: added inside out_proj (the fused layer path)."""
        t = x.shape[0]
        mixed, z, b, a = self._decode_inputs(*self.project(x, norm_weight, eps))
        weight = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        mixed = conv1d_update_slots(mixed, conv_all, weight, None, slots, has_initial, self.activation)
        kd, hk = self.head_k_dim, self.num_k_heads
        q = mixed[:, :self.key_dim].view(t, hk, kd)
        k = mixed[:, self.key_dim:2 * self.key_dim].view(t, hk, kd)
        v = mixed[:, 2 * self.key_dim:].view(t, self.num_v_heads, self.head_v_dim)
        o = gated_delta_rule_decode_slots(q, k, v, a, b, self.A_log, self.dt_bias, ssm_all, slots, has_initial)
        o = self.norm(o, z).reshape(t, self.value_dim)
        return self.out_proj(o) if residual is None else self.out_proj(o, residual=residual)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor,
                ssm_state: torch.Tensor, has_initial_state: torch.Tensor | None = None) -> torch.Tensor:
        t, n = x.shape[0], cu_seqlens.numel() - 1
        if t == n and IN_PLACE_DECODE:  # one token a sequence: the in-place decode, sequence i on state i
            slots = torch.arange(n, device=x.device)
            init = (torch.ones(n, dtype=torch.bool, device=x.device) if has_initial_state is None
                    else has_initial_state.to(device=x.device, dtype=torch.bool))
            return self._decode(x, conv_state, ssm_state, slots, init)
        if has_initial_state is not None:  # fresh sequences start from zeros, whatever the slot holds
            fresh = ~has_initial_state.to(device=x.device, dtype=torch.bool)
            conv_state.masked_fill_(fresh[:, None, None], 0)
            ssm_state.masked_fill_(fresh[:, None, None, None], 0)
        q, k, v, z, b, a = self._split(*self.project(x))
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)  # [T, C]
        weight = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        decode = t == n  # every sequence has one token
        if decode:
            mixed, new_conv = causal_conv1d_update(mixed, conv_state, weight, None, self.activation)
        else:
            mixed, new_conv = causal_conv1d(mixed, weight, None, conv_state, cu_seqlens, self.activation)
        conv_state.copy_(new_conv)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(t, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv] fp32, <= 0
        if decode:  # N sequences of one token: [N, 1, heads, dim]
            o, final = gated_delta_rule_decode(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                               initial_state=ssm_state, use_qk_l2norm=True)
        else:  # one varlen row: [1, T, heads, dim]
            o, final = gated_delta_rule_prefill(q[None], k[None], v[None], g[None], beta[None],
                                                initial_state=ssm_state, use_qk_l2norm=True,
                                                cu_seqlens=cu_seqlens)
        ssm_state.copy_(final)
        o = self.norm(o.reshape(t, self.num_v_heads, self.head_v_dim), z)
        return self.out_proj(o.reshape(t, self.value_dim))
