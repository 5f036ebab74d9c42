"""Weight formats: a checkpoint's FP8 `quantization_config` and whether FP8 weights run (no
torch; docs/ARCHITECTURE.md §6.3, §8.3).

`parse_quantization_config` reads config.json's `quantization_config` (through
`ModelSpec.checkpoint_quant`) into a `CheckpointQuant`, for the two FP8 layouts Kestrel loads:
- compressed-tensors (llm-compressor; `quant_method` "compressed-tensors"): every
  `config_groups` entry has 8-bit float `weights` (symmetric; `strategy` "channel": tensor
  `<module>.weight_scale` [N, 1]; "tensor": one element; "block": [ceil(N/bn), ceil(K/bk)]
  with `block_structure` [bn, bk]) and optional 8-bit float `input_activations` (dynamic, or
  static with `<module>.input_scale`). Layers listed in `ignore` are stored unquantized.
- Hugging Face fine-grained FP8 (`quant_method` "fp8", DeepSeek-V3's layout): `fmt` "e4m3",
  `weight_block_size` [bn, bk] with tensors `<module>.weight_scale_inv` [ceil(N/bn), ceil(K/bk)]
  (a multiplier, despite the name: W = q * scale_inv of its block), `activation_scheme`
  "dynamic"; without `weight_block_size` the older per-tensor layout (`weight_scale`, and
  `input_scale` when static). `modules_to_not_convert` are stored unquantized.
The loader finds the quantized tensors by their scale tensors, not from these lists.
Activations are always quantized dynamically per token; a checkpoint's static `input_scale`
is not used.

`check_fp8_setting` refuses `--quantization fp8` where it cannot run; `fp8_in_use` says
whether a worker runs FP8 weights (`--quantization fp8`, or an FP8 checkpoint with
`--quantization none` on a device that can; elsewhere an FP8 checkpoint is dequantized to the
model dtype at load).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: e4m3 conversions and torch._scaled_mm
FP8_DTYPE = "bfloat16"  # the activations' dtype of FP8 products (row-wise _scaled_mm writes bf16)
_SUPPORTED = ("Kestrel loads FP8 checkpoints: quant_method 'compressed-tensors' with 8-bit float weights, or "
              "'fp8'; for another format use the bf16 checkpoint (--quantization fp8 on a GPU of compute "
              "capability 8.9+, int8 / int4 on the CPU)")


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's FP8 weight format.

    method: "compressed-tensors" or "fp8". strategies: the weight scale layouts its groups
    name ("channel", "tensor", "block"), sorted. block: (rows, columns) of one block scale,
    None without block scales. activations: what its groups say of the activations
    ("dynamic", "static", "none" for weight-only), sorted (Kestrel quantizes them per token
    dynamically whatever they say)."""

    method: str
    strategies: tuple[str, ...]
    block: tuple[int, int] | None
    activations: tuple[str, ...]

    def describe(self) -> str:
        """One phrase for the startup report, e.g. "compressed-tensors fp8 (channel)"."""
        blk = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"{self.method} fp8 ({'/'.join(self.strategies)}{blk})"


def _block(v: Any, where: str) -> tuple[int, int]:
    if (not isinstance(v, (list, tuple)) or len(v) != 2
            or not all(isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in v)):
        raise ValueError(f"{where}: a block size must be two positive integers, got {v!r}")
    return int(v[0]), int(v[1])


def _float8(args: Any, what: str, where: str) -> None:
    if not isinstance(args, Mapping) or args.get("type") != "float" or args.get("num_bits") != 8:
        got = {k: args.get(k) for k in ("type", "num_bits")} if isinstance(args, Mapping) else args
        raise ValueError(f"{where}: {what} of {got!r} are not supported; {_SUPPORTED}")


def parse_quantization_config(qc: Any, where: str = "quantization_config") -> CheckpointQuant | None:
    """The `CheckpointQuant` of a config.json `quantization_config` (module docstring); None
    when there is none. where: names the file in messages. Raises ValueError naming it for a
    method, number format, strategy or asymmetric scheme Kestrel cannot load."""
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError(f"{where}: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"{where}: quant_method 'fp8' with fmt {qc.get('fmt')!r} is not supported (e4m3 only)")
        raw = qc.get("weight_block_size")
        block = _block(raw, where) if raw is not None else None
        act = str(qc.get("activation_scheme") or "dynamic")
        return CheckpointQuant("fp8", ("block",) if block else ("tensor",), block, (act,))
    if method != "compressed-tensors":
        raise ValueError(f"{where}: quantization_config quant_method {method!r} is not supported; {_SUPPORTED}")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{where}: a compressed-tensors quantization_config needs config_groups")
    strategies: set[str] = set()
    blocks: set[tuple[int, int]] = set()
    acts: set[str] = set()
    for name, g in groups.items():
        gw = f"{where}: config_groups.{name}"
        if not isinstance(g, Mapping):
            raise ValueError(f"{gw} must be an object")
        fmt = g.get("format") or qc.get("format")
        if fmt not in (None, "float-quantized", "naive-quantized"):
            raise ValueError(f"{gw}: format {fmt!r} is not supported; {_SUPPORTED}")
        w = g.get("weights")
        _float8(w, "weights", gw)
        assert isinstance(w, Mapping)  # _float8 checked it
        if w.get("symmetric") is False:
            raise ValueError(f"{gw}: asymmetric fp8 weights (zero points) are not supported")
        strategy = w.get("strategy")
        if strategy not in ("channel", "tensor", "block"):
            raise ValueError(f"{gw}: weight strategy {strategy!r} is not supported (channel, tensor, block)")
        if strategy == "block":
            blocks.add(_block(w.get("block_structure"), gw + ".weights.block_structure"))
        strategies.add(strategy)
        ia = g.get("input_activations")
        if ia:
            _float8(ia, "input_activations", gw)
            acts.add("dynamic" if ia.get("dynamic") else "static")
        else:
            acts.add("none")
    if len(blocks) > 1:
        raise ValueError(f"{where}: groups with different block structures {sorted(blocks)} are not supported")
    return CheckpointQuant("compressed-tensors", tuple(sorted(strategies)), next(iter(blocks), None),
                           tuple(sorted(acts)))


def parse_capability(text: str) -> tuple[int, int] | None:
    """A compute capability "9.0" (nvidia-smi's compute_cap) as (9, 0); None when empty or
    unreadable."""
    try:
        major, minor = text.strip().split(".")
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return None


def check_fp8_setting(quantization: str, device: str, dtype: str,
                      capability: tuple[int, int] | None) -> None:
    """Refuse `quantization` "fp8" where it cannot run: a device other than CUDA, a GPU of
    compute capability below FP8_MIN_CAPABILITY (None: not known yet, the worker checks
    again), a dtype other than bfloat16. Other values pass. Raises ValueError naming the
    setting and what works instead."""
    if quantization != "fp8":
        return
    if device != "cuda":
        raise ValueError(f"setting quantization: 'fp8' weights (W8A8) run on CUDA GPUs of compute capability "
                         f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+ only (device {device!r}); on the CPU "
                         "use --quantization int8 or int4 (weight-only), or --quantization none (an FP8 "
                         "checkpoint is then dequantized at load)")
    if capability is not None and tuple(capability) < FP8_MIN_CAPABILITY:
        cap = f"{capability[0]}.{capability[1]}"
        raise ValueError(f"setting quantization: 'fp8' needs a GPU of compute capability "
                         f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+ (Ada, Hopper); this GPU has {cap}; "
                         "use --quantization none (bf16 weights; an FP8 checkpoint is then dequantized at load)")
    if dtype != FP8_DTYPE:
        raise ValueError(f"setting dtype: {dtype!r} with --quantization fp8: FP8 products write bfloat16 "
                         "(torch._scaled_mm's row-wise scaling); use --dtype bfloat16 (or auto)")


def fp8_in_use(quantization: str, checkpoint: CheckpointQuant | None, device: str, dtype: str,
               capability: tuple[int, int] | None) -> bool:
    """Whether a worker runs FP8 weights: `quantization` "fp8" (after `check_fp8_setting`),
    or "none" with an FP8 checkpoint on a CUDA GPU of FP8_MIN_CAPABILITY+ and dtype bfloat16
    (a known capability). Otherwise an FP8 checkpoint is dequantized to the model dtype."""
    if quantization == "fp8":
        return True
    return (quantization == "none" and checkpoint is not None and device == "cuda" and dtype == FP8_DTYPE
            and capability is not None and tuple(capability) >= FP8_MIN_CAPABILITY)
