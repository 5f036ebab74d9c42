"""4-bit AWQ / GPTQ checkpoints (services/worker/w4a16_checkpoint.py, the loader,
services/worker/layers/w4a16.py, shared/weight_quant.py) on the CPU, on tiny Llama checkpoints
this test writes in the published layouts (kernels/w4a16_formats.py), from random weights
quantized by the reference quantizer:

- AWQ (AutoAWQ gemm): `<m>.qweight` int32 [K, N/8], `<m>.qzeros` int32 [K/G, N/8], `<m>.scales`
  fp16 [K/G, N], group 64, zero points; lm_head, embeddings and norms plain bf16;
- GPTQ v1 symmetric, group 32, with `<m>.g_idx`; GPTQ v1 asymmetric per-channel (group -1),
  without g_idx.
The truth is each checkpoint's meaning computed here per element from the quantized integers
((q - z) * s) and written as a plain fp32 checkpoint: the 4-bit checkpoint served on the CPU
(dequantized at load) must give that checkpoint's logits; loaded with the weights kept packed
(`kernels.w4a16_linear.MODE` "checkpoint", the CPU's torch reference products) every Linear
holds exactly those values and the runner's logits match. Also the loud failures, the dummy
loader's packed shapes and the refusals at configuration time, the CLI exiting before any
process starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch
from safetensors.torch import save_file

from kernels import cpu_quant_linear as cq
from kernels import fp8_linear as F
from kernels import w4a16_formats as fmt
from kernels import w4a16_linear as W
from services.worker.layers.linear import Linear
from services.worker.loader import load_dummy_weights, load_weights
from services.worker.model_runner import ModelRunner
from services.worker.models import model_class
from shared.config import build_config
from shared.model_spec import load_model_spec
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
from shared.startup_report import format_startup_report
from tests.runner_driver import step_logits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H, HEADS, KV, HD, FFN, LAYERS, VOCAB = 128, 4, 2, 32, 192, 2, 300
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
          "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD, "intermediate_size": FFN,
          "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
          "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}
PROJ = {"self_attn.q_proj": (HEADS * HD, H), "self_attn.k_proj": (KV * HD, H), "self_attn.v_proj": (KV * HD, H),
        "self_attn.o_proj": (H, HEADS * HD), "mlp.gate_proj": (FFN, H), "mlp.up_proj": (FFN, H),
        "mlp.down_proj": (H, FFN)}
# layout -> (quantization_config, group size or -1, symmetric)
LAYOUTS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}, 64, False),
    "gptq_sym": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
                  "checkpoint_format": "gptq"}, 32, True),
    "gptq_channel": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": False},
                     -1, False),
}


def _meaning(layout: str, t: dict[str, torch.Tensor], g: int) -> torch.Tensor:
    """W [N, K] of one module's checkpoint tensors, per element with Python-level index math
    (the formats' definitions, not the library's unpackers)."""
    qw, qz, sc = t["qweight"].long() & 0xFFFFFFFF, t["qzeros"].long() & 0xFFFFFFFF, t["scales"].float()
    if layout == "awq":
        k, n = qw.shape[0], qw.shape[1] * 8
        nib = torch.tensor([fmt.AWQ_ORDER.index(c % 8) for c in range(n)])
        q = (qw[:, torch.arange(n) // 8] >> (4 * nib)) & 0xF
        z = (qz[:, torch.arange(n) // 8] >> (4 * nib)) & 0xF
    else:
        k, n = qw.shape[0] * 8, qw.shape[1]
        q = (qw[torch.arange(k) // 8] >> (4 * (torch.arange(k) % 8))[:, None]) & 0xF
        z = ((qz[:, torch.arange(n) // 8] >> (4 * (torch.arange(n) % 8))) & 0xF) + 1
    rows = torch.arange(k) // (k if g == -1 else g)
    return ((q.float() - z[rows].float()) * sc[rows]).t().contiguous()


def _write(folder, tensors: dict[str, torch.Tensor], quant: dict | None) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(dict(CONFIG, **({"quantization_config": quant} if quant else {})), fh)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return str(folder)


def _checkpoints(root, layout: str) -> tuple[str, str, dict[str, torch.Tensor]]:
    """(the 4-bit checkpoint, the fp32 checkpoint of what it means, those values by weight name)."""
    qc, g, sym = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(0)
    plain = {"model.embed_tokens.weight": torch.randn(VOCAB, H, generator=gen) * 0.5,
             "model.norm.weight": 1 + 0.1 * torch.randn(H, generator=gen),
             "lm_head.weight": torch.randn(VOCAB, H, generator=gen) / H ** 0.5}
    packed, meant = {}, {}
    for i in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            plain[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(H, generator=gen)
        for proj, (n, k) in PROJ.items():
            w = torch.randn(n, k, generator=gen) / k ** 0.5
            q, z, s = fmt.quantize_groups(w, k if g == -1 else g, sym=sym)
            if layout != "awq":
                z = z.clamp_min(1)  # v1 stores z - 1: a zero of 0 would read back as 16
            t = fmt.to_awq(q, z, s) if layout == "awq" else fmt.to_gptq(q, z, s, g_idx=layout == "gptq_sym")
            base = f"model.layers.{i}.{proj}"
            packed.update({f"{base}.{key}": v for key, v in t.items()})
            meant[f"{base}.weight"] = _meaning(layout, t, g)
    half = {k: v.half() for k, v in plain.items()}
    quantized = _write(root / layout, {**half, **packed}, qc)
    reference = _write(root / (layout + "_meant"), {**{k: v.float() for k, v in half.items()}, **meant}, None)
    return quantized, reference, meant


def _cfg(folder: str, **kw):
    return build_config({"model": folder, "device": "cpu", "dtype": "float32", "kv_cache_gib": 0.01,
                         "max_model_len": 128, **kw}, env={})


def _logits(runner: ModelRunner) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    seqs = [ScheduledSeq(f"r{i}", torch.randint(3, VOCAB, (n,), generator=g).tolist(), 0, [i * 4 + j for j in range(4)],
                         True, SamplingParams(temperature=0.0)) for i, n in enumerate((9, 1, 30))]
    return step_logits(runner, StepPlan(0, seqs))


@pytest.fixture(autouse=True)
def _restore_schemes(monkeypatch):
    """A runner sets the process's weight schemes: restored after each test, and plain here."""
    monkeypatch.setattr(F, "MODE", "off")
    monkeypatch.setattr(W, "MODE", "off")
    monkeypatch.setattr(cq, "QUANTIZATION", "none")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("w4ckpt")
    return {layout: _checkpoints(root, layout) for layout in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_4bit_checkpoint_on_the_cpu_serves_what_it_means(checkpoints, layout):
    """Dequantized at load (W4A16 runs on CUDA): the logits of the checkpoint's own values,
    bit for bit (same fp32 weights, same kernels); int8 on top quantizes them again."""
    quantized, reference, _ = checkpoints[layout]
    r = ModelRunner(_cfg(quantized))
    rep = r.report()
    assert rep["quantization"] == "none" and "dequantized to float32 at load" in rep["weight_format"]
    assert W.MODE == "off" and F.MODE == "off"
    assert f"startup report: worker 0 weights: {rep['weight_format']}" in format_startup_report({"workers": [rep]})
    assert rep["weight_format"].startswith(f"{layout.split('_')[0]} 4-bit (group ")
    want = _logits(ModelRunner(_cfg(reference)))
    assert torch.equal(_logits(r), want)
    r8 = ModelRunner(_cfg(quantized, quantization="int8"))
    assert r8.report()["quantization"] == "int8"
    assert (_logits(r8) - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_4bit_weights_kept_packed_from_the_checkpoint(checkpoints, layout, monkeypatch):
    """MODE "checkpoint": each Linear (stacked qkv / gate_up included) holds exactly the
    checkpoint's values as a W4Weight; the plain lm_head stays as it was."""
    quantized, _, meant = checkpoints[layout]
    spec = load_model_spec(quantized)
    monkeypatch.setattr(W, "MODE", "checkpoint")
    model = model_class(spec)(spec, 128)
    load_weights(model, quantized, spec.checkpoint_quant)
    for i, layer in enumerate(model.model.decoder_layers):
        a, m = layer.self_attn, layer.mlp
        for lin, names in ((a.qkv_proj, ("q_proj", "k_proj", "v_proj")), (a.o_proj, ("o_proj",)),
                           (m.gate_up_proj, ("gate_proj", "up_proj")), (m.down_proj, ("down_proj",))):
            assert isinstance(lin.qweight, W.W4Weight) and lin.weight.device.type == "meta"
            group = "self_attn" if lin in (a.qkv_proj, a.o_proj) else "mlp"
            want = torch.cat([meant[f"model.layers.{i}.{group}.{n}.weight"] for n in names])
            assert torch.equal(lin.qweight.dequantize(), want)
    assert model.lm_head.qweight is None and model.lm_head.weight.device.type == "cpu"


@pytest.mark.parametrize("layout", ["awq", "gptq_sym"])
def test_runner_with_packed_4bit_weights_on_the_torch_reference(checkpoints, layout, monkeypatch):
    """The W4A16 serving path end to end on the CPU: the runner keeping the packed weights
    (its device check bypassed), every projection through `W4Weight`'s torch reference,
    against the checkpoint's meaning in fp32 (same products up to summation order)."""
    import services.worker.model_runner as mr

    quantized, reference, _ = checkpoints[layout]
    want = _logits(ModelRunner(_cfg(reference)))
    monkeypatch.setattr(mr, "check_w4a16_setting", lambda *a: None)
    monkeypatch.setattr(mr, "w4a16_in_use", lambda *a: True)
    r = ModelRunner(_cfg(quantized))
    rep = r.report()
    assert rep["quantization"] == layout.split("_")[0] and rep["weight_format"].endswith("from the checkpoint (W4A16)")
    assert rep["weight_bytes_held"] < rep["weight_bytes"] and W.MODE == "checkpoint"
    lins = [m for m in r.model.modules() if isinstance(m, Linear)]
    assert len(lins) == 4 * LAYERS and all(isinstance(m.qweight, W.W4Weight) for m in lins)
    assert getattr(r.model.lm_head, "qweight", None) is None  # plain in the checkpoint
    plain = sum(p.numel() * p.element_size() for p in {id(p): p for p in r.model.parameters()}.values()
                if p.device.type != "meta")
    assert rep["weight_bytes_held"] == plain + sum(m.qweight.nbytes for m in lins)  # the packed bytes count
    got = _logits(r)
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_dummy_weights_with_awq_are_random_packed_values_of_the_right_shapes(tmp_path, monkeypatch):
    """--load-format dummy under MODE "dummy": every quantizable Linear gets a W4Weight of its
    shape (qweight [K/8, N] int32, zeros / scales [K/G, N]; G = 128, or K where 128 does not
    divide it); the lm_head stays in the model dtype."""
    monkeypatch.setattr(W, "MODE", "dummy")
    folder = _write(tmp_path / "dummy", {}, None)
    spec = load_model_spec(folder)
    model = model_class(spec)(spec, 128)
    load_dummy_weights(model, 0)
    qkv = model.model.decoder_layers[0].self_attn.qkv_proj
    assert isinstance(qkv.qweight, W.W4Weight)
    n = (HEADS + 2 * KV) * HD
    assert qkv.qweight.qweight.shape == (H // 8, n) and qkv.qweight.qweight.dtype == torch.int32
    assert qkv.qweight.scales.shape == (H // 128, n) and qkv.qweight.zeros.shape == (H // 128, n)
    down = model.model.decoder_layers[0].mlp.down_proj.qweight
    assert isinstance(down, W.W4Weight) and down.group_size == FFN  # 128 does not divide 192: per channel
    x = torch.randn(2, H)
    assert torch.isfinite(qkv(x)).all()


def _broken(tmp_path, edit) -> str:
    from safetensors.torch import load_file

    quantized, _, _ = _checkpoints(tmp_path, "awq")
    path = os.path.join(quantized, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return quantized


def _plain_k(t):
    for a in ("qweight", "qzeros", "scales"):
        t.pop(f"model.layers.0.self_attn.k_proj.{a}")
    t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(KV * HD, H).half()


@pytest.mark.parametrize("edit,match,modes", [
    (lambda t: t.pop("model.layers.0.self_attn.o_proj.scales"), r"o_proj.qweight.*missing \['scales'\]",
     ("off", "checkpoint")),
    (lambda t: t.__setitem__("model.layers.1.mlp.down_proj.scales", torch.ones(2, 64).half()), "do not fit",
     ("off", "checkpoint")),
    (_plain_k, "one format", ("checkpoint",)),  # dequantized (off), a plain shard beside 4-bit ones loads
])
def test_malformed_4bit_checkpoints_fail_loudly(tmp_path, edit, match, modes, monkeypatch):
    folder = _broken(tmp_path, edit)
    for mode in modes:
        monkeypatch.setattr(W, "MODE", mode)
        spec = load_model_spec(folder)
        model = model_class(spec)(spec, 128)
        with pytest.raises(ValueError, match=match):
            load_weights(model, folder, spec.checkpoint_quant)


def test_configuration_refuses_what_cannot_run(checkpoints):
    quantized, reference, _ = checkpoints["awq"]
    with pytest.raises(ValueError, match=r"'awq' \(W4A16\) runs on CUDA only.*--quantization none"):
        _cfg(quantized, quantization="awq")
    with pytest.raises(ValueError, match="needs a checkpoint quantized with gptq.*this is a awq checkpoint"):
        build_config({"model": quantized, "device": "cuda", "quantization": "gptq"}, env={})
    with pytest.raises(ValueError, match="Kestrel does not quantize to 4 bits at load"):
        build_config({"model": reference, "device": "cuda", "quantization": "awq"}, env={})
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        build_config({"model": quantized, "device": "cuda", "dtype": "float32", "quantization": "awq"}, env={})
    cfg = build_config({"model": reference, "device": "cuda", "quantization": "awq", "load_format": "dummy"}, env={})
    assert cfg.quantization == "awq"
    assert build_config({"model": quantized, "device": "cuda"}, env={}).quantization == "none"  # found at load


def test_the_cli_refuses_awq_on_the_cpu_before_any_process_starts(tmp_path, checkpoints):
    quantized, _, _ = checkpoints["awq"]
    runtime = tmp_path / ("rt" + uuid.uuid4().hex[:6])
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", quantized, "--device", "cpu",
                        "--quantization", "awq", "--runtime-dir", str(runtime),
                        "--instance-id", "w4" + uuid.uuid4().hex[:6]],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "setting quantization: 'awq' (W4A16) runs on CUDA only" in r.stderr, r.stderr
    assert not runtime.exists(), "a process started: the runtime folder was created"
