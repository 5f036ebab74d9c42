"""Dense references of the EAGLE-3 head and the DFlash drafter for the proposer tests: the
papers' forward in plain torch over whole tensors (no paged cache, no kernel of ours), reading
the proposers' parameters, the target's features from a fresh prefill
(`spec_head_rig.target_features`). Device-agnostic (the tests run them on the CPU and on
CUDA)."""

from __future__ import annotations

import torch

from kernels.cpu_linear import dense
from services.worker.spec.dflash import DFlashProposer
from services.worker.spec.eagle import EagleProposer
from tests.unit.spec_head_rig import target_features


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-layout RoPE of x [T, heads, d] at positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention, q [Tq, h, d], k/v [Tk, kvh, d] (GQA), mask [Tq, Tk] bool or None
    -> [Tq, h * d]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(q.shape[0], -1)


def mlp(x: torch.Tensor, m) -> torch.Tensor:
    gu = x @ dense(m.gate_up_proj.weight).T
    gate, up = gu.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ dense(m.down_proj.weight).T


def eagle_dense(p: EagleProposer, runner, context: list[int], drafts: list[int], temperature: float,
                table: list[int]) -> torch.Tensor:
    """q [len(drafts), vocab] of EAGLE-3 over `context` (its last token at position m, the
    next step's first input), each step fed the previous draft: every context position p
    holds the pair (fc(features at p - 1) or 0, token p), step i at m + i attends causally."""
    head, a = p.head, p.args
    m = len(context) - 1
    dev = head.fc.weight.device
    feats = target_features(runner, context[:m], table)
    g = feats @ dense(head.fc.weight).T
    f = torch.cat([torch.zeros(1, a.hidden_size, device=dev), g])  # the feature of each position 0..m
    emb = (head.embed_tokens or runner.model.model.embed_tokens).weight
    layer, att = head.midlayer, head.midlayer.self_attn
    eps, theta, hd = a.rms_norm_eps, a.rope_theta, a.head_dim
    wk, wv = dense(att.kv_proj.weight).split(att.kv_size)

    def pair(tok_emb, feat):
        return torch.cat([rms(tok_emb, layer.input_layernorm.weight, eps), rms(feat, layer.hidden_norm.weight, eps)], -1)

    def kv(x, pos):
        k = rope((x @ wk.T).view(-1, a.num_key_value_heads, hd), pos, theta)
        return k, (x @ wv.T).view(-1, a.num_key_value_heads, hd)

    x = pair(emb[torch.tensor(context, device=dev)], f)
    keys, vals = kv(x, torch.arange(m + 1, device=dev))
    cur_x, cur_f, qs = x[m:], f[m:], []
    for i, d in enumerate(drafts):
        q = rope((cur_x @ dense(att.q_proj.weight).T).view(1, a.num_attention_heads, hd), torch.tensor([m + i], device=dev), theta)
        resid = rms(cur_f, layer.hidden_norm.weight, eps) if layer.norm_before_residual else cur_f
        h1 = attend(q, keys, vals, None) @ dense(att.o_proj.weight).T + resid
        h2 = mlp(rms(h1, layer.post_attention_layernorm.weight, eps), layer.mlp) + h1
        logits = rms(h2, head.norm.weight, eps) @ dense(head.lm_head.weight).T
        if head.targets is not None:
            full = torch.full((1, head.target_vocab), float("-inf"), device=dev)
            full[:, head.targets] = logits
            logits = full
        qs.append(torch.softmax(logits / temperature, -1))
        cur_x, cur_f = pair(emb[torch.tensor([d], device=dev)], h2), h2
        k1, v1 = kv(cur_x, torch.tensor([m + i + 1], device=dev))
        keys, vals = torch.cat([keys, k1]), torch.cat([vals, v1])
    return torch.cat(qs)


def dflash_dense(p: DFlashProposer, runner, context: list[int], n: int, temperature: float,
                 table: list[int]) -> torch.Tensor:
    """q [n, vocab] of DFlash's block after `context` (its last token at position m opens the
    block): z-lab/dflash's DFlashDraftModel forward over whole tensors."""
    d, a = p.drafter, p.args
    m = len(context) - 1
    c = rms(target_features(runner, context[:m], table) @ dense(d.fc.weight).T, d.hidden_norm.weight, a.rms_norm_eps)
    emb = runner.model.model.embed_tokens.weight
    dev = d.fc.weight.device
    x = emb[torch.tensor([context[m]] + [p.mask_token_id] * n, device=dev)]
    pb, pc = torch.arange(m, m + n + 1, device=dev), torch.arange(m, device=dev)
    heads, kvh, hd, eps, theta = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps, a.rope_theta

    def norm(t, w):
        return t if w is None else rms(t, w.weight, eps)

    def keys(att, src, pos):
        wk, wv = dense(att.kv_proj.weight).split(att.kv_size)
        return rope(norm((src @ wk.T).view(-1, kvh, hd), att.k_norm), pos, theta), (src @ wv.T).view(-1, kvh, hd)

    for layer in d.decoder_layers:
        att = layer.self_attn
        h = rms(x, layer.input_layernorm.weight, eps)
        q = rope(norm((h @ dense(att.q_proj.weight).T).view(-1, heads, hd), att.q_norm), pb, theta)
        kb, vb = keys(att, h, pb)
        kc, vc = keys(att, c, pc)
        x = x + attend(q, torch.cat([kc, kb]), torch.cat([vc, vb]), None) @ dense(att.o_proj.weight).T
        x = x + mlp(rms(x, layer.post_attention_layernorm.weight, eps), layer.mlp)
    logits = rms(x[1:], d.norm.weight, eps) @ dense(runner.model.lm_head.weight).T
    return torch.softmax(logits / temperature, -1)
