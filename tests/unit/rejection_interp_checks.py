"""Run the rejection-sampling Triton kernel (kernels/rejection_sampling_triton.py) under
TRITON_INTERPRET=1 on CPU tensors against the torch reference and print one JSON object
{check name: [rows that differ, rows that differ and are not a float near-tie]}.

Run by `tests/unit/test_rejection_sampling_interp.py` in a subprocess, because the
interpreter switch is read when triton is first imported (as tests/unit/triton_interp_checks.py).
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import msgspec  # noqa: E402
import torch  # noqa: E402

from kernels import rejection_sampling as rs  # noqa: E402
from kernels import sampling_noise, sampling_triton  # noqa: E402
from kernels.rejection_sampling_triton import rejection_sample_triton  # noqa: E402
from services.worker.spec import verify  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq  # noqa: E402
from tests.rejection_helpers import unexplained_mismatches  # noqa: E402


def triton_path(*args):
    return rejection_sample_triton(*args, rs.RESIDUAL_EPS)


def rows_case(vocab: int, n: int, gen: torch.Generator, strided: bool):
    """n rows of every kind: greedy (with a tie), bonus, drafts near p's mode (accepted
    mostly), random drafts (rejected mostly), q(d) = 0, q = p (the reference's own p), a
    row whose top-k filter leaves -inf (restrict_to_filtered)."""
    width = vocab + 37 if strided else vocab
    logits = (torch.randn(n, width, generator=gen) * 3)[:, :vocab]
    temp = torch.rand(n, generator=gen) + 0.4
    temp[::6] = 0.0
    logits[0, [5, vocab - 1]] = logits[0].max() + 1  # a greedy tie
    k_rows = torch.arange(n)[1::4]
    logits = rs.restrict_to_filtered(logits, k_rows, temp[k_rows].clamp_min(0.4), torch.full((len(k_rows),), 7),
                                     torch.full((len(k_rows),), 0.9), torch.zeros(len(k_rows)))
    p = torch.softmax(logits / temp.clamp_min(1e-3)[:, None], dim=-1)
    q = torch.softmax(torch.randn(n, width, generator=gen) * 2, dim=-1)[:, :vocab] if strided else \
        torch.softmax(torch.randn(n, vocab, generator=gen) * 2, dim=-1)
    drafts = torch.randint(0, vocab, (n,), generator=gen)
    for r in range(n):
        kind = r % 5
        if kind == 0:
            drafts[r] = -1  # bonus
        elif kind == 1:
            drafts[r] = int(p[r].argmax())
        elif kind == 3:  # q(d) = 0
            q[r, int(drafts[r])] = 0.0
        elif kind == 4:  # q = p: accepted unless p(d) = 0
            q[r] = p[r]
    q_index = torch.where(drafts >= 0, torch.arange(n), -1)
    seeds = torch.randint(0, 1 << 40, (n,), generator=gen).tolist()
    keys, u = rs.rejection_keys(seeds, list(range(n)))
    return logits, temp, drafts, q, q_index, keys, u


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, list[int]] = {}
    for name, vocab, n, strided in (("rows_v1000", 1000, 60, False), ("rows_v777_strided", 777, 45, True),
                                    ("rows_v256", 256, 20, False)):
        args = rows_case(vocab, n, gen, strided)
        ref = rs.rejection_sample_ref(*args)
        got = triton_path(*args)
        diff = int(((ref[0] != got[0]) | (ref[1] != got[1])).sum())
        out[name] = [diff, len(unexplained_mismatches(*args, ref, got))]
        drafted = (args[2] >= 0) & (args[1] > 0)
        out[f"{name}_accepted_rejected"] = [int(ref[1][drafted].sum()), int((~ref[1][drafted]).sum())]
        # bonus rows: the ordinary Triton sampler's token with the same key
        logits, temp, drafts = args[0], args[1], args[2]
        b = ((drafts < 0) & (temp > 0)).nonzero().flatten()
        keys = args[5][b, :2]
        seeds = [int(k0) | (int(k1) << 32) for k0, k1 in keys.tolist()]
        assert sampling_noise.noise_keys(seeds).equal(keys)
        plain = sampling_triton.sample_triton(logits[b].contiguous(), temp[b], seeds)
        out[f"{name}_bonus_vs_sampler"] = [int((plain != got[0][b]).sum()), int((plain != got[0][b]).sum())]
    # verify_probabilistic end to end, its dispatcher pointed at the kernel
    seqs, qs = [], []
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
             SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=1.1, top_p=0.8)]
    vocab = 600
    for m in range(16):
        k = 1 + m % 4
        q = torch.softmax(torch.randn(k, vocab, generator=gen) * 2, dim=-1)
        d = torch.multinomial(q, 1, generator=gen).flatten().tolist()
        seqs.append(ScheduledSeq(request_id=f"s{m}", token_ids=[3] + d, start_pos=4, block_table=[], sample=True,
                                 sampling=msgspec.structs.replace(kinds[m % 4], seed=m), output_index=m,
                                 num_draft=k))
        qs.append(q)
    _, starts = verify.expand_rows(seqs)
    logits = torch.randn(starts[-1], vocab, generator=gen) * 2
    want = verify.verify_probabilistic(logits, seqs, starts, qs)
    saved = verify.rejection_sample
    verify.rejection_sample = triton_path
    try:
        got_v = verify.verify_probabilistic(logits, seqs, starts, qs)
    finally:
        verify.rejection_sample = saved
    bad = sum(a != b for a, b in zip(want.tokens, got_v.tokens))
    out["verify_probabilistic"] = [bad, bad]
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
