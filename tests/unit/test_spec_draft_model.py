"""The draft-model proposer (services/worker/spec/draft_model.py) on the CPU, driven step by
step next to a target `ModelRunner` (StepViews from the runner's `_prepare` / `run_model`).

Truths: decoding without speculation (`greedy_generate` on the target); the draft model run
as a target of its own (a `ModelRunner` on the draft's folder: its greedy continuation of
each context is what the proposer must draft, and its KV cache what the proposer's group
must hold); `filtered_probs` over that runner's logits for q; a chi-square test for draws
from q. Tiny random models are saved to temporary folders with real safetensors weights
(scale large enough that the output depends on the context, unlike the near-uniform dummy
weights), so `load_format` auto serves them.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import msgspec
import pytest
import torch
from safetensors.torch import save_file

from kernels.sampling import filtered_probs
from kernels.sampling_noise import mix_seed
from services.worker.kv_cache import KVCache
from services.worker.model_runner import ModelRunner
from services.worker.spec.base import ProposeRequest, StepView
from services.worker.spec.draft_model import DraftModelProposer, draft_noise_seed
from shared.config import build_config
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
from tests.runner_driver import greedy_generate, spec_generate, step_logits
from tests.unit.spec_draft_rig import GREEDY, Req, spec_greedy, spec_sample

VOCAB = 384
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 48,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 1,
         "head_dim": 32, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def _save_random_model(conf: dict, seed: int) -> str:
    """A temporary folder with config.json and a model.safetensors of random weights under
    Hugging Face's Llama/Qwen3 names (embedding std 1, projections std 1.5/sqrt(fan-in))."""
    g = torch.Generator().manual_seed(seed)
    h, i, hd = conf["hidden_size"], conf["intermediate_size"], conf["head_dim"]
    nh, nkv = conf["num_attention_heads"], conf["num_key_value_heads"]

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * (1.5 / cols ** 0.5)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    t = {"model.embed_tokens.weight": torch.randn(VOCAB, h, generator=g), "model.norm.weight": norm(h)}
    for n in range(conf["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t |= {p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
              p + "self_attn.q_proj.weight": w(nh * hd, h), p + "self_attn.k_proj.weight": w(nkv * hd, h),
              p + "self_attn.v_proj.weight": w(nkv * hd, h), p + "self_attn.o_proj.weight": w(h, nh * hd),
              p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h), p + "mlp.down_proj.weight": w(h, i)}
        if conf["model_type"] == "qwen3":
            t |= {p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)}
    if not conf["tie_word_embeddings"]:
        t["lm_head.weight"] = w(VOCAB, h)
    d = tempfile.mkdtemp(prefix="kestrel-draft-test-")
    with open(f"{d}/config.json", "w") as fh:
        json.dump(conf, fh)
    save_file({k: v.contiguous() for k, v in t.items()}, f"{d}/model.safetensors")
    return d


@pytest.fixture(scope="module")
def folders():
    """target: 4-layer Llama; draft: 2-layer Qwen3 of other widths; dummy2: the target's
    config at 2 layers (config only, for dummy weights)."""
    made = {"target": _save_random_model(LLAMA, 1), "draft": _save_random_model(QWEN3, 2)}
    made["dummy2"] = tempfile.mkdtemp(prefix="kestrel-draft-test-")
    with open(f"{made['dummy2']}/config.json", "w") as fh:
        json.dump(LLAMA | {"num_hidden_layers": 2}, fh)
    try:
        yield made
    finally:
        for d in made.values():
            shutil.rmtree(d, ignore_errors=True)


def _cfg(model: str, spec: dict | None = None, **kw):
    cli = {"model": model, "device": "cpu", "dtype": "float32", "kv_cache_gib": 0.02, "max_model_len": 512} | kw
    if spec is not None:
        cli["speculative_config"] = json.dumps(spec)
    return build_config(cli=cli, env={})


def _setup(target: str, spec: dict, **kw) -> tuple[ModelRunner, DraftModelProposer]:
    """The target's runner with speculative decoding on, and its proposer (built by the
    runner's `build_proposer`, its KV group allocated and bound by the runner)."""
    runner = ModelRunner(_cfg(target, spec, **kw))
    assert isinstance(runner.proposer, DraftModelProposer) and runner.draft_kv is not None
    return runner, runner.proposer


def _prompts(seed: int, sizes=(21, 6, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in sizes]


def _reqs(prompts: list[list[int]], n: int, k: int, bs: int, first: int = 100, rid: str = "r") -> list[Req]:
    """One request per prompt on blocks of its own from block `first` on (the truth runs of
    `greedy_generate` on the same runner use blocks 0, 1, ...)."""
    out, nxt = [], first
    for i, p in enumerate(prompts):
        need = -(-(len(p) + n + 2 * k) // bs)
        out.append(Req(f"{rid}{i}", p, list(range(nxt, nxt + need)), n))
        nxt += need
    return out


def _check_drafts_and_kv(truth: ModelRunner, runner: ModelRunner, proposals, tables: dict[str, list[int]],
                         contexts: dict[str, list[int]]) -> None:
    """Every proposal is the draft model's own greedy continuation of its context, and the
    runner's draft KV group holds, at each request's slots, the KV the draft model computes
    for its whole context (positions written by `observe` and by the chain's first input).
    Run before any other use of `runner` (its forwards write draft KV too)."""
    assert proposals and runner.draft_kv is not None
    bs = truth.block_size
    for rid, ctx in contexts.items():
        truth.execute(StepPlan(0, [ScheduledSeq(f"kv-{rid}", ctx, 0, list(range(len(tables[rid]))), True, GREEDY)]))
        ours = [(tables[rid][p // bs], p % bs) for p in range(len(ctx))]
        theirs = [(p // bs, p % bs) for p in range(len(ctx))]
        for mine, truth_cache in zip(runner.draft_kv.k + runner.draft_kv.v, truth.kv.k + truth.kv.v):
            torch.testing.assert_close(torch.stack([mine[b, o] for b, o in ours]),
                                       torch.stack([truth_cache[b, o] for b, o in theirs]), rtol=1e-4, atol=1e-5)
    for _, context, d in proposals:
        if d:
            assert d == greedy_generate(truth, context, len(d)), context


def test_target_as_its_own_draft_accepts_every_draft(smollm2_dir):
    """The real SmolLM2 drafting for itself through the runner: every draft is accepted,
    the output is decoding without speculation's (chunked prefill, two requests in one
    batch), and the runner reports the draft's weight and KV bytes."""
    folder = str(smollm2_dir)
    runner, prop = _setup(folder, {"method": "draft_model", "model": folder, "num_speculative_tokens": 3},
                          kv_cache_gib=0.1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 20000, (n,), generator=g).tolist() for n in (13, 30)]
    n, k = 12, 3
    run = spec_greedy(runner, _reqs(prompts, n, k, runner.block_size, first=10), k, chunk=8)
    assert run.drafted > 0 and run.accepted == run.drafted
    for i, p in enumerate(prompts):
        assert run.outputs[f"r{i}"] == greedy_generate(runner, p, n)
    rep = runner.report()["speculative"]
    assert rep["method"] == "draft_model" and rep["model"] == folder and rep["num_layers"] == 30
    assert rep["weight_bytes"] == runner.weight_bytes
    assert rep["kv_bytes_per_block"] == prop.info().kv_bytes_per_block == runner.kv_layout.block_bytes
    assert rep["kv_bytes"] == prop.info().detail["kv_bytes"] == runner.kv.bytes


def test_two_layer_dummy_draft_is_lossless_and_drafts_the_truncated_target(folders):
    """load_format dummy, no draft folder, draft_num_layers 2: the draft is the target's
    shape at 2 layers with the target's seed; its drafts and KV are those of a runner on the
    2-layer config, and greedy output equals decoding without speculation (spec_generate)."""
    runner, prop = _setup(folders["target"], {"method": "draft_model", "num_speculative_tokens": 4,
                                              "draft_num_layers": 2}, load_format="dummy")
    truth = ModelRunner(_cfg(folders["dummy2"], load_format="dummy"))
    assert prop.draft_spec.num_layers == 2 and prop.info().weight_bytes == truth.weight_bytes
    assert prop.info().kv_bytes_per_block == truth.kv_layout.block_bytes
    prompts, n, k = _prompts(0), 10, 4
    reqs = _reqs(prompts, n, k, runner.block_size)
    run = spec_greedy(runner, reqs, k, chunk=16)
    assert run.drafted > 0
    _check_drafts_and_kv(truth, runner, run.proposals, {r.rid: r.table for r in reqs},
                         {r.rid: r.prompt + run.outputs[r.rid][:-1] for r in reqs})
    plain = [greedy_generate(runner, p, n) for p in prompts]
    assert [run.outputs[r.rid] for r in reqs] == plain
    assert spec_generate(runner, prompts, n, k, chunk=16) == plain  # the runner driver's loop too


@pytest.fixture(scope="module")
def rig(folders):
    """The Llama target with the Qwen3 draft (real random weights, greedy drafting) and a
    runner on the draft's folder (the truth)."""
    runner, prop = _setup(folders["target"], {"method": "draft_model", "model": folders["draft"],
                                              "num_speculative_tokens": 3})
    return runner, prop, ModelRunner(_cfg(folders["draft"]))


def test_a_draft_of_another_architecture_is_lossless_with_rejections(rig):
    runner, _, truth = rig
    prompts, n, k = _prompts(1), 14, 3
    reqs = _reqs(prompts, n, k, runner.block_size)
    run = spec_greedy(runner, reqs, k, chunk=16)
    assert 0 < run.accepted < run.drafted  # both verification paths ran
    _check_drafts_and_kv(truth, runner, run.proposals, {r.rid: r.table for r in reqs},
                         {r.rid: r.prompt + run.outputs[r.rid][:-1] for r in reqs})
    for r in reqs:
        assert run.outputs[r.rid] == greedy_generate(runner, r.prompt, n)


def test_state_survives_forget_preemption_and_prefix_hits(rig):
    """A ends (forgotten) while B runs; B is preempted and recomputed from position 0
    (table_start 0) into a table of reused, stale blocks; C starts at a prefix-cache hit on
    B's first two blocks. Each output is decoding without speculation's, each proposal the
    draft's greedy continuation, and the draft's KV is the draft model's at every slot."""
    runner, _, truth = rig
    bs, k = runner.block_size, 3
    pa, pb = _prompts(2, (19, 23))
    a, b = _reqs([pa, pb], 12, k, bs)
    run1 = spec_greedy(runner, [Req("a", pa, a.table, 4), Req("b", pb, b.table, 6)], k)
    first = run1.outputs["b"]
    # preempted: B comes back from 0 with its outputs as context, on the blocks A and B held
    ctx = pb + first
    tb2 = (b.table + a.table)[::-1][:len(b.table) + 1]
    run2 = spec_greedy(runner, [Req("b", ctx, tb2, 6)], k, chunk=8)
    # prefix hit: C's first 2 * bs tokens are B's, in B's first two blocks (as computed above)
    full = ctx + run2.outputs["b"]
    assert len(full) > 2 * bs
    pc = full[:2 * bs] + _prompts(4, (5,))[0]
    tc = tb2[:2] + list(range(300, 304))
    run3 = spec_greedy(runner, [Req("c", pc, tc, 8, hit=2 * bs)], k)
    _check_drafts_and_kv(truth, runner, run1.proposals + run2.proposals + run3.proposals, {"b": tb2, "c": tc},
                         {"b": ctx + run2.outputs["b"][:-1], "c": pc + run3.outputs["c"][:-1]})
    assert first + run2.outputs["b"] == greedy_generate(runner, pb, 12)
    assert run3.outputs["c"] == greedy_generate(runner, pc, 8)


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - p for z the normal quantile (3.09: p = 0.001), by the
    Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _chi_square(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom, bins with expected < 5 merged into one."""
    big = expected >= 5
    c = torch.cat([counts[big], counts[~big].sum()[None]])
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = e > 0
    return float(((c[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1


def _observe_prefill(runner: ModelRunner, prop: DraftModelProposer, contexts: list[list[int]],
                     tables: list[list[int]]) -> StepView:
    """One target step over whole contexts (no sampling) that the proposer observes."""
    seqs = [ScheduledSeq(f"o{i}", c, 0, t, False, GREEDY) for i, (c, t) in enumerate(zip(contexts, tables))]
    with torch.inference_mode():
        ids, pos, meta = runner._prepare(seqs)
        view = StepView(seqs, ids, pos, meta, runner.run_model(ids, pos, meta))
        prop.observe(view)
    return view


def _q_truth(truth: ModelRunner, context: list[int], sp: SamplingParams) -> torch.Tensor:
    """The draft's distribution after `context` under sp, from the draft run as a target:
    [vocab] fp32, normalised."""
    blocks = list(range(-(-len(context) // truth.block_size)))
    logits = step_logits(truth, StepPlan(0, [ScheduledSeq("q", context, 0, blocks, True, GREEDY)]))
    f = filtered_probs(logits, torch.tensor([sp.temperature]), torch.tensor([sp.top_k]), torch.tensor([sp.top_p]),
                       torch.tensor([sp.min_p]))[0]
    return f / f.sum()


def test_probabilistic_drafts_are_draws_from_the_returned_q(folders):
    """q is the draft's filtered distribution (temperature, top-k, top-p) normalised, at
    every chain position; the first drafts of 3000 seeds pass a chi-square test against q
    (p = 0.001) and fail one against the uniform distribution on q's support (the test's
    power); a greedy request gets its argmax as a point mass; draws repeat per seed."""
    runner, prop = _setup(folders["target"], {"method": "draft_model", "model": folders["draft"],
                                              "num_speculative_tokens": 3, "draft_sampling": "probabilistic"})
    truth = ModelRunner(_cfg(folders["draft"]))
    bs = runner.block_size
    prompt = _prompts(5, (27,))[0]
    sp = SamplingParams(temperature=0.8, top_k=8, top_p=0.95)
    table = list(range(-(-(len(prompt) + 4) // bs)))
    view = _observe_prefill(runner, prop, [prompt[:-1]], [table])

    def want(seed: int, n: int, tbl: list[int], params: SamplingParams = sp) -> ProposeRequest:
        return ProposeRequest(f"s{seed}", 0, [prompt[-1]], len(prompt) - 1, 0, n, tbl,
                              msgspec.structs.replace(params, seed=seed), 5)

    draws = 3000  # one draft per seed, on one shared table (every row writes the same KV)
    one = prop.propose([want(s, 1, table) for s in range(draws)], view)
    assert one.probs is not None and all(p.shape == (1, VOCAB) for p in one.probs)
    expect = _q_truth(truth, prompt, sp)
    q = torch.cat(one.probs)
    torch.testing.assert_close(q, expect.expand_as(q), rtol=1e-4, atol=1e-6)
    counts = torch.bincount(torch.tensor([t[0] for t in one.token_ids]), minlength=VOCAB).float()
    assert counts[expect == 0].sum() == 0
    stat, df = _chi_square(counts, expect * draws)
    assert df >= 2 and stat < _chi_square_critical(df), (stat, df)
    support = (expect > 0).float()
    assert _chi_square(counts, support / support.sum() * draws)[0] > _chi_square_critical(df)

    # chains of 3 on tables of their own: q at draft i is the draft's after context + d1..d(i-1),
    # under each request's parameters
    tables = [list(range(10 + 4 * i, 14 + 4 * i)) for i in range(3)]
    view = _observe_prefill(runner, prop, [prompt[:-1]] * 3, tables)
    unfiltered = SamplingParams(temperature=1.3)  # no top-k/top-p/min-p: the plain softmax path
    reqs = [want(11, 3, tables[0]), want(12, 3, tables[1], unfiltered), want(13, 3, tables[2], GREEDY)]
    chain = prop.propose(reqs, view)
    assert chain.probs is not None
    for r, d, qs in zip(reqs, chain.token_ids, chain.probs):
        assert len(d) == 3 and qs.shape == (3, VOCAB)
        for i in range(3):
            ctx = prompt + d[:i]
            if r.sampling.temperature == 0:
                assert d[i] == greedy_generate(truth, ctx, 1)[0]
                assert qs[i, d[i]] == 1 and qs[i].sum() == 1
            else:
                torch.testing.assert_close(qs[i], _q_truth(truth, ctx, r.sampling), rtol=1e-4, atol=1e-6)
                assert qs[i, d[i]] > 0
    view = _observe_prefill(runner, prop, [prompt[:-1]] * 3, tables)
    assert prop.propose(reqs, view).token_ids == chain.token_ids  # seeded: the same draws again
    assert draft_noise_seed(11, 5) != mix_seed(11, 5)  # a stream of its own, not the target's noise


def test_the_target_as_its_own_probabilistic_draft_is_accepted_and_lossless(folders):
    """Probabilistic drafting through the runner's rejection sampling: with the target as
    its own draft q = p, so every draft is accepted, and the tokens at each output position
    have the distribution of plain seeded decoding (two-sample chi-square over 400 seeds
    each, p = 0.001); greedy requests decode as without speculation."""
    t = folders["target"]
    spec = {"method": "draft_model", "model": t, "num_speculative_tokens": 3, "draft_sampling": "probabilistic"}
    runner, plain = ModelRunner(_cfg(t, spec, kv_cache_gib=0.1)), ModelRunner(_cfg(t, kv_cache_gib=0.1))
    prompt = _prompts(7, (9,))[0]
    params = [SamplingParams(temperature=1.0, top_k=3, seed=1000 + i) for i in range(400)]
    ours, drafted, accepted = spec_sample(runner, prompt, params, 4, 3)
    theirs, _, _ = spec_sample(plain, prompt, params, 4, 0)
    assert drafted > 0 and accepted == drafted
    # a greedy request's drafts are point masses in q: the tokens of plain greedy decoding
    assert spec_generate(runner, [prompt], 8, 3) == [greedy_generate(plain, prompt, 8)]
    for pos in range(4):
        a = torch.bincount(torch.tensor([o[pos] for o in ours]), minlength=VOCAB).float()
        b = torch.bincount(torch.tensor([o[pos] for o in theirs]), minlength=VOCAB).float()
        seen = (a + b) > 0
        stat = float(((a[seen] - b[seen]) ** 2 / (a[seen] + b[seen])).sum())  # equal sample sizes
        df = int(seen.sum()) - 1
        assert df == 0 or stat < _chi_square_critical(df), (pos, stat, df)


def test_drafts_stop_where_the_block_table_ends(rig):
    runner, prop, _ = rig
    bs = runner.block_size
    prompt = _prompts(6, (bs - 3,))[0]
    view = _observe_prefill(runner, prop, [prompt[:-1]], [[7]])
    r = ProposeRequest("x", 0, [prompt[-1]], len(prompt) - 1, 0, 5, [7], GREEDY, 1)
    # the chain writes the draft's KV at next_pos .. bs - 1, the rest of block 7: 4 drafts of 5
    assert [len(d) for d in prop.propose([r], view).token_ids] == [4]


def test_kv_must_be_bound_with_the_drafts_shapes(folders):
    cfg = _cfg(folders["target"], {"method": "draft_model", "model": folders["draft"], "num_speculative_tokens": 2})
    runner = ModelRunner(cfg)
    prop = DraftModelProposer(cfg, cfg.speculative, runner)
    assert prop.info().detail["kv_bytes"] == 0
    with pytest.raises(RuntimeError, match="bind_kv"):
        prop.propose([ProposeRequest("x", 0, [5], 3, 0, 1, [0], GREEDY, 1)], None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="draft KV handle"):
        prop.bind_kv(runner.kv.layers[:2])  # the target's handles: other heads and head_dim
    with pytest.raises(ValueError, match="KV handles"):
        prop.bind_kv(KVCache(prop.kv_specs()[:1], 4, runner.block_size, runner.dtype, runner.device).layers)


@pytest.mark.parametrize(("spec", "extra", "match"), [
    ({"method": "draft_model", "model": "{other}"}, {}, "vocab_size 512 is not the target's 384"),
    ({"method": "draft_model", "model": "{draft}"}, {"kv_offload_cpu_gib": 1.0}, "kvstore tiers"),
    ({"method": "draft_model"}, {"load_format": "dummy", "kv_offload_cpu_gib": 1.0}, "kv-offload-cpu-gib 0"),
    ({"method": "draft_model", "model": "{draft}", "draft_num_layers": 2}, {}, "sizes a dummy draft"),
    ({"method": "draft_model"}, {}, "needs the drafter's folder"),
])
def test_configuration_refuses_what_the_draft_model_cannot_run(folders, spec, extra, match):
    other = tempfile.mkdtemp(prefix="kestrel-draft-test-")
    try:
        with open(f"{other}/config.json", "w") as fh:
            json.dump(QWEN3 | {"vocab_size": 512}, fh)
        if "model" in spec:
            spec = spec | {"model": spec["model"].format(other=other, draft=folders["draft"])}
        with pytest.raises(ValueError, match=match):
            _cfg(folders["target"], spec | {"num_speculative_tokens": 2}, **extra)
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_configuration_accepts_a_same_vocab_draft_and_refuses_tiers_without_prefix_caching(folders):
    """A draft of the target's vocabulary is accepted. Tiers with the prefix cache off are refused
    for every method (the engine connects no tier without the prefix cache), the draft model
    among them; before that refusal they were accepted here, and the tiers went unused."""
    spec = {"method": "draft_model", "model": folders["draft"], "num_speculative_tokens": 2}
    assert _cfg(folders["target"], spec).speculative.model == folders["draft"]
    with pytest.raises(ValueError, match="requires --enable-prefix-caching"):
        _cfg(folders["target"], spec, kv_offload_cpu_gib=1.0, enable_prefix_caching=False)
