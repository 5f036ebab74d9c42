"""Quantized KV caches on the real SmolLM2-135M-Instruct (CPU, fp32 weights): accuracy
against the same model with an fp32 KV cache, and prefix-cache hits through the engine core
(docs/ARCHITECTURE.md §4.6).

Accuracy: 16 real-text prompts run as prefill chunks of CHUNK tokens, each chunk reading the
quantized KV of the ones before it; the next-token distribution at the last position of
every chunk (positions across the prompt) is compared with the fp32-KV model's by KL
divergence, and the greedy N_NEW-token continuations by the share that stays identical. The
bounds are the values measured on the dev machine (stated beside them) x 1.5 for the KL,
and for the continuations at most 1.5 x the measured number of prompts that diverge.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from services.engine.core import EngineCore
from services.engine.executor import InProcessExecutor
from services.worker.model_runner import ModelRunner
from shared import protocol as P
from shared.config import build_config
from shared.model_spec import model_spec_for
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
from tests.runner_driver import generate, step_logits
from tests.unit.engine_rig import Outbox, drive

TEXTS = [
    "The Industrial Revolution began in Britain in the late eighteenth century, when new machines "
    "for spinning and weaving cotton moved work from homes into large factories powered by water",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in "
    "range(n):\n        a, b = b, a + b\n    return a\n\n\ndef is_prime(n):\n",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to "
    "make glucose. The oxygen we breathe is released as a by-product of",
    "Dear Ms. Alvarez,\n\nThank you for your letter of 12 March. I am writing to confirm that your "
    "order has been shipped and should arrive within",
    "To make a simple tomato sauce, heat two tablespoons of olive oil in a pan, add a chopped onion "
    "and cook it slowly until soft. Then add",
    "The mitochondria are often called the powerhouse of the cell because they produce most of the "
    "chemical energy needed to power the cell's biochemical reactions. This energy is stored in",
    "In 1969, Neil Armstrong and Buzz Aldrin landed on the Moon in the lunar module Eagle, while "
    "Michael Collins stayed in orbit aboard",
    "Question: A train travels 120 kilometres in 2 hours. What is its average speed?\nAnswer: The "
    "average speed is the distance divided by the time, so",
    "SELECT customers.name, COUNT(orders.id) AS order_count\nFROM customers\nJOIN orders ON "
    "orders.customer_id = customers.id\nWHERE orders.created_at >= '2024-01-01'\nGROUP BY",
    "The French Revolution of 1789 overthrew the monarchy, established a republic and led to a "
    "period of political turmoil that ended with the rise of Napoleon Bonaparte, who",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes the air pressure is "
    "lower, so water boils at a lower temperature. This is why cooking pasta in the mountains",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his daughter. Every morning the woodcutter",
    "The Python standard library includes modules for working with files, dates, regular "
    "expressions and networking. For example, the datetime module provides classes for",
    "Climate change refers to long-term shifts in temperatures and weather patterns. Since the "
    "1800s, human activities have been the main driver of climate change, primarily due to",
    "The heart is a muscular organ that pumps blood through the blood vessels of the circulatory "
    "system. Blood carries oxygen and nutrients to the body and removes",
    "Shakespeare wrote about thirty-nine plays, including tragedies such as Hamlet, Macbeth and "
    "King Lear, comedies such as Twelfth Night, and histories such as",
]
CHUNK = 8  # prefill chunk: logits at positions 7, 15, 23, ... of every prompt
N_NEW = 64  # greedy continuation length
N_CONTINUE = 8  # prompts whose greedy continuations are compared (64 decode steps each run)


def _config(smollm2_dir, kv: str, **more):
    return build_config(cli={"model": str(smollm2_dir), "device": "cpu", "dtype": "float32",
                             "kv_cache_gib": 0.1, "max_model_len": 256, "max_num_seqs": 16,
                             "kv_cache_dtype": kv, **more}, env={})


def chunk_logits(runner: ModelRunner, prompts: list[list[int]], tag: str = "kl") -> torch.Tensor:
    """Next-token logits at the last position of every CHUNK-token prefill chunk of every
    prompt (all prompts batched per chunk index, each on its own blocks): [n, vocab] fp32,
    prompt-major."""
    bs = runner.block_size
    tables, nxt = [], 0
    for p in prompts:
        need = -(-len(p) // bs)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    greedy = SamplingParams(temperature=0.0)
    step = 0
    while True:
        seqs, who = [], []
        for i, p in enumerate(prompts):
            a = step * CHUNK
            if a + CHUNK <= len(p):
                seqs.append(ScheduledSeq(f"{tag}{i}", p[a:a + CHUNK], a, tables[i], True, greedy, 0))
                who.append(i)
        if not seqs:
            break
        out = step_logits(runner, StepPlan(step, seqs))
        for i, row in zip(who, out):
            rows[i].append(row)
        step += 1
    return torch.stack([r for rs in rows for r in rs])


def kl_mean(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over rows of KL(softmax(ref) || softmax(logits)), in nats (float64)."""
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    return [tok.encode(t).ids for t in TEXTS]


@pytest.fixture(scope="module")
def fp32_kv(smollm2_dir, prompts):
    r = ModelRunner(_config(smollm2_dir, "auto"))
    return chunk_logits(r, prompts), generate(r, prompts[:N_CONTINUE], N_NEW)


# measured on the 2-core dev VM (16 prompts, CHUNK 8: 65 distributions): mean KL vs the
# fp32 KV cache; fp8 with scales 1.0 (SmolLM2's checkpoint has none: layer 0's V is small,
# 42% of its values fall in e4m3's subnormal range) and int8 per token and head
MEASURED_KL = {"fp8_e4m3": 0.00676, "int8": 0.00057}
# of the first N_CONTINUE prompts' 64-token greedy continuations: how many stay identical,
# and the mean number of leading tokens that agree
MEASURED_SAME = {"fp8_e4m3": (0, 33.1), "int8": (4, 53.1)}


@pytest.fixture(scope="module")
def quant_runners(smollm2_dir):
    return {kv: ModelRunner(_config(smollm2_dir, kv)) for kv in ("fp8_e4m3", "int8")}


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_quantized_kv_next_token_distributions_stay_close_to_the_fp32_kv_model(quant_runners, prompts,
                                                                               fp32_kv, kv):
    r = quant_runners[kv]
    assert r.kv.k[0].dtype == {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}[kv]
    ref = fp32_kv[0]
    got = chunk_logits(r, prompts)
    assert got.shape == ref.shape and got.shape[0] == 65
    kl = kl_mean(ref, got)
    print(f"MEASURE {kv} KL {kl:.6f}")
    assert 0 < kl < 1.5 * MEASURED_KL[kv], kl


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_quantized_kv_greedy_continuations_mostly_agree_with_the_fp32_kv_model(quant_runners, prompts,
                                                                               fp32_kv, kv):
    ref = fp32_kv[1]
    got = generate(quant_runners[kv], prompts[:N_CONTINUE], N_NEW)
    same = sum(a == b for a, b in zip(ref, got))
    agree = sum(_common_prefix(a, b) for a, b in zip(ref, got)) / N_CONTINUE
    print(f"MEASURE {kv} identical {same}/{N_CONTINUE} mean agreeing prefix {agree:.1f}")
    want_same, want_agree = MEASURED_SAME[kv]
    assert N_CONTINUE - same <= 1.5 * (N_CONTINUE - want_same), (same, agree)
    assert agree >= want_agree / 1.5, (same, agree)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_a_prefix_cache_hit_on_a_quantized_kv_gives_the_cold_runs_output(smollm2_dir, quant_runners, prompts, kv):
    runner = quant_runners[kv]
    cfg = _config(smollm2_dir, kv)
    assert cfg.enable_prefix_caching
    core = EngineCore(cfg, model_spec_for(cfg), runner.num_blocks, seed=0)
    executor, outbox = InProcessExecutor(runner), Outbox()
    prompt = prompts[1]  # 58 tokens: 3 full blocks to hit
    for j in range(2):  # the second run starts after the first finished: it hits its blocks
        sp = P.SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
        assert core.add(b"fe", P.AddRequest(f"hit{kv}.{j}", prompt, sp, float(j))) is None
        drive(core, executor, True, outbox, timeout_s=300)
    runs = []
    for j in range(2):
        outs = outbox.outputs[f"hit{kv}.{j}"]
        assert outs[-1].error is None, outs[-1]
        runs.append((outbox.tokens(f"hit{kv}.{j}"), [lp.logprob for o in outs for lp in o.logprobs],
                     outs[-1].num_cached_tokens))
    (cold, cold_lp, cold_hit), (warm, warm_lp, warm_hit) = runs
    assert cold_hit == 0 and warm_hit == 48, (cold_hit, warm_hit)
    assert warm == cold and len(cold) == 12
    assert warm_lp == pytest.approx(cold_lp, abs=1e-4)
