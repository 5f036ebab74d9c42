"""The rejection-sampling Triton kernel (kernels/rejection_sampling_triton.py) on CUDA against
the torch reference and against the statistics it must keep.

- Per-row tokens and accept flags equal the reference's on the same CUDA tensors, rows of
  every kind (greedy, bonus, accepted and rejected drafts, q(d) = 0, q = p, filtered rows)
  at vocabularies of awkward and real sizes (up to 151936) and 1..1024 rows; a difference is
  allowed only as a float near-tie (tests/rejection_helpers.py recomputes it in fp64), and
  at most 1 in 1000 rows.
- Bonus rows are the ordinary Triton sampler's token (the same expression): exactly equal.
- Losslessness through `verify_probabilistic` on CUDA (the dispatcher takes the kernel):
  chi-square of the first and second emitted tokens against the target, alpha 1e-4, as in
  tests/unit/test_rejection_sampling.py; and at 151936 tokens the acceptance rate against
  its closed form sum_v min(p_v, q_v) over many rows (z-test, |z| < 4.5).
Skipped without CUDA or triton.
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kernels import rejection_sampling as rs  # noqa: E402
from kernels import sampling_noise, sampling_triton  # noqa: E402
from services.worker.spec.verify import expand_rows, verify_probabilistic  # noqa: E402
from shared.protocol import SamplingParams  # noqa: E402
from tests.rejection_helpers import unexplained_mismatches  # noqa: E402
from tests.unit.test_rejection_sampling import V, check_fit, make_seqs, truth  # noqa: E402

DEV = "cuda"


def rows_case(vocab: int, n: int, seed: int):
    """n rows of every kind on the GPU (see the interpreter check's rows_case)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen, device=DEV) * 3
    temp = torch.rand(n, generator=gen, device=DEV) + 0.4
    temp[::6] = 0.0
    f_rows = torch.arange(n, device=DEV)[1::4]
    logits = rs.restrict_to_filtered(logits, f_rows, temp[f_rows].clamp_min(0.4),
                                     torch.full((len(f_rows),), 50, device=DEV),
                                     torch.full((len(f_rows),), 0.9, device=DEV), torch.zeros(len(f_rows), device=DEV))
    p = torch.softmax(logits / temp.clamp_min(1e-3)[:, None], dim=-1)
    q = torch.softmax(torch.randn(n, vocab, generator=gen, device=DEV) * 2, dim=-1)
    drafts = torch.randint(0, vocab, (n,), generator=gen, device=DEV)
    kind = torch.arange(n, device=DEV) % 5
    drafts = torch.where(kind == 0, -1, torch.where(kind == 1, p.argmax(-1), drafts))
    zero = (kind == 3).nonzero().flatten()
    q[zero, drafts[zero]] = 0.0
    same = (kind == 4).nonzero().flatten()
    q[same] = p[same]
    q_index = torch.where(drafts >= 0, torch.arange(n, device=DEV), -1)
    seeds = torch.randint(0, 1 << 40, (n,), generator=gen, device=DEV).tolist()
    keys, u = rs.rejection_keys(seeds, list(range(n)))
    return logits, temp, drafts, q, q_index, keys.to(DEV), u.to(DEV)


def test_dispatcher_picks_triton_on_cuda():
    assert rs.rejection_sample_triton is not None


@pytest.mark.parametrize("vocab,n", [(1000, 60), (2049, 257), (49152, 33), (151936, 9), (151936, 1024), (32000, 1)])
def test_kernel_rows_match_the_reference(vocab, n):
    args = rows_case(vocab, n, vocab + n)
    ref = rs.rejection_sample_ref(*args)
    got = rs.rejection_sample(*args)
    diff = int(((ref[0] != got[0]) | (ref[1] != got[1])).sum())
    assert unexplained_mismatches(*args, ref, got) == []
    assert diff <= max(1, n // 1000), f"{diff} near-tie differences in {n} rows"
    # bonus rows: the ordinary Triton sampler with the same key, token for token
    logits, temp, drafts, keys = args[0], args[1], args[2], args[5]
    b = ((drafts < 0) & (temp > 0)).nonzero().flatten()
    if b.numel():
        kk = keys[b, :2].cpu()
        seeds = [int(k0) | (int(k1) << 32) for k0, k1 in kk.tolist()]
        assert sampling_noise.noise_keys(seeds).equal(kk)
        assert torch.equal(sampling_triton.sample_triton(logits[b].contiguous(), temp[b], seeds), got[0][b])


@pytest.mark.parametrize("params,filt", [(SamplingParams(temperature=1.0), {}),
                                         (SamplingParams(temperature=0.7, top_k=5), {"top_k": 5})])
def test_lossless_through_the_kernel(params, filt):
    gen = torch.Generator().manual_seed(11)
    lg = torch.randn(3, V, generator=gen) * 1.5
    lg[:, 0] = float("-inf")
    q = 0.5 / V + 0.5 * torch.softmax(-lg[:2].clamp_min(-5) * 1.2, dim=-1)  # far from p, mass where p is 0
    n = 50000
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).T.contiguous()
    seqs = make_seqs(drafts, params, 800000)
    _, starts = expand_rows(seqs)
    qd = q.to(DEV)
    out = verify_probabilistic(lg.to(DEV).repeat(n, 1), seqs, starts, [qd] * n)
    ps = [truth(lg[i], params.temperature, **filt) for i in range(3)]
    first = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=V)
    check_fit(first, ps[0], q[0].double(), "first token (CUDA)")
    second = [t[1] for t in out.tokens if len(t) > 1]
    assert len(second) > 1000
    check_fit(torch.bincount(torch.tensor(second), minlength=V), ps[1], None, "second token (CUDA)")


def test_acceptance_rate_at_full_vocabulary():
    """4096 rows of 151936 tokens, each its own p and q: the mean acceptance equals the mean
    of sum_v min(p_v, q_v) (each row a Bernoulli of that probability), and q = p accepts all
    but a rounding sliver."""
    vocab, n = 151936, 4096
    gen = torch.Generator(device=DEV).manual_seed(5)
    logits = torch.randn(n, vocab, generator=gen, device=DEV) * 2
    q = torch.softmax(logits + torch.randn(n, vocab, generator=gen, device=DEV), dim=-1)
    p = torch.softmax(logits.double(), dim=-1)
    drafts = torch.multinomial(q, 1, generator=gen).flatten()
    keys, u = rs.rejection_keys(list(range(n)), [3] * n)
    args = (logits, torch.ones(n, device=DEV), drafts, q, torch.arange(n, device=DEV), keys.to(DEV), u.to(DEV))
    _, acc = rs.rejection_sample(*args)
    want = torch.minimum(p, q.double()).sum(-1)
    z = float((acc.double() - want).sum()) / math.sqrt(float((want * (1 - want)).sum()))
    assert abs(z) < 4.5, f"acceptance {float(acc.double().mean()):.4f} vs {float(want.mean()):.4f} (z = {z:.1f})"
    same = torch.softmax(logits, dim=-1)
    d_same = torch.multinomial(same, 1, generator=gen).flatten()
    _, acc_same = rs.rejection_sample(logits, args[1], d_same, same, args[4], args[5], args[6])
    assert float(acc_same.double().mean()) > 0.999
