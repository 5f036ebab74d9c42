"""`--quantization gguf` (services/worker/gguf_loader.py) on a tiny llama GGUF written by the
tests (tests/gguf_tiny.py: Q4_0, Q4_1, Q4_K and Q8_0 linear weights, a Q8_0 embedding, tied or
with a Q4_0 head), converted by `kestrel fetch-model --gguf` as users do.

Truth: the folder fetch-model converted from the same file (every tensor dequantized to fp32
by the `gguf` package), served with --quantization none. The gguf runner's int4 layers are
the file's blocks (within the bf16 rounding of their scales and zeros); its products run with
bf16 activations, and its Q8_0 linear weights and the tied head take per-channel int8.
Measured (2 seeds, tied and untied): max |logit - fp32 logit| 1.4-1.8% of the largest |fp32
logit|, same argmax everywhere. A loader bug is far outside: without the rotary row order of
the int4 q/k rows 66%, with Q4_1's zero taken as m (not m + 8 d) 79%. Bound: 3%.
Also here: fetch-model's GGUF record, and every refusal of the setting at configuration time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch

from kernels import cpu_quant_linear as cq
from services.worker.model_runner import ModelRunner
from shared.config import build_config
from shared.gguf_source import POINTER_FILE, gguf_file_of
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
from tests.gguf_tiny import HEADS, KV_HEADS, LAYER_TYPES, LAYERS, hf_weights, tiny_model_folder
from tests.runner_driver import step_logits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOGIT_TOL = 0.03  # of the largest |fp32 logit| (module docstring)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny(request, tmp_path_factory) -> tuple[str, bool]:
    root = tmp_path_factory.mktemp("gguf-tied" if request.param else "gguf-untied")
    return tiny_model_folder(str(root), tied=request.param), request.param


def _runner(folder: str, quantization: str) -> ModelRunner:
    cli = {"model": folder, "device": "cpu", "dtype": "float32", "kv_cache_gib": 0.02,
           "quantization": quantization}
    return ModelRunner(build_config(cli=cli, env={}))


PROMPTS = [[(7 * i + 3 * j) % 270 for j in range(5 + 11 * i)] for i in range(6)]  # 5..60 tokens


def _last_logits(runner: ModelRunner) -> torch.Tensor:
    out, base = [], 0
    for i, p in enumerate(PROMPTS):
        n = -(-len(p) // runner.block_size)
        seq = ScheduledSeq(f"p{i}", p, 0, list(range(base, base + n)), True, SamplingParams(temperature=0.0))
        base += n
        out.append(step_logits(runner, StepPlan(i, [seq]))[0])
    return torch.stack(out)


def test_fetch_model_records_the_kept_gguf(tmp_path):
    folder = tiny_model_folder(str(tmp_path))
    models = os.path.dirname(folder)
    with open(os.path.join(folder, POINTER_FILE)) as f:
        assert json.load(f) == {"gguf_file": "../.gguf/SmolLM2-135M-Instruct.Q4_1.gguf"}
    kept = os.path.join(models, ".gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert gguf_file_of(folder) == os.path.normpath(kept) and os.path.isfile(kept)
    # a folder converted before the record existed gets one from a second (no-op) run
    os.remove(os.path.join(folder, POINTER_FILE))
    before = os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns
    from services.worker.fetch_model import fetch_model
    assert fetch_model(models, name="tiny-llama") == folder
    assert gguf_file_of(folder) == os.path.normpath(kept)
    assert os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns == before


def test_fetch_model_records_a_given_gguf_in_a_folder_without_one(tmp_path):
    # a folder copied elsewhere without its record nor the kept GGUF: `--gguf FILE` keeps and
    # records FILE (it used to print "already there" and record nothing)
    folder = tiny_model_folder(str(tmp_path / "a"))
    src = gguf_file_of(folder)
    other = str(tmp_path / "b")
    os.makedirs(other)
    copy = os.path.join(other, os.path.basename(folder))
    shutil.copytree(folder, copy)
    os.remove(os.path.join(copy, POINTER_FILE))
    from services.worker.fetch_model import fetch_model
    assert fetch_model(other, name=os.path.basename(folder), gguf_path=src) == copy
    kept = os.path.join(other, ".gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert gguf_file_of(copy) == os.path.normpath(kept) and os.path.isfile(kept)


def test_gguf_weights_serve_the_dequantized_models_logits(tiny):
    folder, tied = tiny
    ref = _runner(folder, "none")
    ref_logits = _last_logits(ref)
    del ref
    runner = _runner(folder, "gguf")
    rep = runner.report()
    assert rep["quantization"] == "gguf"
    # every tensor's form: int4 linear weights from their blocks where all of a stacked
    # weight's shards are 4-bit, the rest dequantized (int8 after loading when a linear one)
    int4 = {t: 0 for t in ("Q4_0", "Q4_1", "Q4_K")}
    int8: dict[str, int] = {}
    for i in range(LAYERS):
        stacked_int8 = {"ffn_gate", "ffn_up"} if "Q8_0" in (LAYER_TYPES["ffn_gate"][i], LAYER_TYPES["ffn_up"][i]) \
            else set()
        for name, types in LAYER_TYPES.items():
            t = types[i]
            if t == "Q8_0" or name in stacked_int8:
                int8[t] = int8.get(t, 0) + 1
            else:
                int4[t] += 1
    if not tied:
        int4["Q4_0"] += 1  # the untied head
    want = {**{f"int4 {t}": n for t, n in int4.items() if n}, **{f"int8 {t}": n for t, n in int8.items()},
            "dense F32": 1 + 2 * LAYERS, "dense Q8_0": 1}
    assert rep["gguf_tensors"] == dict(sorted(want.items()))
    # the int4 layers hold the file's blocks: q/k rows in HF order, within the bf16 rounding
    # of the group scales and zeros (the kernel's weight, read back through it)
    model = runner.model
    hf = hf_weights(0, tied)  # (the values the file quantized: its blocks stay within a step of them)
    qkv0 = model.model.layers[0].self_attn.qkv_proj.qweight
    assert qkv0 is not None and qkv0.scheme == "int4" and qkv0.group_size == 32
    w = np.concatenate([hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    step = np.abs(w).max() / 7  # Q4_K's coarsest step here is far below this
    assert np.abs(qkv0.dequantize().numpy() - w).max() < step
    assert model.model.layers[1].self_attn.o_proj.qweight.scheme == "int8"  # Q8_0
    assert model.model.layers[1].mlp.gate_up_proj.qweight.scheme == "int8"  # Q4_K + Q8_0 shards
    head = model.lm_head
    # a tied head's copy: int8 weights, in w8a8 where the CPU has VNNI (cpu_quant_linear.head_scheme)
    assert (head.qweight_tied.scheme if tied else head.qweight.scheme) == (cq.head_scheme() if tied else "int4")
    assert rep["weight_bytes_held"] < 0.35 * rep["weight_bytes"]
    logits = _last_logits(runner)
    err = (logits - ref_logits).abs().max().item()
    scale = ref_logits.abs().max().item()
    assert err <= LOGIT_TOL * scale, f"max |logit error| {err:.4f} = {err / scale:.4f} of {scale:.2f}"
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


def test_the_int4_layers_are_the_files_blocks_exactly_up_to_bf16(tiny):
    """Each int4 layer against the `gguf` package's own reader and dequantizer of the file,
    q/k rows un-permuted and shards stacked: within max|w| / 16 of each group of 32 (g below).
    The bf16 rounding of a group's scale and zero moves it by at most (8 |scale| + |zero|) 2^-8
    (tests/unit/test_gguf_quant.py checks that bound exactly), about 3 g 2^-8 for these
    min/max-fitted blocks; a row or shard in the wrong place is off by the order of g."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from services.worker.gguf_names import hf_name, unpermute_rotary

    folder, _ = tiny
    runner = _runner(folder, "gguf")
    mods = dict(runner.model.named_modules())
    truth: dict[str, np.ndarray] = {}
    for t in GGUFReader(gguf_file_of(folder)).tensors:
        w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        name = hf_name(t.name)
        if "q_proj" in name or "k_proj" in name:
            w = unpermute_rotary(w, HEADS if "q_proj" in name else KV_HEADS)
        truth[name] = w
    checked = 0
    for i in range(LAYERS):
        for mod, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                           ("self_attn.o_proj", ("self_attn.o_proj",)),
                           ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
                           ("mlp.down_proj", ("mlp.down_proj",))):
            qw = mods[f"model.layers.{i}.{mod}"].qweight
            if qw.scheme != "int4":
                continue
            w = torch.from_numpy(np.concatenate([truth[f"model.layers.{i}.{p}.weight"] for p in parts]))
            g = w.reshape(w.shape[0], -1, 32).abs().amax(-1, keepdim=True)
            bound = (16 * g * 2.0 ** -8).expand(-1, -1, 32).reshape(w.shape) + 1e-7
            assert torch.all((qw.dequantize() - w).abs() <= bound), f"layer {i} {mod}"
            checked += 1
    assert checked == 6  # layer 0: all four; layer 1: qkv and down
    assert cq.QUANTIZATION == "gguf"


def test_gguf_refused_at_configuration_with_the_alternatives(tmp_path, tiny):
    folder, _ = tiny
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in os.listdir(folder):
        if f != POINTER_FILE:
            os.symlink(os.path.join(folder, f), bare / f)
    cli = {"model": str(bare), "device": "cpu", "quantization": "gguf"}
    with pytest.raises(ValueError, match=r"setting quantization: 'gguf'.*records none.*kestrel_gguf\.json.*"
                                         r"kestrel fetch-model.*--quantization int4 or int8.*none"):
        build_config(cli, env={})
    (bare / POINTER_FILE).write_text(json.dumps({"gguf_file": "../gone.gguf"}))
    with pytest.raises(ValueError, match=r"records, '.*gone\.gguf', which is missing: run `kestrel fetch-model`"):
        build_config(cli, env={})
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all, just bytes")
    (bare / POINTER_FILE).write_text(json.dumps({"gguf_file": "../x.gguf"}))
    with pytest.raises(ValueError, match=r"is not a GGUF file.*--quantization int4"):
        build_config(cli, env={})
    with pytest.raises(ValueError, match=r"'gguf' weights run on the CPU only.*--quantization none on cuda.*"
                                         r"--device cpu --quantization gguf"):
        build_config({"model": folder, "device": "cuda", "quantization": "gguf"}, env={})
    with pytest.raises(ValueError, match=r"--load-format dummy loads none; use --quantization int4 or int8"):
        build_config({"model": folder, "device": "cpu", "quantization": "gguf", "load_format": "dummy"}, env={})
    assert build_config({"model": folder, "device": "cpu", "quantization": "gguf"}, env={}).quantization == "gguf"


def test_the_cli_refuses_a_folder_without_its_gguf_before_any_process_starts(tmp_path, tiny):
    folder, _ = tiny
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in os.listdir(folder):
        if f != POINTER_FILE:
            os.symlink(os.path.join(folder, f), bare / f)
    runtime = tmp_path / "rt"
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(bare), "--device", "cpu",
                        "--quantization", "gguf", "--runtime-dir", str(runtime),
                        "--instance-id", "ggf" + uuid.uuid4().hex[:6]],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "setting quantization: 'gguf'" in r.stderr and "kestrel fetch-model" in r.stderr, r.stderr
    assert not runtime.exists(), "a process started: the runtime folder was created"


def test_gguf_keeps_what_int4_requantization_loses(tiny):
    """Against the dequantized weights (the fp32 folder): --quantization int4 re-fits them
    with its min/max groups, which re-finds Q4_1's grid (a min/max fit too: the same weights)
    but not Q4_0's (absmax, symmetric) nor Q4_K's (6-bit sub-block scales); gguf keeps each
    file's blocks. Measured (layer 0, max error / max |w|): Q4_0 o_proj int4 0.023, gguf
    0.0021; Q4_K down_proj 0.0089 / 0.0021; Q4_1 gate_up 0.0021 both."""
    from safetensors.torch import load_file

    folder, _ = tiny
    sd = load_file(os.path.join(folder, "model.safetensors"))
    runners = {q: dict(_runner(folder, q).model.named_modules()) for q in ("int4", "gguf")}

    def rel_err(q: str, module: str, parts: tuple[str, ...]) -> float:
        prefix = f"model.layers.0.{module.split('.')[0]}"
        w = torch.cat([sd[f"{prefix}.{p}.weight"] for p in parts])
        return ((runners[q][f"model.layers.0.{module}"].qweight.dequantize() - w).abs().max() / w.abs().max()).item()

    for module, parts in (("self_attn.o_proj", ("o_proj",)), ("mlp.down_proj", ("down_proj",))):  # Q4_0, Q4_K
        assert rel_err("int4", module, parts) > 2 * rel_err("gguf", module, parts), module
    gate_up = ("mlp.gate_up_proj", ("gate_proj", "up_proj"))  # Q4_1
    assert rel_err("int4", *gate_up) == pytest.approx(rel_err("gguf", *gate_up), rel=0.05)


def test_a_gguf_that_is_not_the_folders_fails_loudly(tmp_path):
    """The untied folder pointed at the tied model's GGUF (no output.weight): the worker
    refuses to start with the parameter it could not fill, as the safetensors loader does."""
    from shared.gguf_source import write_pointer

    tied = tiny_model_folder(str(tmp_path / "a"), tied=True)
    untied = tiny_model_folder(str(tmp_path / "b"), tied=False)
    write_pointer(untied, gguf_file_of(tied))
    with pytest.raises(ValueError, match=r"parameters not loaded from .*: \['lm_head.weight'\]"):
        _runner(untied, "gguf")
