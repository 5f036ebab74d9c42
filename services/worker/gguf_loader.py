"""Weight loading from a GGUF file's quantized blocks, for `--quantization gguf` on the CPU
(docs/ARCHITECTURE.md §6.3, §6.4).

The model folder (config.json, tokenizer) is the one `kestrel fetch-model` converted from the
GGUF, and records the file (shared/gguf_source.py). Every GGUF tensor goes to the parameter
its HF name targets (services/worker/gguf_names.py; stacked q/k/v and gate/up shards as in
loader.py), q and k rows un-permuted (llama.cpp's rotary order):

- a linear weight (a `Linear`, or an untied `LMHead`) whose tensors are all Q4_0 / Q4_1 / Q4_K
  becomes the layer's int4 `QuantWeight` from the blocks themselves: their codes, and each
  group's scale and zero (kernels/gguf_quant.py; the only change is the bf16 rounding of
  those, the kernel's format); the rotary permutation moves whole rows, codes, scales and
  zeros alike, so it is exact;
- every other tensor is dequantized with the `gguf` package (Q8_0, F32, F16, K-quants other
  than Q4_K, ...) into its parameter. A linear weight among them (or a stacked one with any
  such shard) then takes per-channel int8 after loading (`cpu_quant_linear.dense_scheme`):
  Q8_0's one scale per 32 has no exact per-channel form. The embedding stays in the model
  dtype (SmolLM2's Q8_0 embedding: the exact dequantized values), and a tied head multiplies
  by its int8 copy (`LMHead.qweight_tied`), as under int8 / int4.

The file's header and tensor table come from `shared.gguf_source.read_header` (the `gguf`
package's reader parses SmolLM2's tokenizer arrays field by field: 7 s on the loaded 2-core
VM, against 0.2 s); the tensor data from a read-only memory map, dequantized by the `gguf`
package (`gguf.quants.dequantize`, its type table `GGML_QUANT_SIZES`).

Fails loudly as loader.load_weights does: a tensor no parameter takes, a shape mismatch, a
parameter left unloaded; and a GGUF whose architecture is not llama, or a file cut short or
with an unknown tensor type (`shared.gguf_source.check_tensor_data`, before any tensor is read).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from kernels.cpu_quant_linear import pack_int4
from kernels.gguf_quant import INT4_TYPES, int4_groups
from services.worker.gguf_names import hf_name, rotary_heads, rotary_row_order, unpermute_rotary
from services.worker.layers.embedding import LMHead
from services.worker.layers.linear import Linear, set_quantized_weight
from services.worker.loader import Shard, _destination, _shards, _target, process_weights_after_loading
from shared.gguf_source import check_tensor_data, read_header, tensor_bytes


@dataclass
class GGUFLoad:
    """What `load_gguf_weights` did: file, the GGUF's path (as the model folder's record
    resolves it); weight_bytes, the parameters' bytes in the model dtype
    (as `loader.load_weights` counts them); tensors, how many GGUF tensors of each type took
    each form ("int4 Q4_1": from the blocks; "int8 Q8_0": a linear weight dequantized, int8
    after loading; "dense F32": dequantized into a parameter kept in the model dtype)."""

    file: str
    weight_bytes: int
    tensors: dict[str, int] = field(default_factory=dict)


def _int4_module(model: nn.Module, pname: str) -> nn.Module | None:
    """The layer whose weight `pname` is, when it can hold an int4 `QuantWeight` (a CPU
    `Linear`, or an untied `LMHead`), else None."""
    prefix, _, leaf = pname.rpartition(".")
    if leaf != "weight":
        return None
    module = model.get_submodule(prefix)
    if isinstance(module, Linear) or (isinstance(module, LMHead) and not module.tied):
        return module if module.weight.device.type == "cpu" else None
    return None


def load_gguf_weights(model: nn.Module, path: str) -> GGUFLoad:
    """Fill every parameter of `model` (a llama-family CausalLM on the CPU) from the GGUF
    file `path`, the linear weights in Q4_0 / Q4_1 / Q4_K as int4 from their blocks (module
    docstring), then run each module's `process_weights_after_loading`.

    Returns a `GGUFLoad`. Raises ValueError naming the tensor and file for an architecture
    other than llama, an unknown tensor name, a tensor no parameter takes, a shape mismatch,
    or parameters left unloaded (a tied lm_head excepted).
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    head = read_header(path)
    file = np.memmap(path, dtype=np.uint8, mode="r")
    check_tensor_data(head, path, file.size)  # every type known, whole blocks, data inside the file
    arch = head.metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported by --quantization gguf (llama)")
    n_heads = head.integer("llama.attention.head_count")
    n_kv = head.integer("llama.attention.head_count_kv", n_heads)
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    packed = getattr(model, "packed_modules", {})
    tied = getattr(model, "tied_lm_head", False)
    entries, unused = [], []
    for t in head.tensors:
        try:
            name = hf_name(t.name)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        if tied and name == "lm_head.weight":
            continue
        pname, shard = _target(name, packed)
        if pname not in params:
            unused.append(t.name)
            continue
        entries.append((t, name, pname, shard))
    if unused:
        raise ValueError(f"GGUF tensors not used by {type(model).__name__} in {path}: {unused}")
    # a parameter takes int4 blocks when its layer can hold them and all its tensors are int4
    types: dict[str, set[str]] = {}
    for t, _, pname, _ in entries:
        types.setdefault(pname, set()).add(GGMLQuantizationType(t.ggml_type).name)  # (known: checked)
    int4 = {p for p, ts in types.items() if ts <= INT4_TYPES.keys() and _int4_module(model, p) is not None}
    groups: dict[str, dict[Shard, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    loaded: set[tuple[str, Shard]] = set()
    counts: Counter[str] = Counter()
    for t, name, pname, shard in entries:
        try:
            dst = _destination(params[pname], shard)
        except IndexError as e:
            raise ValueError(f"tensor {t.name} in {path}: {e} of parameter {pname}") from None
        shape = tuple(reversed(t.dims))  # GGUF's ne reversed: [out, in]
        if shape != tuple(dst.shape):
            raise ValueError(f"tensor {t.name} in {path}: shape {shape}, parameter {pname} expects "
                             f"{tuple(dst.shape)}")
        gtype = GGMLQuantizationType(t.ggml_type)
        rows = int(np.prod(shape[:-1]))
        raw = file[t.offset:t.offset + tensor_bytes(t, path)].reshape(rows, -1)  # (inside the file: checked)
        heads = rotary_heads(name, n_heads, n_kv)
        qtype = gtype.name
        if pname in int4:
            q, s, z = int4_groups(torch.from_numpy(np.array(raw)), qtype)
            if heads is not None:
                order = rotary_row_order(shape[0], heads)
                q, s, z = q[order], s[order], z[order]
            groups.setdefault(pname, {})[shard] = (q, s, z)
            counts[f"int4 {qtype}"] += 1
        else:
            try:
                w = dequantize(raw, gtype).astype(np.float32, copy=False).reshape(shape)
            except NotImplementedError as e:
                raise ValueError(f"tensor {t.name} in {path}: {e}") from None
            if heads is not None:
                w = unpermute_rotary(w, heads)
            dst.copy_(torch.from_numpy(np.array(w, dtype=np.float32)))  # (a copy: the reader maps the file read-only)
            counts[f"{'int8' if _int4_module(model, pname) is not None else 'dense'} {qtype}"] += 1
        loaded.add((pname, shard))
    missing = [n if s is None else f"{n}[shard {s}]" for n, p in params.items()
               for s in _shards(p) if (n, s) not in loaded]
    if missing:
        more = [f"... {len(missing) - 20} more"] if len(missing) > 20 else []
        raise ValueError(f"parameters not loaded from {path!r}: {missing[:20] + more}")
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    for pname, by_shard in groups.items():
        parts = [by_shard[s] for s in _shards(params[pname])]
        q, s, z = (torch.cat([p[i] for p in parts]) for i in range(3))
        module = _int4_module(model, pname)
        assert module is not None  # (in `int4`)
        set_quantized_weight(module, pname.rpartition(".")[2], pack_int4(q, s, z))
    process_weights_after_loading(model)
    return GGUFLoad(path, weight_bytes, dict(sorted(counts.items())))
