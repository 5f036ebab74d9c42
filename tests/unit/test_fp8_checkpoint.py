"""FP8 checkpoints (services/worker/fp8_checkpoint.py, the loader, shared/weight_quant.py) on the
CPU, on tiny Llama checkpoints this test writes in the published layouts:

- compressed-tensors "channel" (llm-compressor's FP8_DYNAMIC): `<m>.weight` F8_E4M3 [N, K] and
  `<m>.weight_scale` [N, 1], `ignore: ["lm_head"]`;
- compressed-tensors "tensor" with static activations (FP8 per tensor): `<m>.weight_scale`
  [1] (bf16) and `<m>.input_scale` [1];
- Hugging Face fine-grained FP8 (quant_method "fp8", DeepSeek-V3's layout): `<m>.weight_scale_inv`
  [ceil(N/128), ceil(K/128)] fp32 with `weight_block_size` [128, 128], partial blocks at the
  edges, `modules_to_not_convert: ["lm_head"]`.
The truth is each checkpoint's meaning computed here from its own tensors (q times its scale,
block by block) and written as a plain fp32 checkpoint: the FP8 checkpoint served on the CPU
(dequantized at load) must give that checkpoint's logits; loaded with FP8 weights kept
(`kernels.fp8_linear.MODE` "checkpoint", the CPU's torch reference products) every Linear must
hold exactly the checkpoint's fp8 values (per-channel, per-tensor) or stay within the e4m3
bound of them (block scales, converted per row), and the runner's logits stay close. Also the
loud failures (an fp8 tensor without a scale, a scale of the wrong shape, a stacked weight
mixing fp8 and plain shards), the parse of both configs and the refusals at configuration
time, with the CLI exiting before any process starts.
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
from services.worker.layers.linear import Linear
from services.worker.loader import load_weights
from services.worker.model_runner import ModelRunner
from services.worker.models import model_class
from shared.config import build_config
from shared.device import DeviceInfo
from shared.model_spec import load_model_spec
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
from shared.startup_report import format_startup_report
from shared.weight_quant import CheckpointQuant, fp8_in_use, parse_quantization_config
from tests.runner_driver import step_logits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM2 = "models/SmolLM2-135M-Instruct"
H, HEADS, KV, HD, FFN, LAYERS, VOCAB = 144, 4, 2, 36, 200, 2, 300
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
          "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD, "intermediate_size": FFN,
          "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
          "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
PROJ = {"self_attn.q_proj": (HEADS * HD, H), "self_attn.k_proj": (KV * HD, H), "self_attn.v_proj": (KV * HD, H),
        "self_attn.o_proj": (H, HEADS * HD), "mlp.gate_proj": (FFN, H), "mlp.up_proj": (FFN, H),
        "mlp.down_proj": (H, FFN)}
DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
QUANT_CONFIGS = {
    "ct_channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                       "num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True,
                       "observer": "minmax"}, "input_activations": DYNAMIC_TOKEN}},
                   "ignore": ["lm_head"], "kv_cache_scheme": None},
    "ct_tensor": {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                            "symmetric": True}}},
                  "ignore": ["lm_head"]},
    "hf_block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                 "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]},
}


def _quantize(layout: str, w: torch.Tensor, name: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The checkpoint tensors of weight `name` (w [N, K] fp32) in `layout`, and the values they
    mean (q times its scale, computed the plain way)."""
    n, k = w.shape
    if layout == "ct_channel":
        scale = (w.abs().amax(1, keepdim=True) / 448).float()
        q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return {name: q, name + "_scale": scale}, q.float() * scale
    if layout == "ct_tensor":
        scale = (w.abs().max() / 448).reshape(1).bfloat16()
        q = (w / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
        base = name.rpartition(".")[0]
        return {name: q, name + "_scale": scale, base + ".input_scale": torch.tensor([0.02])}, q.float() * scale.float()
    nb, kb = -(-n // 128), -(-k // 128)
    sb = torch.empty(nb, kb)
    for i in range(nb):
        for j in range(kb):
            sb[i, j] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max() / 448
    full = sb.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {name: q, name.rpartition(".")[0] + ".weight_scale_inv": sb}, q.float() * full


def _write(folder, tensors: dict[str, torch.Tensor], quant: dict | None) -> str:
    os.makedirs(folder, exist_ok=True)
    cfg = dict(CONFIG, **({"quantization_config": quant} if quant else {}))
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return str(folder)


def _checkpoints(root, layout: str) -> tuple[str, str, dict[str, torch.Tensor]]:
    """(the FP8 checkpoint, the fp32 checkpoint of what it means, those values by weight name);
    also `<root>/original`, the fp32 checkpoint of the unquantized weights (the same for
    every layout: one seed)."""
    g = torch.Generator().manual_seed(0)
    plain = {"model.embed_tokens.weight": torch.randn(VOCAB, H, generator=g) * 0.5,
             "model.norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
             "lm_head.weight": torch.randn(VOCAB, H, generator=g) / H ** 0.5}
    fp8, meant, original = {}, {}, {}
    for i in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            plain[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        for proj, (n, k) in PROJ.items():
            name = f"model.layers.{i}.{proj}.weight"
            w = torch.randn(n, k, generator=g) / k ** 0.5
            w[3, 5] = 8.0 / k ** 0.5  # an outlier
            tensors, values = _quantize(layout, w, name)
            fp8.update(tensors)
            meant[name] = values
            original[name] = w
    plain_bf16 = {k: v.bfloat16() for k, v in plain.items()}  # the unquantized tensors as published: bf16
    quantized = _write(root / layout, {**plain_bf16, **fp8}, QUANT_CONFIGS[layout])
    plain_f32 = {k: v.float() for k, v in plain_bf16.items()}
    reference = _write(root / (layout + "_meant"), {**plain_f32, **meant}, None)
    _write(root / "original", {**plain_f32, **original}, None)
    return quantized, reference, meant


def _cfg(folder: str, **kw):
    return build_config({"model": folder, "device": "cpu", "dtype": "float32", "kv_cache_gib": 0.01,
                         "max_model_len": 128, **kw}, env={})


def _logits(runner: ModelRunner) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    seqs = [ScheduledSeq(f"r{i}", torch.randint(3, VOCAB, (n,), generator=g).tolist(), 0, [i * 4 + j for j in range(4)],
                         True, SamplingParams(temperature=0.0)) for i, n in enumerate((9, 1, 30))]
    return step_logits(runner, StepPlan(0, seqs))


LAYOUTS = ["ct_channel", "ct_tensor", "hf_block"]


@pytest.fixture(autouse=True)
def _restore_schemes(monkeypatch):
    """A runner sets the process's weight schemes (kernels.fp8_linear.MODE,
    kernels.cpu_quant_linear.QUANTIZATION): restored after each test, and plain here."""
    monkeypatch.setattr(F, "MODE", "off")
    monkeypatch.setattr(cq, "QUANTIZATION", "none")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8ckpt")
    return {layout: _checkpoints(root, layout) for layout in LAYOUTS}


def test_both_published_configs_parse():
    ct = parse_quantization_config(QUANT_CONFIGS["ct_channel"])
    assert ct == CheckpointQuant("compressed-tensors", ("channel",), None, ("dynamic",))
    assert parse_quantization_config(QUANT_CONFIGS["ct_tensor"]).activations == ("static",)
    hf = parse_quantization_config(QUANT_CONFIGS["hf_block"])
    assert hf == CheckpointQuant("fp8", ("block",), (128, 128), ("dynamic",))
    assert hf.describe() == "fp8 fp8 (block 128x128)"
    assert parse_quantization_config({"quant_method": "fp8", "activation_scheme": "static"}).strategies == ("tensor",)
    assert parse_quantization_config(None) is None
    block_ct = {**QUANT_CONFIGS["ct_channel"], "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}}}
    assert parse_quantization_config(block_ct) == CheckpointQuant("compressed-tensors", ("block",), (128, 128),
                                                                  ("none",))


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "int", "strategy": "channel"}}}}, "weights of .*'int'.* are not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "nvfp4-pack-quantized", "weights": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group"}}}}, "format 'nvfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": False}}}}, "asymmetric"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "needs config_groups"),
])
def test_unsupported_quantization_configs_are_refused_by_name(qc, match):
    with pytest.raises(ValueError, match=match):
        parse_quantization_config(qc)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_checkpoint_on_the_cpu_serves_what_it_means(checkpoints, layout):
    """Dequantized at load (no FP8 products on the CPU): the logits of the checkpoint's own
    values, bit for bit (same fp32 weights, same kernels)."""
    quantized, reference, _ = checkpoints[layout]
    r = ModelRunner(_cfg(quantized))
    rep = r.report()
    assert rep["quantization"] == "none" and "dequantized to float32 at load" in rep["weight_format"]
    assert F.MODE == "off"
    lines = format_startup_report({"workers": [rep]})
    assert f"startup report: worker 0 weights: {rep['weight_format']}" in lines
    assert not any("other:" in ln and "weight_format" in ln for ln in lines)
    want = _logits(ModelRunner(_cfg(reference)))
    assert torch.equal(_logits(r), want)
    # int8 on top: dequantized, then the CPU's weight-only scheme
    r8 = ModelRunner(_cfg(quantized, quantization="int8"))
    assert r8.report()["quantization"] == "int8"
    assert (_logits(r8) - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_weights_kept_from_the_checkpoint(checkpoints, layout, monkeypatch):
    """MODE "checkpoint": each Linear holds the checkpoint's fp8 values (exactly, for channel
    and tensor scales; within the e4m3 bound for block scales, converted per row); the
    lm_head (unquantized in the checkpoint) stays as it was."""
    quantized, _, meant = checkpoints[layout]
    spec = load_model_spec(quantized)
    monkeypatch.setattr(F, "MODE", "checkpoint")
    model = model_class(spec)(spec, 128)
    load_weights(model, quantized, spec.checkpoint_quant)
    for i, layer in enumerate(model.model.decoder_layers):
        a, m = layer.self_attn, layer.mlp
        for lin, names in ((a.qkv_proj, ("q_proj", "k_proj", "v_proj")), (a.o_proj, ("o_proj",)),
                           (m.gate_up_proj, ("gate_proj", "up_proj")), (m.down_proj, ("down_proj",))):
            assert isinstance(lin.qweight, F.Fp8Weight) and lin.weight.device.type == "meta"
            group = "self_attn" if lin in (a.qkv_proj, a.o_proj) else "mlp"
            want = torch.cat([meant[f"model.layers.{i}.{group}.{n}.weight"] for n in names])
            got = lin.qweight.dequantize()
            if layout == "hf_block":
                bound = torch.maximum(want.abs() * F.FP8_REL_ERR, lin.qweight.scale[:want.shape[0], None]
                                      * F.FP8_SUBNORMAL_ERR) * (1 + 1e-6)
                assert torch.all((got - want).abs() <= bound)
            else:
                assert torch.equal(got, want)
    assert model.lm_head.qweight is None and model.lm_head.weight.device.type == "cpu"


@pytest.mark.parametrize("layout", ["ct_channel", "hf_block"])
def test_runner_with_fp8_weights_on_the_torch_reference(checkpoints, layout, monkeypatch):
    """The FP8 serving path end to end on the CPU: the runner in MODE "checkpoint" (its
    device check bypassed: FP8 products run on CUDA), every projection through `Fp8Weight`'s
    torch reference, against the checkpoint's meaning in fp32: the same logits for
    per-channel scales; for block scales (converted per row at load, one more e4m3 rounding)
    an error no larger than 1.5x the checkpoint's own quantization error against the
    unquantized weights (measured: 0.064 against 0.064, relative norm of the logits)."""
    import services.worker.model_runner as mr

    quantized, reference, _ = checkpoints[layout]
    want = _logits(ModelRunner(_cfg(reference)))  # plain fp32 weights
    original = _logits(ModelRunner(_cfg(os.path.join(os.path.dirname(reference), "original"))))
    monkeypatch.setattr(mr, "check_fp8_setting", lambda *a: None)
    monkeypatch.setattr(mr, "fp8_in_use", lambda *a: True)
    r = ModelRunner(_cfg(quantized))
    rep = r.report()
    assert rep["quantization"] == "fp8" and rep["weight_format"].startswith("fp8 from the checkpoint")
    assert rep["weight_bytes_held"] < rep["weight_bytes"] and F.MODE == "checkpoint"
    assert all(isinstance(m.qweight, F.Fp8Weight) for m in r.model.modules() if isinstance(m, Linear))
    got = _logits(r)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    own = rel(want, original)  # the checkpoint's quantization error (~0.06 on these random weights)
    assert 0.02 < own < 0.1
    if layout == "ct_channel":
        assert rel(got, want) < 1e-5
    else:
        assert 0 < rel(got, want) <= 1.5 * own


def _broken(tmp_path, layout, edit) -> str:
    quantized, _, _ = _checkpoints(tmp_path, layout)
    from safetensors.torch import load_file

    path = os.path.join(quantized, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return quantized


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("model.layers.1.mlp.down_proj.weight_scale"), "float8_e4m3fn without a weight_scale"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.weight_scale", torch.ones(5, 1)),
     "o_proj.weight: fp8 weight .* scale of shape \\(5, 1\\)"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight",
                             t["model.layers.0.self_attn.k_proj.weight"].float().bfloat16()),
     "but the checkpoint has a scale"),
])
def test_malformed_fp8_checkpoints_fail_loudly(tmp_path, edit, match, monkeypatch):
    folder = _broken(tmp_path, "ct_channel", edit)
    spec = load_model_spec(folder)
    for mode in ("off", "checkpoint"):
        monkeypatch.setattr(F, "MODE", mode)
        with pytest.raises(ValueError, match=match):
            load_weights(model_class(spec)(spec, 128), folder, spec.checkpoint_quant)


def test_a_stacked_weight_mixing_fp8_and_plain_shards_is_refused(tmp_path, monkeypatch):
    def plain_k(t):
        t.pop("model.layers.0.self_attn.k_proj.weight_scale")
        t["model.layers.0.self_attn.k_proj.weight"] = torch.randn(KV * HD, H).bfloat16()

    folder = _broken(tmp_path, "ct_channel", plain_k)
    spec = load_model_spec(folder)
    monkeypatch.setattr(F, "MODE", "checkpoint")
    with pytest.raises(ValueError, match="one format"):
        load_weights(model_class(spec)(spec, 128), folder, spec.checkpoint_quant)


def test_fp8_refused_where_it_cannot_run_before_loading():
    with pytest.raises(ValueError, match=r"setting quantization: 'fp8' weights \(W8A8\) run on CUDA GPUs of compute "
                                         r"capability 8.9\+ only \(device 'cpu'\); on the CPU use --quantization int8 "
                                         r"or int4"):
        build_config({"model": SMOLLM2, "device": "cpu", "quantization": "fp8"}, env={})
    ampere = DeviceInfo("cuda", "NVIDIA A100", "8.0", 80 << 30, 1)
    with pytest.raises(ValueError, match=r"compute capability 8.9\+ \(Ada, Hopper\); this GPU has 8.0; use "
                                         r"--quantization none"):
        build_config({"model": SMOLLM2, "device": "cuda", "quantization": "fp8"}, env={}, probe=ampere)
    hopper = DeviceInfo("cuda", "NVIDIA H200", "9.0", 141 << 30, 1)
    assert build_config({"model": SMOLLM2, "device": "cuda", "quantization": "fp8"}, env={},
                        probe=hopper).quantization == "fp8"
    with pytest.raises(ValueError, match=r"setting dtype: 'float16' with --quantization fp8.*--dtype bfloat16"):
        build_config({"model": SMOLLM2, "device": "cuda", "dtype": "float16", "quantization": "fp8"}, env={},
                     probe=hopper)
    unknown = DeviceInfo("cuda")  # no nvidia-smi: the worker checks with torch
    assert build_config({"model": SMOLLM2, "device": "cuda", "quantization": "fp8"}, env={},
                        probe=unknown).quantization == "fp8"
    with pytest.raises(ValueError, match=r"'int8' weights run on the CPU only.*--quantization fp8"):
        build_config({"model": SMOLLM2, "device": "cuda", "quantization": "int8"}, env={}, probe=hopper)


def test_the_worker_refuses_fp8_on_an_old_gpu_before_building_the_model(monkeypatch):
    """The worker's own check (the config may not know the GPU): torch's capability 8.0
    refuses the configuration before any weight is allocated or loaded."""
    import services.worker.model_runner as mr

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))

    def no_model(*a, **kw):
        raise AssertionError("the model was built")

    monkeypatch.setattr(mr, "model_class", no_model)
    cfg = build_config({"model": SMOLLM2, "device": "cuda", "quantization": "fp8"}, env={},
                       probe=DeviceInfo("cuda"))
    with pytest.raises(ValueError, match="this GPU has 8.0"):
        ModelRunner(cfg)


def test_fp8_checkpoints_run_as_fp8_only_where_they_can():
    ckpt = parse_quantization_config(QUANT_CONFIGS["ct_channel"])
    assert fp8_in_use("none", ckpt, "cuda", "bfloat16", (9, 0))
    assert fp8_in_use("fp8", None, "cuda", "bfloat16", (9, 0))
    assert not fp8_in_use("none", ckpt, "cuda", "bfloat16", (8, 0))  # dequantized on an A100
    assert not fp8_in_use("none", ckpt, "cuda", "float16", (9, 0))
    assert not fp8_in_use("none", ckpt, "cpu", "float32", None)
    assert not fp8_in_use("none", None, "cuda", "bfloat16", (9, 0))
    assert not fp8_in_use("int8", ckpt, "cpu", "float32", None)


def test_the_cli_refuses_fp8_on_the_cpu_and_unknown_checkpoint_formats_before_any_process_starts(tmp_path):
    awq = tmp_path / "bnb"
    awq.mkdir()
    (awq / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": {"quant_method": "bitsandbytes"}}))
    for args, want in ((["--model", SMOLLM2, "--device", "cpu", "--quantization", "fp8"],
                        "setting quantization: 'fp8' weights (W8A8) run on CUDA GPUs"),
                       (["--model", str(awq), "--device", "cpu"], "setting model: ")):
        runtime = tmp_path / ("rt" + uuid.uuid4().hex[:6])
        r = subprocess.run([sys.executable, "-m", "services.cli", "serve", *args, "--runtime-dir", str(runtime),
                            "--instance-id", "fp8" + uuid.uuid4().hex[:6]],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        assert want in r.stderr, r.stderr
        assert not runtime.exists(), "a process started: the runtime folder was created"
    assert "quant_method 'bitsandbytes' is not supported" in r.stderr
