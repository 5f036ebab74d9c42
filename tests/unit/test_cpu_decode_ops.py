"""Kestrel's C++ CPU decode ops (`kernels.cpu_decode`, `kernels.ref_fast.CPU_CXX_OPS`) against the
torch references they replace: the RMS norm (residual add fused) against `kernels.norm`'s
references, the decode attention against `kernels.rope_decode.rope_paged_decode`'s CPU path
(`rotary_and_store_kv_ref`, `paged_attention_ref`; `_reference` below where a padding slot of -1
must be skipped, which the CPU store does not) on awkward shapes, both for this CPU's
flavour and the generic build (no ISA flags: what a CPU without AVX-512 or AVX2 runs); the real
SmolLM2 decoding with the switch on and off; and the torch path where the extension is declared
unavailable or its build fails."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import cpu_decode, ref_fast
from kernels.activation import silu_and_mul
from kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import rope_cos_sin, rope_inv_freq

FLAVOURS = sorted({cpu_decode.flavour(), "generic"})


@pytest.fixture(params=FLAVOURS)
def ext(request):
    """The extension of one flavour (built on first use; skipped where it cannot be built here)."""
    e = cpu_decode.extension(request.param)
    if e is None:
        pytest.skip(f"the {request.param} build of the CPU decode ops is not available here")
    return e


@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 7), (17, 100), (64, 4096)])
def test_rms_norm_matches_the_reference(ext, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    for scale, eps in ((1e-3, 1e-5), (1.0, 1e-6), (300.0, 1e-12)):
        base = torch.randn(rows, hidden + 5, generator=g) * scale
        x = base[:, 2:hidden + 2]  # a row-strided view, as a slice of a wider output is
        r = torch.randn(rows, hidden, generator=g) * scale
        w = torch.randn(hidden, generator=g)
        torch.testing.assert_close(ext.rms_norm(x, w, eps), rms_norm_ref(x, w, eps), rtol=4e-6, atol=1e-7)
        out, res = ext.fused_add_rms_norm(x, r, w, eps)
        want, want_res = fused_add_rms_norm_ref(x, r, w, eps)
        assert torch.equal(res, want_res)  # the add is one fp32 rounding either way
        torch.testing.assert_close(out, want, rtol=4e-6, atol=1e-7)


def test_dispatchers_take_the_ops_on_fp32_cpu_rows_only(monkeypatch):
    """With CPU_CXX_OPS the RMSNorm layer and the SiLU-and-mul dispatcher call the extension for
    fp32 [T, hidden] CPU rows (the same values as the references); 3-D per-head views, bf16 and
    the switch off keep the references."""
    from services.worker.layers.norm import RMSNorm

    real = cpu_decode.extension()
    if real is None:
        pytest.skip("the CPU decode ops are not available here")
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setitem(cpu_decode._loaders[cpu_decode.flavour()].state, "ext", Spy())
    monkeypatch.setattr(ref_fast, "CPU_CXX_OPS", True)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.normal_()
    x, r, w = torch.randn(2, 64), torch.randn(2, 64), norm.weight.data
    torch.testing.assert_close(norm(x), rms_norm_ref(x, w, 1e-6), rtol=4e-6, atol=1e-7)
    out, res = norm(x, r)
    assert torch.equal(res, x + r)
    torch.testing.assert_close(out, rms_norm_ref(x + r, w, 1e-6), rtol=4e-6, atol=1e-7)
    silu_and_mul(x)
    assert calls == ["rms_norm", "fused_add_rms_norm", "silu_and_mul"]
    norm(x.view(1, 2, 64))  # 3-D: the reference
    silu_and_mul(x.bfloat16())
    monkeypatch.setattr(ref_fast, "CPU_CXX_OPS", False)
    norm(x)
    norm(x, r)
    silu_and_mul(x)
    assert calls == ["rms_norm", "fused_add_rms_norm", "silu_and_mul"]


def _case(seq_lens, heads, kvh, d, bs, rot=None, seed=0, pad=()):
    """A decode step over a paged cache: one token a sequence, each sequence's blocks a random
    (non-consecutive) pick of the cache's, its new token at position seq_len - 1 (rows in `pad`:
    padding tokens, slot -1). Returns the op's arguments (q, k, v views of one fused qkv row)."""
    g = torch.Generator().manual_seed(seed)
    t = len(seq_lens)
    nbs = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(nbs) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(nbs) + 1
    tables, at = [], 0
    for n in nbs:
        tables.append(perm[at:at + n] + [-1] * (width - n))
        at += n
    bt = torch.tensor(tables, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    pos = lens.long() - 1
    slots = torch.tensor([bt[i, (s - 1) // bs].item() * bs + (s - 1) % bs for i, s in enumerate(seq_lens)])
    for i in pad:
        slots[i] = -1
    table = rope_cos_sin(rope_inv_freq(rot or d, 10000.0), max(seq_lens) + 7)
    qkv = torch.randn(t, (heads + 2 * kvh) * d, generator=g) * 2
    q, k, v = qkv.split([heads * d, kvh * d, kvh * d], -1)
    kc = torch.randn(num_blocks, bs, kvh, d, generator=g)
    vc = torch.randn(num_blocks, bs, kvh, d, generator=g)
    return [q.view(t, heads, d), k.view(t, kvh, d), v.view(t, kvh, d), pos, table, kc, vc, slots, bt, lens,
            d ** -0.5]


def _reference(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale):
    """The torch path the op replaces: `rope_paged_decode` on CPU tensors (q and k rotated in place,
    k and v stored, attention of one query a sequence). With padding slots (< 0), which the CPU store
    does not skip: `apply_rotary_ref` on every row, `store_kv_ref` of the others, `paged_attention_ref`."""
    from kernels.attention import paged_attention_ref, store_kv_ref
    from kernels.rope_decode import rope_paged_decode
    from kernels.rotary import apply_rotary_ref

    t = q.shape[0]
    cu = torch.arange(t + 1, dtype=torch.int32)
    keep = (slot_mapping >= 0).nonzero().flatten()
    if len(keep) == t:
        return rope_paged_decode(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, cu, seq_lens,
                                 block_tables, scale).reshape(t, -1)
    cs = cos_sin.index_select(0, positions)
    qr, kr = apply_rotary_ref(q, cs), apply_rotary_ref(k, cs)
    store_kv_ref(kr[keep], v[keep], k_cache, v_cache, slot_mapping[keep])
    return paged_attention_ref(qr, k_cache, v_cache, cu, seq_lens, block_tables, scale).reshape(t, -1)


CASES = {
    "one_seq_gqa3": dict(seq_lens=[64], heads=9, kvh=3, d=64, bs=16),
    "mixed_lengths_boundaries": dict(seq_lens=[1, 16, 17, 33, 5, 48], heads=9, kvh=3, d=64, bs=16),
    "mha_ratio1": dict(seq_lens=[7, 31, 2], heads=4, kvh=4, d=64, bs=16),
    "odd_block_size_head_dim": dict(seq_lens=[11, 5, 26], heads=6, kvh=2, d=40, bs=5),
    "partial_rotary": dict(seq_lens=[9, 40], heads=8, kvh=2, d=64, bs=16, rot=32),
    "padding_slots": dict(seq_lens=[12, 3, 20], heads=9, kvh=3, d=64, bs=8, pad=(1,)),
    "batch16_long": dict(seq_lens=[300 + 37 * i for i in range(16)], heads=9, kvh=3, d=64, bs=16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decode_attention_matches_rotary_store_and_paged_attention_ref(ext, case):
    args = _case(seed=len(case), **CASES[case])
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    q0, k0 = args[0].clone(), args[1].clone()
    out = ext.decode_attention(*args)
    want = _reference(*ref_args)
    assert out.shape == want.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-6)
    # the cache: the rotated keys bit-equal to the reference rotation's, the values copied, padding
    # slots nowhere written
    assert torch.equal(args[5], ref_args[5]) and torch.equal(args[6], ref_args[6])
    assert torch.equal(args[0], q0) and torch.equal(args[1], k0)  # q and k left as they were


@pytest.mark.parametrize("case", ["mixed_lengths_boundaries", "odd_block_size_head_dim"])
def test_decode_attention_on_the_fused_qkv_row_equals_the_views(ext, case):
    """decode_attention_qkv (the fused projection's output whole) gives decode_attention's bits."""
    c = CASES[case]
    args = _case(seed=3, **c)
    t, heads, kvh, d = args[0].shape[0], c["heads"], c["kvh"], c["d"]
    qkv = torch.as_strided(args[0], (t, (heads + 2 * kvh) * d), (args[0].stride(0), 1))
    more = [a.clone() if isinstance(a, torch.Tensor) else a for a in args[3:]]
    out = ext.decode_attention_qkv(qkv, heads, kvh, d, *more)
    assert torch.equal(out, ext.decode_attention(*args))
    assert torch.equal(more[2], args[5]) and torch.equal(more[3], args[6])
    with pytest.raises(RuntimeError, match="qkv"):
        ext.decode_attention_qkv(qkv, heads, kvh + 1, d, *more)


@pytest.mark.parametrize("rows,n", [(1, 1536), (3, 7), (17, 100)])
def test_silu_and_mul_matches_the_reference(ext, rows, n):
    from kernels.activation import silu_and_mul_ref

    g = torch.Generator().manual_seed(n)
    x = torch.randn(rows, 2 * n + 3, generator=g)[:, 1:2 * n + 1] * 6  # row-strided, |x| up to ~25
    torch.testing.assert_close(ext.silu_and_mul(x), silu_and_mul_ref(x), rtol=4e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="even"):
        ext.silu_and_mul(x[:, 1:])


def test_decode_attention_refuses_bad_arguments_before_writing(ext):
    args = _case([10, 20], heads=9, kvh=3, d=64, bs=16)
    kc = args[5].clone()
    bad = list(args)
    bad[8] = args[8].clone()
    bad[8][1, 1] = 999  # a used block past the cache
    with pytest.raises(RuntimeError, match="block_tables"):
        ext.decode_attention(*bad)
    assert torch.equal(args[5], kc)
    bad = list(args)
    bad[0] = args[0][:, :8]  # 8 heads over 3 KV heads
    with pytest.raises(RuntimeError, match="multiple"):
        ext.decode_attention(*bad)
    bad = list(args)
    bad[9] = torch.tensor([10, 40], dtype=torch.int32)  # its third block is a -1 of the table
    with pytest.raises(RuntimeError):
        ext.decode_attention(*bad)


# ---------------------------------------------------------------- the real model

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.",
           "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter"]
N_NEW = 32


@pytest.fixture(scope="module")
def runner(smollm2_dir):
    from services.worker.model_runner import ModelRunner
    from shared.config import build_config

    cfg = build_config(cli={"model": str(smollm2_dir), "device": "cpu", "dtype": "float32", "kv_cache_gib": 0.05,
                            "max_model_len": 256, "max_num_seqs": 4}, env={})
    return ModelRunner(cfg)


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    return [tok.encode(p).ids for p in PROMPTS]


def _decode_logits(runner, prompts, tokens) -> torch.Tensor:
    """Logits of every decode step when the prompts' prefill is followed by `tokens` (per prompt,
    teacher-forced, all prompts batched a step): [steps, prompts, vocab]."""
    from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
    from tests.runner_driver import step_logits

    bs, greedy = runner.block_size, SamplingParams(temperature=0.0)
    tables, nxt = [], 0
    for p in prompts:
        need = -(-(len(p) + N_NEW) // bs)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    seqs = [ScheduledSeq(f"l{i}", p, 0, tables[i], True, greedy, 0) for i, p in enumerate(prompts)]
    rows = [step_logits(runner, StepPlan(0, seqs))]
    for j in range(N_NEW - 1):
        seqs = [ScheduledSeq(f"l{i}", [tokens[i][j]], len(p) + j, tables[i], True, greedy, j + 1)
                for i, p in enumerate(prompts)]
        rows.append(step_logits(runner, StepPlan(j + 1, seqs)))
    return torch.stack(rows)


def test_smollm2_greedy_decode_and_logits_same_with_the_switch_on_and_off(runner, prompts, monkeypatch):
    """32 greedy tokens of three prompts decoded together (different lengths: several sequences a
    decode step) are the same ids with CPU_CXX_OPS on and off, every decode step took the C++
    attention (30 layers a step), and the logits of the teacher-forced steps agree within 1e-4
    of the largest |logit| (measured: ~2e-6)."""
    from tests.runner_driver import generate

    real = cpu_decode.extension()
    if real is None:
        pytest.skip("the CPU decode ops are not available here")
    calls = {"decode_attention_qkv": 0}

    class Spy:
        def __getattr__(self, name):
            if name in calls:
                calls[name] += 1
            return getattr(real, name)

    monkeypatch.setitem(cpu_decode._loaders[cpu_decode.flavour()].state, "ext", Spy())
    monkeypatch.setattr(ref_fast, "CPU_CXX_OPS", False)
    off = generate(runner, prompts, N_NEW)
    off_logits = _decode_logits(runner, prompts, off)
    assert calls["decode_attention_qkv"] == 0
    monkeypatch.setattr(ref_fast, "CPU_CXX_OPS", True)
    on = generate(runner, prompts, N_NEW)
    assert calls["decode_attention_qkv"] == (N_NEW - 1) * runner.model.args.num_hidden_layers
    on_logits = _decode_logits(runner, prompts, off)
    assert on == off
    err = (on_logits - off_logits).abs().max() / off_logits.abs().max()
    assert err < 1e-4, f"relative logit difference {err:.3g}"


def test_declared_unavailable_extension_keeps_the_torch_path(runner, prompts, monkeypatch):
    """available() False (a CPU or build without it): the switch on runs the torch references,
    the same ids as the switch off."""
    from tests.runner_driver import generate

    monkeypatch.setattr(ref_fast, "CPU_CXX_OPS", False)
    want = generate(runner, prompts[:2], 8)
    monkeypatch.setitem(cpu_decode._loaders[cpu_decode.flavour()].state, "ext", None)
    monkeypatch.setattr(ref_fast, "CPU_CXX_OPS", True)
    assert not cpu_decode.available()
    from services.worker.layers.norm import RMSNorm

    norm = RMSNorm(64, 1e-6)
    norm.weight.data.normal_()
    x = torch.randn(3, 64)
    assert torch.equal(norm(x), rms_norm_ref(x, norm.weight.data, 1e-6))
    assert generate(runner, prompts[:2], 8) == want


def test_a_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    """The build raising (no compiler, no ninja, a compile error) is one warning, not an error."""
    from torch.utils import cpp_extension

    from kernels import cpu_ext

    def broken(**kw):
        raise RuntimeError("Ninja is required to load C++ extensions")

    loader = cpu_ext.Loader(lambda: cpu_decode._make("generic"))
    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setitem(cpu_decode._loaders, cpu_decode.flavour(), loader)
    with caplog.at_level(logging.WARNING, logger=cpu_decode.__name__):
        assert not cpu_decode.available() and not cpu_decode.available()
    msgs = [r.getMessage() for r in caplog.records if "CPU decode ops" in r.getMessage()]
    assert len(msgs) == 1 and "Ninja is required" in msgs[0] and "torch references" in msgs[0]
