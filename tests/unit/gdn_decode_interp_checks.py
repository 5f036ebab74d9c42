"""Run gated DeltaNet's in-place decode kernels (kernels/gdn_decode.py) and the gated RMSNorm
kernel (kernels/norm.py) under TRITON_INTERPRET=1 on small CPU tensors against their torch
references, and print one JSON object {check name: error} on a line starting "RESULT ".

Run by `tests/unit/test_gdn_decode_interp.py` in a subprocess (the interpreter switch is read
when triton is first imported). The dispatchers send CPU tensors to the references, so the
Triton entries are called directly (the layer check swaps them in).

Every state check runs on a cache of S = 7 slots with N = 5 rows on slots [5, 1, 6, 3, 6]
(not in order), has_initial [True, False, False, True, False]: row 1 starts a new sequence
on a slot holding NaN (a reused slot), rows 2 and 4 are two fresh rows on one slot (the
padding rows of a graph step on its scratch slot), slots 0, 2 and 4 belong to no row. The
has_initial flags are read from an int64 row's low bytes, as a CUDA-graph step stages them.
The recurrent step also runs each launch config (`launch_checks`: block_v, program order and
tiles a program of every `gdn_decode.REC_LAUNCH` entry and of the sweep's candidates) at a V
that leaves a partial column tile.
Error values: relative norm error of the outputs and of the unique rows' states; for the
shared slot, the smaller error against either row's state; for slots no row names, 0.0 when
bit-identical, else 1.0.
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from kernels import gdn_decode, norm  # noqa: E402

SLOTS = [5, 1, 6, 3, 6]
INIT = [True, False, False, True, False]
S = 7
UNIQUE = [0, 1, 3]  # rows on a slot of their own
SHARED = (2, 4)  # two fresh rows on slot 6
UNNAMED = [0, 2, 4]  # slots no row names


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf on NaN or a shape mismatch."""
    if a.shape != b.shape or not torch.isfinite(a.double()).all():
        return float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def staged_flags(flags: list[bool]) -> torch.Tensor:
    """has_initial as a CUDA-graph step reads it: a bool view of an int64 row's low bytes."""
    return torch.tensor([int(f) for f in flags], dtype=torch.int64).view(torch.bool)[::8]


def slot_tensors(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    slots = torch.tensor(SLOTS, dtype=torch.int64)
    init = staged_flags(INIT)
    assert init.stride(0) == 8 and init.tolist() == INIT
    return slots, init


def fill(shape, dtype, gen) -> torch.Tensor:
    """A random state cache with NaN in the slots of the fresh rows (1 and 6)."""
    t = torch.randn(shape, generator=gen).to(dtype)
    t[1] = float("nan")
    t[6] = float("nan")
    return t


def state_errors(name: str, got: torch.Tensor, want: torch.Tensor, before: torch.Tensor,
                 alone: dict[int, torch.Tensor]) -> dict[str, float]:
    """got / want: the caches after the kernel / the reference; alone[row]: that row's state
    when run alone (for the shared slot)."""
    res = {f"{name}_state": rel(got[[SLOTS[i] for i in UNIQUE]], want[[SLOTS[i] for i in UNIQUE]])}
    res[f"{name}_shared_slot"] = min(rel(got[6], alone[r]) for r in SHARED)
    res[f"{name}_unnamed_slots"] = 0.0 if torch.equal(got[UNNAMED].nan_to_num(7.0),
                                                      before[UNNAMED].nan_to_num(7.0)) else 1.0
    return res


def conv_checks(gen: torch.Generator) -> dict[str, float]:
    res = {}
    gdn_decode.TUNING["block_c"] = 8  # C = 20: three programs a row, the last one partial
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for w in (2, 3, 4):
            for bias, act in ((True, "silu"), (False, None)):
                c = 20
                name = f"conv_w{w}_{'bias_silu' if bias else 'plain'}_{str(dtype)[6:]}"
                wide = torch.randn(5, c + 11, generator=gen).to(dtype)
                x = wide[:, 3:3 + c]  # row-strided, as a slice of a projection's output
                weight = torch.randn(c, w, generator=gen).to(dtype)
                b = torch.randn(c, generator=gen).to(dtype) if bias else None
                slots, init = slot_tensors(gen)
                cache = fill((S, c, w - 1), dtype, gen)
                ref_cache, before = cache.clone(), cache.clone()
                y = gdn_decode.conv1d_update_slots_triton(x, cache, weight, b, slots, init, act)
                y_ref = gdn_decode.conv1d_update_slots_ref(x, ref_cache, weight, b, slots, init.clone(), act)
                res[f"{name}_out"] = rel(y.float(), y_ref.float())
                alone = {}
                for r in SHARED:
                    c1 = torch.zeros(1, c, w - 1, dtype=dtype)
                    gdn_decode.conv1d_update_slots_ref(x[r:r + 1], c1, weight, b, torch.tensor([0]),
                                                       torch.tensor([False]), act)
                    alone[r] = c1[0].float()
                res.update(state_errors(name, cache.float(), ref_cache.float(), before.float(), alone))
    gdn_decode.TUNING["block_c"] = 512
    return res


def rec_inputs(gen, n, hk, hv, kd, vd, dtype):
    """q, k, v as views of one [N, C] buffer (the convolution's output), a and b of one
    [N, 2 Hv] projection, as the layer hands them over."""
    c = 2 * hk * kd + hv * vd
    mixed = torch.randn(n, c, generator=gen).to(dtype)
    q = mixed[:, :hk * kd].view(n, hk, kd)
    k = mixed[:, hk * kd:2 * hk * kd].view(n, hk, kd)
    v = mixed[:, 2 * hk * kd:].view(n, hv, vd)
    ba = (torch.randn(n, 2 * hv, generator=gen) * 2).to(dtype)
    a_log = torch.empty(hv).uniform_(0.05, 1.0, generator=gen).log().to(dtype)
    dt_bias = torch.randn(hv, generator=gen).to(dtype)
    return q, k, v, ba[:, hv:], ba[:, :hv], a_log, dt_bias


def rec_checks(gen: torch.Generator) -> dict[str, float]:
    res = {}
    # (name, Hk, Hv, K, V, block_v, l2norm): K not a power of two, V not a whole number of
    # BLOCK_V tiles; grouped heads (Hv = 2 Hk) and one value head a key head
    cases = [("rec_g2_k12_v20", 2, 4, 12, 20, 8, True), ("rec_g1_k16_v8", 3, 3, 16, 8, 4, True),
             ("rec_g2_k8_v16_bv16", 1, 2, 8, 16, 16, True), ("rec_nonorm", 2, 4, 16, 8, 8, False)]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for name, hk, hv, kd, vd, bv, l2 in cases:
            name = f"{name}_{str(dtype)[6:]}"
            gdn_decode.TUNING.update(block_v=bv, rec_table=False)  # the fixed config: bv, 1 warp, grid3
            res.update(rec_case(gen, name, hk, hv, kd, vd, dtype, l2, None))
    gdn_decode.TUNING.update(block_v=8, rec_table=True)
    return res


def rec_case(gen, name, hk, hv, kd, vd, dtype, l2, launch) -> dict[str, float]:
    """One recurrent step of the 5 rows through the kernel with `launch` (None: rec_launch)
    and through the reference; the output and slot errors (`state_errors`)."""
    q, k, v, a, b, a_log, dt_bias = rec_inputs(gen, 5, hk, hv, kd, vd, dtype)
    if not l2:  # an unnormalised k makes the delta rule diverge: give unit keys
        k = torch.nn.functional.normalize(k.float(), dim=-1).to(dtype)
    slots, init = slot_tensors(gen)
    cache = fill((S, hv, kd, vd), torch.float32, gen) * 0.3
    ref_cache, before = cache.clone(), cache.clone()
    o = gdn_decode.gated_delta_rule_decode_slots_triton(q, k, v, a, b, a_log, dt_bias, cache, slots, init,
                                                        None, l2, launch=launch)
    o_ref = gdn_decode.gated_delta_rule_decode_slots_ref(q, k, v, a, b, a_log, dt_bias, ref_cache, slots,
                                                         init.clone(), None, l2)
    res = {f"{name}_out": rel(o.float(), o_ref.float())}
    alone = {}
    for r in SHARED:
        s1 = torch.zeros(1, hv, kd, vd)
        gdn_decode.gated_delta_rule_decode_slots_ref(q[r:r + 1], k[r:r + 1], v[r:r + 1], a[r:r + 1],
                                                     b[r:r + 1], a_log, dt_bias, s1, torch.tensor([0]),
                                                     torch.tensor([False]), None, l2)
        alone[r] = s1[0]
    res.update(state_errors(name, cache, ref_cache, before, alone))
    return res


def launches() -> list[tuple[int, str, int, int]]:
    """(block_v, order, items, stages) of the launch-table checks: every REC_LAUNCH entry's, the
    sweep's tiles in both orders and its loops, and loops whose items do not divide the 5 rows'
    tiles (num_warps does not change what the interpreter computes)."""
    out = {(e[1], e[3], e[4], e[5]) for e in gdn_decode.REC_LAUNCH}
    out |= {(bv, o, 1, 1) for bv in (8, 16, 32, 64) for o in gdn_decode.REC_ORDERS}
    out |= {(bv, "flat", items, st) for bv, _, items, st in gdn_decode.REC_LOOP_CANDIDATES}
    out |= {(16, "flat", 3, 2), (64, "flat", 7, 3)}
    return sorted(out)


def launch_name(bv: int, order: str, items: int, stages: int) -> str:
    return f"rec_launch_bv{bv}_{order}" + (f"_i{items}_s{stages}" if items > 1 else "")


def launch_checks(gen: torch.Generator) -> dict[str, float]:
    """Each launch of `launches()` at V = 72 (a partial last column tile for every block_v but
    8; 64: two tiles, the second 8 wide), K = 12, Hv = 4 on Hk = 2, 5 rows, strided q/k/v/a/b
    views, fp32 and bf16; names launch_name(...) + _{dtype}."""
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        for bv, order, items, stages in launches():
            name = f"{launch_name(bv, order, items, stages)}_{str(dtype)[6:]}"
            res.update(rec_case(gen, name, 2, 4, 12, 72, dtype, True, (bv, 1, order, items, stages)))
    return res


def norm_checks(gen: torch.Generator) -> dict[str, float]:
    res = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        n, h, d = 3, 4, 24
        x = torch.randn(n, h, d, generator=gen).to(dtype)
        wide = torch.randn(n, h * d + 40, generator=gen).to(dtype)
        z = wide[:, 40:].view(n, h, d)  # strided gate, as z sliced from in_proj_qkvz's output
        w = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype)
        out = norm.rms_norm_gated_triton(x, z, w, 1e-6)
        res[f"norm3d_{str(dtype)[6:]}"] = rel(out.float(), norm.rms_norm_gated_ref(x, z, w, 1e-6).float())
        x2, z2 = x.reshape(n * h, d), torch.randn(n * h, d, generator=gen).to(dtype)
        out2 = norm.rms_norm_gated_triton(x2, z2, w, 1e-6)
        res[f"norm2d_{str(dtype)[6:]}"] = rel(out2.float(), norm.rms_norm_gated_ref(x2, z2, w, 1e-6).float())
    return res


def layer_checks(gen: torch.Generator) -> dict[str, float]:
    """GatedDeltaNet decode steps on a state cache, the kernels swapped in, against the
    gathered path (IN_PLACE_DECODE off: gather, the references, scatter), both layouts, fp32;
    three steps: rows 0 and 3 continue throughout, row 1 starts on its NaN slot and then
    continues, rows 2 and 4 stay fresh rows on one slot (padding)."""
    from services.worker.layers import gated_deltanet as gdn_mod
    from services.worker.layers.gated_deltanet import GatedDeltaNet
    from services.worker.state_cache import StateCache, StateSpec, StepState

    res = {}
    cfg = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_act="silu")
    for layout in GatedDeltaNet.LAYOUTS:
        layer = GatedDeltaNet.from_hf_config(cfg, layout)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            layer.A_log.copy_(torch.empty(4).uniform_(0.05, 1.0, generator=gen).log())
        shapes = layer.state_shapes()
        spec = StateSpec(tuple(s.shape for s in shapes), tuple(s.dtype for s in shapes))
        caches = [StateCache([spec], S - 1, "cpu") for _ in range(2)]  # S - 1 slots + the scratch slot
        for t, twin in zip(caches[0].layers[0], caches[1].layers[0]):
            t.copy_(torch.randn(t.shape, generator=gen))
            t[1] = float("nan")
            t[6] = float("nan")
            twin.copy_(t)
        outs = []
        for in_place, cache in zip((True, False), caches):
            gdn_mod.IN_PLACE_DECODE = in_place
            saved = (gdn_mod.conv1d_update_slots, gdn_mod.gated_delta_rule_decode_slots, gdn_mod.rms_norm_gated)
            if in_place:
                gdn_mod.conv1d_update_slots = gdn_decode.conv1d_update_slots_triton
                gdn_mod.gated_delta_rule_decode_slots = gdn_decode.gated_delta_rule_decode_slots_triton
                gdn_mod.rms_norm_gated = norm.rms_norm_gated_triton
            g = torch.Generator().manual_seed(11)
            step_outs = []
            for step in range(3):
                flags = INIT if step == 0 else [True, True, False, True, False]  # rows 2, 4: padding
                st = StepState(cache, torch.tensor(SLOTS), staged_flags(flags), torch.arange(6, dtype=torch.int32),
                               [1] * 5)
                with torch.no_grad():
                    step_outs.append(layer.forward_step(torch.randn(5, 32, generator=g), st, 0))
            gdn_mod.conv1d_update_slots, gdn_mod.gated_delta_rule_decode_slots, gdn_mod.rms_norm_gated = saved
            outs.append(step_outs)
        gdn_mod.IN_PLACE_DECODE = True
        res[f"layer_{layout}_out"] = max(rel(a, b) for a, b in zip(*outs))
        res[f"layer_{layout}_state"] = max(rel(a[[5, 1, 3]], b[[5, 1, 3]])
                                           for a, b in zip(caches[0].layers[0], caches[1].layers[0]))
    return res


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    res = {}
    res.update(conv_checks(gen))
    res.update(rec_checks(gen))
    res.update(norm_checks(gen))
    res.update(layer_checks(gen))
    res.update(launch_checks(gen))  # last: the checks above keep their random inputs
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
