"""Weight loading from a Hugging Face folder of safetensors files (docs/ARCHITECTURE.md §6).

Files: every shard listed in `model.safetensors.index.json` (paths relative to the folder,
subfolders included), else `model.safetensors`. Each checkpoint tensor goes to one
parameter, or to one shard of a stacked parameter (the model's `packed_modules`, e.g.
q_proj -> shard 0 of qkv_proj; a key may span name parts, e.g. Qwen3-Next's
mlp.shared_expert.gate_proj -> shard 1 of mlp.in_proj: `_target`), or to one expert's shard of a stacked expert parameter
(`mlp.experts.3.up_proj.weight` -> expert 3, shard 1 of `mlp.experts.w13_weight`:
`services.worker.layers.moe`). Loading fails loudly:
- FileNotFoundError naming the file when a listed shard (or the only file) is missing;
- ValueError naming the tensor and file on a shape mismatch, on a checkpoint tensor that no
  parameter takes, and naming the parameters that stay unloaded (a tied lm_head excepted).
After loading, each module's `process_weights_after_loading()` runs, if it has one.
Per-layer KV cache scales of FP8 checkpoints are not parameters: `read_kv_scales`.
FP8 weights of a checkpoint with an FP8 `quantization_config` (`load_weights`' quant;
`services.worker.fp8_checkpoint`): a Linear's go to it as per-row e4m3 values and scales
when `kernels.fp8_linear.MODE` is "checkpoint" (`layers.fp8.stash_fp8_rows`); every other
fp8 tensor is dequantized (its scales applied in fp32) into its parameter's dtype.
4-bit weights of an AWQ / GPTQ checkpoint (quant.is_w4; `services.worker.w4a16_checkpoint`):
`<module>.qweight` (with its qzeros / scales / g_idx) fills `<module>.weight`; a Linear's go
to it packed (`layers.w4a16.stash_w4`) when `kernels.w4a16_linear.MODE` is "checkpoint",
every other one is dequantized into its parameter's dtype (the CPU, or W4A16 not in use).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from safetensors import safe_open
from torch import nn

from services.worker.fp8_checkpoint import Fp8Checkpoint
from services.worker.layers.fp8 import stash_fp8_rows, takes_fp8_rows
from services.worker.layers.linear import shard_rows, unpack_cpu_weights
from services.worker.layers.w4a16 import stash_w4, takes_w4
from services.worker.layers.moe import EXPERT_PARAMS, expert_shard
from services.worker.w4a16_checkpoint import W4Checkpoint
from shared.weight_quant import CheckpointQuant

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a model folder, in load order.

    Raises FileNotFoundError naming the missing file (listed shard, or model.safetensors
    when there is no index).
    """
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        files = [os.path.join(path, f) for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not os.path.isfile(f):
                raise FileNotFoundError(f"shard {os.path.relpath(f, path)!r} listed in {index} is missing")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path!r}")
    return [single]


# A shard of a parameter: None (the whole tensor), a shard index of its rows, or
# (expert, shard index or None) of a stacked expert parameter.
Shard = int | tuple[int, int | None] | None


def _target(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, Shard]:
    """Checkpoint tensor name -> (parameter name, shard). An expert's tensor
    (`<prefix>.experts.<e>.<proj>.weight`, <proj> in `layers.moe.EXPERT_PARAMS`) goes to
    the stacked parameter `<prefix>.experts.<ours>` as (e, shard). A key of `packed` is one
    name part ("q_proj") or several, dot-joined ("mlp.shared_expert.gate_proj": a run of
    consecutive parts; its value may be dotted too, "mlp.in_proj"); scanning the parts left
    to right, the longest key starting at a part wins, so "mlp.shared_expert.gate_proj"
    takes a shared expert's gate_proj before a one-part "gate_proj" would."""
    parts = name.split(".")
    longest = max((k.count(".") + 1 for k in packed), default=1)
    for i, part in enumerate(parts):
        if (part == "experts" and i + 3 == len(parts) - 1 and parts[i + 1].isdigit()
                and parts[i + 2] in EXPERT_PARAMS and parts[-1] == "weight"):
            ours, shard = EXPERT_PARAMS[parts[i + 2]]
            return ".".join(parts[:i + 1] + [ours]), (int(parts[i + 1]), shard)
        for n in range(min(longest, len(parts) - i), 0, -1):
            key = part if n == 1 else ".".join(parts[i:i + n])
            if key in packed:
                stacked, shard = packed[key]
                return ".".join(parts[:i] + [stacked] + parts[i + n:]), shard
    return name, None


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """`name` with the first matching checkpoint prefix replaced by ours (a model's
    `checkpoint_renames`), else unchanged."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _destination(param: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The view of `param` that one checkpoint tensor fills. Raises IndexError for a shard
    or expert the parameter does not have."""
    if isinstance(shard, tuple):
        return expert_shard(param, *shard)
    return shard_rows(param, shard)


# Per-layer KV cache scales of FP8 checkpoints (a 1-element tensor each; real value =
# stored value * scale), in the names their writers use: `self_attn.k_scale` / `v_scale`
# (llm-compressor, compressed-tensors), `self_attn.k_proj.k_scale` / `v_proj.v_scale`
# (NVIDIA ModelOpt), `self_attn.k_proj.output_scale` / `v_proj.output_scale` (older
# compressed-tensors) and `self_attn.kv_scale` (one scale for both, an older form).
# They are no model parameter: `load_weights` skips them, `read_kv_scales` reads them.
_KV_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.k_scale|"
                       r"v_proj\.v_scale|k_proj\.output_scale|v_proj\.output_scale)$")


def read_kv_scales(path: str) -> dict[int, dict[str, float]]:
    """The per-layer KV scales a checkpoint carries (see `_KV_SCALE` for the names).

    Returns {decoder layer index: {"k": scale, "v": scale}} with only the scales found
    (a `kv_scale` gives both); {} for a checkpoint without any. Raises FileNotFoundError as
    `checkpoint_files`, ValueError for a scale that is not one positive finite number."""
    found: dict[int, dict[str, float]] = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                m = _KV_SCALE.search(name)
                if m is None:
                    continue
                t = f.get_tensor(name)
                if t.numel() != 1 or not (math.isfinite(x := float(t.float().reshape(()))) and x > 0):
                    raise ValueError(f"KV scale {name} in {file}: one positive finite number expected, "
                                     f"got shape {tuple(t.shape)}")
                which = m.group(2)
                keys = ("k", "v") if which == "kv_scale" else (which[0],)
                for key in keys:
                    found.setdefault(int(m.group(1)), {})[key] = x
    return found


def load_weights(model: nn.Module, path: str, quant: CheckpointQuant | None = None) -> int:
    """Fill every parameter of `model` from the folder's safetensors files.

    Tensors are converted to each parameter's dtype and device on copy. quant: the
    checkpoint's FP8 or 4-bit format (`ModelSpec.checkpoint_quant`; None: no quantized tensors
    expected), see the module docstring.
    Returns the number of bytes of the model's parameters in their dtype (each shared tensor
    once; a layer that keeps fp8 weights counts as its model-dtype parameter).
    Raises as described in the module docstring, and ValueError for an fp8 tensor without a
    scale (or a scale of the wrong shape), a qweight without its qzeros / scales (or of the
    wrong shapes), and a stacked weight mixing fp8 or 4-bit and plain shards.
    """
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    packed = getattr(model, "packed_modules", {})
    ignored = getattr(model, "ignored_tensors", ())
    ignored_prefixes = getattr(model, "ignored_prefixes", ())  # e.g. an MTP head not loaded
    renames = getattr(model, "checkpoint_renames", ())  # (checkpoint prefix, ours), e.g. a multimodal wrapper's
    tied = getattr(model, "tied_lm_head", False)
    loaded: set[tuple[str, Shard]] = set()
    unused: list[str] = []
    files = checkpoint_files(path)
    fp8 = Fp8Checkpoint.open(files, quant) if quant is not None and not quant.is_w4 else None
    w4 = W4Checkpoint.open(files, quant) if quant is not None and quant.is_w4 else None
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith(ignored) or name.startswith(ignored_prefixes) or \
                        (tied and name == "lm_head.weight") or _KV_SCALE.search(name) or \
                        (fp8 is not None and fp8.is_scale(name)) or (w4 is not None and w4.is_aux(name)):
                    continue
                wname = w4.weight_name(name) if w4 is not None else None
                pname, shard = _target(_renamed(wname or name, renames), packed)
                if pname not in params:
                    unused.append(f"{name} ({os.path.relpath(file, path)})")
                    continue
                try:
                    dst = _destination(params[pname], shard)
                except IndexError as e:
                    raise ValueError(f"tensor {name} in {file}: {e} of parameter {pname}") from None
                src = f.get_tensor(name)
                if w4 is not None and wname is not None:
                    owner_name, _, attr = pname.rpartition(".")
                    owner = model.get_submodule(owner_name)
                    keep = takes_w4(owner, attr) and not isinstance(shard, tuple)
                    dev, stashed = dst.device, getattr(owner, "w4_stash", None)
                    if dev.type == "meta" and stashed:  # an earlier shard replaced the parameter
                        dev = next(iter(stashed.values())).qweight.device
                    qw = w4.weight(name, src, dev)
                    if keep and not isinstance(shard, tuple):
                        try:
                            params[pname] = stash_w4(owner, shard, qw)
                        except ValueError as e:
                            raise ValueError(f"tensor {name} in {file}: {e} of parameter {pname}") from None
                        loaded.add((pname, shard))
                        continue
                    src = qw.dequantize()
                if fp8 is not None and fp8.quantized(name, src, file):
                    owner_name, _, attr = pname.rpartition(".")
                    owner = model.get_submodule(owner_name)
                    if takes_fp8_rows(owner, attr) and isinstance(shard, int | None):
                        st = getattr(owner, "fp8_stash", None)
                        q, s = fp8.rows(name, src, st.q.device if st is not None else dst.device)
                        try:
                            params[pname] = stash_fp8_rows(owner, shard, q, s)
                        except ValueError as e:
                            raise ValueError(f"tensor {name} in {file}: {e} of parameter {pname}") from None
                        loaded.add((pname, shard))
                        continue
                    src = fp8.dequantized(name, src, dst.device)
                if dst.device.type == "meta":  # the other shards of this Linear came as fp8 / 4-bit
                    raise ValueError(f"tensor {name} in {file}: {src.dtype}, but other shards of parameter "
                                     f"{pname} are fp8 or 4-bit; a stacked weight must be one format")
                if src.shape != dst.shape:
                    raise ValueError(f"tensor {name} in {file}: shape {tuple(src.shape)}, "
                                     f"parameter {pname} expects {tuple(dst.shape)}")
                dst.copy_(src)
                loaded.add((pname, shard))
    if unused:
        raise ValueError(f"checkpoint tensors not used by {type(model).__name__}: {unused}")
    missing = [n if s is None else f"{n}[shard {s}]" for n, p in params.items()
               for s in _shards(p) if (n, s) not in loaded]
    if len(missing) > 20:
        missing = missing[:20] + [f"... {len(missing) - 20} more"]
    if missing:
        raise ValueError(f"parameters not loaded from {path!r}: {missing}")
    process_weights_after_loading(model)
    return sum(p.numel() * p.element_size() for p in params.values())


def load_dummy_weights(model: nn.Module, seed: int) -> int:
    """Fill every parameter with seeded random values, for benchmarks of published shapes
    without a checkpoint (`--load-format dummy`). Returns parameter bytes.

    Values are drawn on each parameter's device at its dtype, from one generator seeded
    with `seed` (same seed, device and shapes -> same weights): norm weights (1-D, name
    containing "norm") = 1, biases = 0, every other weight ~ N(0, 0.02^2) (GPT-2's init
    scale; with unit norms the activations stay finite through any depth).
    """
    devices = {p.device for p in model.parameters()}
    gens = {d: torch.Generator(device=d).manual_seed(seed) for d in devices}
    total = 0
    for name, p in model.named_parameters():
        if p.dim() == 1 and "norm" in name:
            p.data.fill_(1.0)
        elif name.endswith("bias"):
            p.data.zero_()
        else:
            p.data.normal_(0.0, 0.02, generator=gens[p.device])
        total += p.numel() * p.element_size()
    process_weights_after_loading(model)
    return total


@contextmanager
def dense_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, `model`'s weights are dense torch tensors (CPU fp32 linear weights
    are packed for oneDNN after loading: `layers.linear.pack_cpu_weight`), to be changed
    in place (tests sharpen or refill them); on exit they are processed (packed) again."""
    unpack_cpu_weights(model)
    try:
        yield model
    finally:
        process_weights_after_loading(model)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each module re-lay its loaded weights (e.g. `Linear`'s CPU gemm layout)."""
    for m in model.modules():
        hook = getattr(m, "process_weights_after_loading", None)
        if hook is not None:
            hook()


def _shards(p: torch.Tensor) -> list[Shard]:
    """Every shard a checkpoint must fill for parameter p (see `Shard`)."""
    sizes = getattr(p, "shard_sizes", None)
    rows: list[int | None] = [None] if sizes is None else list(range(len(sizes)))
    experts = getattr(p, "num_experts", None)
    if experts is None:
        return list(rows)
    return [(e, r) for e in range(experts) for r in rows]
