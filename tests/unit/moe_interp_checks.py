"""Run the fused-MoE Triton path (kernels/moe_triton.py, through `kernels.moe.fused_moe_triton`)
under TRITON_INTERPRET=1 on small CPU tensors against `kernels.moe.fused_moe_ref` and print
one JSON object {check name: relative error} on a line starting "RESULT ".

Run by `tests/unit/test_moe_interp.py` in a subprocess, because the interpreter switch is
read when triton is first imported. fp32 and fp16 only: the interpreter's tl.dot on bf16
operands gives garbage. The dispatcher sends CPU tensors to the reference, so the Triton
entry is called directly, with explicit small configs (16-wide tiles keep the interpreter's
work small; one case takes the default config).
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from kernels import hybrid_glue, moe, moe_decode_triton, moe_triton  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf on NaN or a shape mismatch."""
    if a.shape != b.shape or not torch.isfinite(a.double()).all():
        return float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cfg(bm: int, bn: int, bk: int, group_m: int = 1) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "num_warps": 4, "num_stages": 2}


# name, T, H, I, E, k, config (None: the default one), ids int32
CASES = [
    ("t1", 1, 48, 40, 8, 2, cfg(16, 16, 32), False),  # one token: 2 experts busy, 6 idle
    ("t3_k1", 3, 40, 24, 8, 1, cfg(16, 32, 16), True),
    ("t40", 40, 80, 48, 8, 2, cfg(16, 32, 32, 2), False),  # T*k / E > BLOCK_M: several tiles an expert
    ("t40_bm32", 40, 56, 40, 8, 2, cfg(32, 16, 64, 4), True),  # H, I not whole tiles, K in one tile
    ("t20_default", 20, 64, 48, 8, 2, None, False),
    ("t40_e2_group4", 40, 48, 32, 2, 2, cfg(16, 16, 16, 4), False),  # the last program group holds used tiles
]


# name, T, k, E, block_m: the one-program alignment against the torch one
ALIGN_CASES = [
    ("align_t1", 1, 8, 128, 16),  # batch-1 decode of Qwen3-30B-A3B's router shape
    ("align_t37_e3", 37, 2, 3, 16),  # E not a power of two, experts over several tiles
    ("align_t300", 300, 4, 16, 32),  # more pairs than one chunk
    ("align_t5_bm1", 5, 2, 8, 1),
]


def align_checks(gen: torch.Generator) -> dict[str, float]:
    """{name: 0.0 when moe_triton.moe_align_triton gives moe.moe_align's layout, else 1.0}:
    the same expert_of_block and padded length, and in each tile the same pair ids (as a
    set: the atomic cursor orders pairs within an expert)."""
    res = {}
    for name, t, k, e, bm in ALIGN_CASES:
        ids = torch.rand(t, e, generator=gen).topk(k, dim=1).indices
        s_ref, b_ref, n_ref = moe.moe_align(ids, e, bm)
        s_got, b_got, n_got = moe_triton.moe_align_triton(ids.int(), e, bm)
        same = (s_got.shape == s_ref.shape and torch.equal(b_got, b_ref) and torch.equal(n_got, n_ref)
                and torch.equal(s_got.view(-1, bm).sort(1).values, s_ref.view(-1, bm).sort(1).values))
        res[name] = 0.0 if same else 1.0
    return res


def router_checks(gen: torch.Generator) -> dict[str, float]:
    """{name: max abs difference of the weights, or inf when the chosen experts differ}:
    moe_triton.topk_softmax_triton against the torch routing, with and without the
    renormalisation, E a power of two and not, fp32 and fp16 logits."""
    from services.worker.layers.moe import topk_softmax

    res = {}
    for name, t, e, k, renorm, dt in [("router_e128_k8", 5, 128, 8, True, torch.float32),
                                      ("router_e60_k4_raw", 7, 60, 4, False, torch.float16),
                                      ("router_e8_k1", 3, 8, 1, True, torch.float32)]:
        logits = torch.randn(t, e, generator=gen).to(dt)
        w_ref, i_ref = topk_softmax(logits, k, renorm)  # CPU tensors: the torch ops
        w_got, i_got = moe_triton.topk_softmax_triton(logits, k, renorm)
        ok = i_got.dtype == torch.int64 and torch.equal(i_got, i_ref) and w_got.dtype == torch.float32
        res[name] = float((w_got - w_ref).abs().max()) if ok else float("inf")
    return res


# name, T, E, k, renormalize, block_m, logits dtype: the router + alignment program
ROUTE_ALIGN_CASES = [
    ("route_align_t1_e128_k8", 1, 128, 8, True, 16, torch.float32),  # Qwen3-30B-A3B's batch-1 decode
    ("route_align_t8_e60_k4_raw", 8, 60, 4, False, 16, torch.float16),  # E not a power of two
    ("route_align_t5_e8_k3_bm1", 5, 8, 3, True, 1, torch.float32),  # experts shared by tokens, tile of 1
    ("route_align_t3_e8_k1", 3, 8, 1, True, 32, torch.float32),
    ("route_align_t6_e4_k4_ties", 6, 4, 4, True, 16, torch.float32),  # every expert every token; equal logits
]


def route_align_checks(gen: torch.Generator) -> dict[str, float]:
    """{name: max abs weight difference, inf unless the ids and the alignment are exactly
    torch's}: moe_decode_triton.route_align_triton against the torch routing then
    moe.moe_align (the same sorted_ids, order within an expert included, tile experts and
    padded length). The routing truth is moe.topk_softmax_ref's math with the top k taken by
    a stable descending sort, so that ties go to the lowest index (torch.topk leaves their
    order open); without ties it is topk_softmax_ref itself."""
    res = {}
    for name, t, e, k, renorm, bm, dt in ROUTE_ALIGN_CASES:
        logits = torch.randn(t, e, generator=gen).to(dt)
        if name.endswith("ties"):
            logits[1] = 0.5  # one token with all-equal logits
        probs = torch.softmax(logits.float(), dim=-1)
        w_ref, i_ref = (v[:, :k] for v in torch.sort(probs, dim=-1, descending=True, stable=True))
        if renorm:
            w_ref = w_ref / w_ref.sum(dim=-1, keepdim=True)
        if not name.endswith("ties"):
            assert torch.equal(i_ref, moe.topk_softmax_ref(logits, k, renorm)[1])
        s_ref, b_ref, n_ref = moe.moe_align(i_ref, e, bm)
        w, i, s, b, n = moe_decode_triton.route_align_triton(logits, k, renorm, bm)
        same = (i.dtype == torch.int64 and torch.equal(i, i_ref) and w.dtype == torch.float32
                and torch.equal(s, s_ref) and torch.equal(b, b_ref) and torch.equal(n, n_ref))
        res[name] = float((w - w_ref).abs().max()) if same else float("inf")
    return res


# name, T, H, I, E, k, renormalize, gate_up config, down plan (None: down_plan's)
DECODE_CASES = [
    ("decode_t1", 1, 48, 40, 16, 4, True, cfg(16, 16, 32), None),  # one row, I not a power of two
    ("decode_t3_shared", 3, 40, 24, 4, 3, False, cfg(16, 32, 16), (4, 32, 4)),  # experts shared by tokens
    ("decode_t8_kloop", 8, 33, 70, 6, 2, True, cfg(16, 16, 32, 2), (8, 32, 4)),  # down K over 3 tiles
    ("decode_t2_k1", 2, 32, 16, 8, 1, True, None, None),
]


def decode_checks(gen: torch.Generator) -> dict[str, float]:
    """{name_dtype: relative error}: moe_decode_triton.fused_moe_decode (router + alignment,
    gate_up, the down projection with the sum over k) against fused_moe_ref on the torch
    routing; and the down kernel alone against a float64 sum (poisoned output: every element
    written once)."""
    res = {}
    for name, t, h, inter, e, k, renorm, conf, plan in DECODE_CASES:
        x = torch.randn(t, h, generator=gen)
        logits = torch.randn(t, e, generator=gen)
        w13 = torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5
        w2 = torch.randn(e, h, inter, generator=gen) / inter ** 0.5
        routing = moe.topk_softmax_ref(logits, k, renorm)
        for dt in (torch.float32, torch.float16):
            xd, w13d, w2d = x.to(dt), w13.to(dt), w2.to(dt)
            got = moe_decode_triton.fused_moe_decode(xd, logits.to(dt), w13d, w2d, k, renorm, config=conf, down=plan)
            assert got.dtype == dt
            ref = moe.fused_moe_ref(xd, w13d, w2d, *moe.topk_softmax_ref(logits.to(dt), k, renorm))
            res[f"{name}_{str(dt).removeprefix('torch.')}"] = rel(got, ref)
            # a shared expert's output and gate (a column of a wider projection) in the down epilogue
            wide = (3 * torch.randn(t, 5, generator=gen)).to(dt)
            gate, sh = wide[:, 3:4], torch.randn(t, h, generator=gen).to(dt)
            got = moe_decode_triton.fused_moe_decode(xd, logits.to(dt), w13d, w2d, k, renorm, config=conf, down=plan,
                                                     shared=(gate, sh))
            combined = hybrid_glue.shared_expert_combine_ref(ref, gate, sh)
            res[f"{name}_shared_{str(dt).removeprefix('torch.')}"] = rel(got, combined)
            # the decoder layer's residual added last in the down kernel (the fused layer path), with
            # and without the shared expert: as the next layer's fused add (in fp32, rounded once)
            r = torch.randn(t, h, generator=gen).to(dt)
            got = moe_decode_triton.fused_moe_decode(xd, logits.to(dt), w13d, w2d, k, renorm, config=conf, down=plan,
                                                     residual=r)
            res[f"{name}_res_{str(dt).removeprefix('torch.')}"] = rel(got, (ref.double() + r.double()).to(dt))
            got = moe_decode_triton.fused_moe_decode(xd, logits.to(dt), w13d, w2d, k, renorm, config=conf, down=plan,
                                                     shared=(gate, sh), residual=r)
            res[f"{name}_shared_res_{str(dt).removeprefix('torch.')}"] = rel(got, (combined.double()
                                                                                   + r.double()).to(dt))
            # GATE_UP "gemv": the routed one-row gate_up and the routed down kernel (two launches), with
            # the default plans, a gate_up plan whose K tiles loop (BLOCK_K 16) over masked column tiles,
            # and with a shared expert and the residual
            dn = str(dt).removeprefix('torch.')
            saved_mode, moe_decode_triton.GATE_UP = moe_decode_triton.GATE_UP, "gemv"
            saved_max, moe_decode_triton.GEMV_MAX_TOKENS = moe_decode_triton.GEMV_MAX_TOKENS, moe_decode_triton.MAX_TOKENS
            try:
                got = moe_decode_triton.fused_moe_decode(xd, logits.to(dt), w13d, w2d, k, renorm, down=plan)
                res[f"{name}_gemv_{dn}"] = rel(got, ref)
                got = moe_decode_triton.fused_moe_decode(xd, logits.to(dt), w13d, w2d, k, renorm, down=plan,
                                                         shared=(gate, sh), residual=r)
                res[f"{name}_gemv_shared_res_{dn}"] = rel(got, (combined.double() + r.double()).to(dt))
            finally:
                moe_decode_triton.GATE_UP, moe_decode_triton.GEMV_MAX_TOKENS = saved_mode, saved_max
            act = moe_decode_triton.moe_gate_up_gemv(xd, logits.to(dt), w13d, k, renorm, plan=(8, 16, 2))
            got = moe_decode_triton.moe_down_routed_triton(act, w2d, logits.to(dt), k, renorm, (4, 16, 2))
            res[f"{name}_gemv_kloop_{dn}"] = rel(got, ref)
        # the down kernel alone, fp32: sum_j w[t, j] * w2[e] @ act[t * k + j] in float64
        w, ids = routing
        act = torch.randn(t * k, inter, generator=gen)
        truth = torch.zeros(t, h, dtype=torch.float64)
        for tt in range(t):
            for j in range(k):
                truth[tt] += float(w[tt, j]) * (w2[int(ids[tt, j])].double() @ act[tt * k + j].double())
        saved = torch.empty
        torch.empty = lambda *a, _e=saved, **kw: _e(*a, **kw).fill_(float("nan"))  # poison the output
        try:
            got = moe_decode_triton.moe_down_sum_triton(act, w2, w, ids.int(), plan)
        finally:
            torch.empty = saved
        res[f"{name}_down_only"] = rel(got, truth)
    return res


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for name, t, h, inter, e, k, conf, int32 in CASES:
        x = torch.randn(t, h, generator=gen)
        w13 = torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5
        w2 = torch.randn(e, h, inter, generator=gen) / inter ** 0.5
        ids = torch.rand(t, e, generator=gen).topk(k, dim=1).indices
        if name == "t40":  # an expert that no token picks, and one that every token picks
            ids[:, 0] = 3
            ids[:, 1] = torch.where(torch.rand(t, generator=gen) < 0.5, 1, 6)
        ids = ids.int() if int32 else ids
        w = torch.softmax(torch.randn(t, k, generator=gen), dim=1)
        for dt in (torch.float32, torch.float16):
            args = (x.to(dt), w13.to(dt), w2.to(dt), w, ids)
            got = moe.fused_moe_triton(*args, config=conf)
            assert got.dtype == dt
            out[f"{name}_{str(dt).removeprefix('torch.')}"] = rel(got, moe.fused_moe_ref(*args))
    # padding rows must not write: a poisoned down-partial buffer is fully overwritten
    # (each pair's row exactly once), checked through the aligned entry at fp32
    t, h, inter, e, k = 5, 32, 16, 8, 2
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=gen) / inter ** 0.5
    ids = torch.rand(t, e, generator=gen).topk(k, dim=1).indices
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=1)
    c = cfg(16, 16, 16)
    s, blocks, _ = moe.moe_align(ids, e, 16)
    saved = torch.empty
    torch.empty = lambda *a, **kw: saved(*a, **kw).fill_(float("nan"))  # poison the workspaces
    try:
        got = moe_triton.fused_moe_aligned(x, w13, w2, w, s, blocks, k, c)
    finally:
        torch.empty = saved
    out["poisoned_workspace_float32"] = rel(got, moe.fused_moe_ref(x, w13, w2, w, ids))
    out.update(align_checks(gen))
    out.update(router_checks(gen))
    out.update(route_align_checks(gen))
    out.update(decode_checks(gen))
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
