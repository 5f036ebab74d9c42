"""The worker's seams (services/worker): the attention backends against a dense attention
written out here (rotary, q/k norm and GQA in fp64 from their formulas), the KV handles they
write, the runner's backend and fusion choices, and the model contract (`CausalLM`): models
describe the network and never pick a kernel or touch a cache tensor."""

from __future__ import annotations

import ast
import json
import math
import pathlib

import pytest
import torch

from kernels.rotary import rope_cos_sin, rope_inv_freq
from services.worker.fusion import FusionPlan
from services.worker.kv_cache import KVCache, PagedKVSpec
from services.worker.layers.attention import (AttentionSpec, DecodeAttention, PagedAttention, ReferenceAttention,
                                              bind_layers, select_backend)
from services.worker.step_inputs import prepare_step
from shared.protocol import SamplingParams, ScheduledSeq

ROOT = pathlib.Path(__file__).resolve().parents[2]
H, KVH, D, BS, THETA, EPS = 4, 2, 16, 4, 10000.0, 1e-6
GREEDY = SamplingParams(temperature=0.0)


def _rope64(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Neox RoPE in fp64 from its formula: x [T, h, D], positions [T]."""
    half = D // 2
    inv = THETA ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _norm64(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    return x if w is None else x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


class _Truth:
    """Each sequence's rotated keys and values so far, and dense causal GQA over them (fp64)."""

    def __init__(self, qn, kn):
        self.qn = None if qn is None else qn.cpu()
        self.kn = None if kn is None else kn.cpu()
        self.k: dict[str, list[torch.Tensor]] = {}
        self.v: dict[str, list[torch.Tensor]] = {}

    def step(self, seqs, q, k, v, positions) -> torch.Tensor:
        """The step's attention output [T, H * D] fp64; q, k, v, positions on the CPU."""
        out, row = [], 0
        for s in seqs:
            n = len(s.token_ids)
            pos = positions[row:row + n]
            qs = _rope64(_norm64(q[row:row + n].double(), self.qn), pos)
            self.k.setdefault(s.request_id, []).extend(_rope64(_norm64(k[row:row + n].double(), self.kn), pos))
            self.v.setdefault(s.request_id, []).extend(v[row:row + n].double())
            keys, vals = torch.stack(self.k[s.request_id]), torch.stack(self.v[s.request_id])  # [S, KVH, D]
            for j in range(n):
                p = s.start_pos + j
                for h in range(H):
                    kv = h // (H // KVH)
                    w = torch.softmax(keys[:p + 1, kv] @ qs[j, h] / math.sqrt(D), 0)
                    out.append(w @ vals[:p + 1, kv])
            row += n
        return torch.stack(out).view(-1, H * D)


def _layers(qk_norm: bool, num_blocks: int = 16, device: str = "cpu"):
    g = torch.Generator().manual_seed(7)
    qn = (1 + 0.3 * torch.randn(D, generator=g)).to(device) if qk_norm else None
    kn = (1 + 0.3 * torch.randn(D, generator=g)).to(device) if qk_norm else None
    table = rope_cos_sin(rope_inv_freq(D, THETA), 64).to(device)
    spec = AttentionSpec(H, KVH, D, D ** -0.5, table, qn, kn, EPS)
    kv = KVCache([spec.kv] * 2, num_blocks, BS, torch.float32, device)
    return bind_layers([spec, spec], kv.layers), kv, qn, kn


def run_backend_steps(backend_cls, kernels_meta: bool, qk_norm: bool, device: str = "cpu",
                      tol: float = 2e-5) -> None:
    """Three steps on layer 1 of two: prefill chunks, chunks after a cached prefix, decodes;
    each output against the dense truth, and the cache slots against the rotated keys.
    (tests/gpu runs it on CUDA.)"""
    layers, kv, qn, kn = _layers(qk_norm, device=device)
    truth = _Truth(qn, kn)
    g = torch.Generator().manual_seed(11)
    tables = {"a": [3, 0, 5], "b": [1, 7]}
    steps = [
        [ScheduledSeq("a", [1] * 6, 0, tables["a"], True, GREEDY), ScheduledSeq("b", [1] * 2, 0, tables["b"], True, GREEDY)],
        [ScheduledSeq("a", [1] * 3, 6, tables["a"], True, GREEDY), ScheduledSeq("b", [1] * 3, 2, tables["b"], True, GREEDY)],
        [ScheduledSeq("a", [1], 9, tables["a"], True, GREEDY, 1), ScheduledSeq("b", [1], 5, tables["b"], True, GREEDY, 1)],
    ]
    for seqs in steps:
        ids, positions, meta = prepare_step(seqs, BS, 64, torch.device(device), kernels_meta)
        t = ids.shape[0]
        q, k, v = (torch.randn(t, n, D, generator=g).to(device) for n in (H, KVH, KVH))
        want = truth.step(seqs, q.cpu(), k.cpu(), v.cpu(), positions.cpu())
        decode = all(len(s.token_ids) == 1 for s in seqs)
        if backend_cls is DecodeAttention and not decode:  # the decode backend runs decode steps only
            backend_cls_step = PagedAttention
        else:
            backend_cls_step = backend_cls
        got = backend_cls_step(layers, meta).forward(1, q, k, v, positions)
        assert got.shape == (t, H * D)
        torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=1e-5)
    for rid, table in tables.items():  # layer 1's cache holds every token's rotated key and value
        for p, (key, val) in enumerate(zip(truth.k[rid], truth.v[rid])):
            blk, off = table[p // BS], p % BS
            torch.testing.assert_close(kv.layers[1].k[blk, off].double().cpu(), key, atol=tol / 10, rtol=1e-5)
            torch.testing.assert_close(kv.layers[1].v[blk, off].double().cpu(), val, atol=0, rtol=0)
    assert not kv.layers[0].k.any() and not kv.layers[0].v.any()  # layer 0 was never run


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("backend_cls,kernels_meta", [(ReferenceAttention, False), (PagedAttention, True),
                                                      (DecodeAttention, True)])
def test_attention_backends_equal_dense_attention_with_rope_and_write_their_layers_cache(backend_cls, kernels_meta,
                                                                                         qk_norm):
    run_backend_steps(backend_cls, kernels_meta, qk_norm)


def test_backend_is_chosen_from_the_step_metadata():
    layers, _, _, _ = _layers(False)
    cpu = torch.device("cpu")
    prefill = [ScheduledSeq("a", [1, 2, 3], 0, [0], True, GREEDY)]
    decode = [ScheduledSeq("a", [4], 3, [0], True, GREEDY, 1), ScheduledSeq("b", [4], 0, [1], True, GREEDY, 1)]
    assert type(select_backend(layers, prepare_step(prefill, BS, 64, cpu, True)[2], False)) is PagedAttention
    assert type(select_backend(layers, prepare_step(decode, BS, 64, cpu, True)[2], False)) is DecodeAttention
    for seqs in (prefill, decode):
        assert type(select_backend(layers, prepare_step(seqs, BS, 64, cpu, False)[2], True)) is ReferenceAttention


def test_a_verify_step_takes_the_paged_backend():
    layers, _, _, _ = _layers(False)
    cpu = torch.device("cpu")
    verify = [ScheduledSeq("a", [4, 5, 6], 3, [0, 1], True, GREEDY, 1, num_draft=2),
              ScheduledSeq("b", [4], 0, [2], True, GREEDY, 1)]
    assert type(select_backend(layers, prepare_step(verify, BS, 64, cpu, True)[2], False)) is PagedAttention
    assert type(select_backend(layers, prepare_step(verify, BS, 64, cpu, False)[2], True)) is ReferenceAttention


def test_kv_cache_allocates_one_zeroed_handle_per_layer_spec():
    kv = KVCache([PagedKVSpec(2, 8)] * 3, 5, 4, torch.float16, "cpu")
    assert len(kv.layers) == 3 and kv.k == [h.k for h in kv.layers] and kv.v == [h.v for h in kv.layers]
    for h in kv.layers:
        assert h.k.shape == h.v.shape == (5, 4, 2, 8) and h.k.dtype == h.dtype == torch.float16
        assert not h.k.any() and h.k_scale is None and h.v_scale is None
    assert len({h.k.data_ptr() for h in kv.layers} | {h.v.data_ptr() for h in kv.layers}) == 6
    assert kv.bytes == 3 * 2 * 5 * 4 * 2 * 8 * 2
    with pytest.raises(ValueError):
        KVCache([PagedKVSpec(2, 8), PagedKVSpec(1, 8)], 5, 4, torch.float16, "cpu")
    with pytest.raises(ValueError, match="multiple"):
        AttentionSpec(3, 2, 8, 1.0, torch.zeros(4, 8))


def test_fusion_plan_is_never_fused_on_the_cpu_and_can_be_forced():
    w = [torch.zeros(8, 8, dtype=torch.bfloat16)]
    plan = FusionPlan.choose(w, torch.device("cpu"), torch.bfloat16, one_row=True, small_batches=True)
    assert plan.rows == frozenset() and not plan.fused(1)
    assert FusionPlan(None).fused(1) and FusionPlan(None).fused(4096)
    assert FusionPlan(frozenset({1})).fused(1) and not FusionPlan(frozenset({1})).fused(2)


def _model_files() -> list[pathlib.Path]:
    return sorted((ROOT / "services/worker/models").glob("*.py"))


def test_model_files_import_no_kernel_and_touch_no_cache_tensor():
    banned_attrs = {"k_cache", "v_cache", "k_scale", "v_scale", "kv_cache", "slot_mapping", "block_tables"}
    assert _model_files()
    for path in _model_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("kernels"), (path.name, node.module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("kernels") for a in node.names), path.name
            elif isinstance(node, ast.Attribute):
                assert node.attr not in banned_attrs, (path.name, node.attr)


def _tiny(arch: str) -> dict:
    c = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6,
             tie_word_embeddings=False)
    return {**c, "architectures": [arch], "model_type": "qwen3" if arch.startswith("Qwen3") else "llama"}


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_llama_family_models_are_causal_lms_whose_parameters_are_the_checkpoints_tensors(arch, tmp_path):
    """Qwen3 is the Llama family with the q/k norm on: its parameters are Hugging Face's
    (the truth: transformers' own model of the same config), stacked q/k/v and gate/up
    mapped back through packed_modules."""
    transformers = pytest.importorskip("transformers")
    from services.worker.models import model_class
    from services.worker.models.base import CausalLM
    from shared.model_spec import load_model_spec

    cfg = _tiny(arch)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model_spec(str(tmp_path))
    ours = model_class(spec)(spec, 64)
    assert isinstance(ours, CausalLM)
    specs = ours.attention_specs()
    assert [s.kv for s in specs] == ours.kv_specs() == [PagedKVSpec(2, 8)] * 2
    assert all((s.q_norm is not None) == (arch == "Qwen3ForCausalLM") for s in specs)
    assert len(ours.fusable_projections()) == 4
    unpacked = set()
    inverse: dict[str, list[str]] = {}
    for ckpt, (stacked, _) in ours.packed_modules.items():
        inverse.setdefault(stacked, []).append(ckpt)
    for name, _ in ours.named_parameters():
        parts = name.split(".")
        hit = [i for i, p in enumerate(parts) if p in inverse]
        if hit:
            i = hit[0]
            unpacked |= {".".join(parts[:i] + [c] + parts[i + 1:]) for c in inverse[parts[i]]}
        else:
            unpacked.add(name)
    hf_cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**{k: v for k, v in cfg.items()
                                                                             if k not in ("architectures",)})
    hf = getattr(transformers, arch)(hf_cfg)
    hf_names = {n for n in hf.state_dict() if not n.endswith(ours.ignored_tensors)}
    assert unpacked == hf_names
