"""Weight formats: a checkpoint's FP8 or 4-bit `quantization_config` and whether FP8 / W4A16
weights run (no torch; docs/ARCHITECTURE.md §6.3, §8.3).

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
And the two 4-bit layouts (W4A16; tensors in kernels/w4a16_formats.py):
- AWQ (AutoAWQ; `quant_method` "awq"): `bits` 4, `group_size` G (-1: one group of all K),
  `zero_point` true, `version` "gemm" (the GEMV / Marlin / exllama layouts are refused);
- GPTQ (AutoGPTQ / GPTQModel; `quant_method` "gptq"): `bits` 4, `group_size`, `sym`,
  `desc_act` false (act-order needs g_idx reordering: refused), `checkpoint_format` (or
  GPTQModel's `format`) "gptq" (v1; "gptq_v2", Marlin and others refused).
A group size must be -1 or a positive multiple of 8 (the loader checks it divides K).
`modules_to_not_convert` layers are stored unquantized and load as plain weights.
Activations are always quantized dynamically per token; a checkpoint's static `input_scale`
is not used.

`check_fp8_setting` refuses `--quantization fp8` where it cannot run; `fp8_in_use` says
whether a worker runs FP8 weights (`--quantization fp8`, or an FP8 checkpoint with
`--quantization none` on a device that can; elsewhere an FP8 checkpoint is dequantized to the
model dtype at load). `check_w4a16_setting` refuses `--quantization awq / gptq` where it cannot
run, `w4a16_in_use` says whether a worker keeps 4-bit weights packed (CUDA, bf16 / fp16;
elsewhere a 4-bit checkpoint is dequantized at load).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: e4m3 conversions and torch._scaled_mm
FP8_DTYPE = "bfloat16"  # the activations' dtype of FP8 products (row-wise _scaled_mm writes bf16)
_SUPPORTED = ("Kestrel loads FP8 checkpoints (quant_method 'compressed-tensors' with 8-bit float weights, or "
              "'fp8') and 4-bit ones (quant_method 'awq' version gemm with zero points, 'gptq' v1 without "
              "desc_act); for another format use the bf16 checkpoint (--quantization fp8 on a GPU of compute "
              "capability 8.9+, int8 / int4 on the CPU)")


W4A16_METHODS = ("awq", "gptq")  # --quantization values and quant_methods of 4-bit checkpoints
W4A16_DTYPES = ("bfloat16", "float16")  # activations the W4A16 kernels take


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's FP8 or 4-bit weight format.

    method: "compressed-tensors" or "fp8". strategies: the weight scale layouts its groups
    name ("channel", "tensor", "block"), sorted. block: (rows, columns) of one block scale,
    None without block scales. activations: what its groups say of the activations
    ("dynamic", "static", "none" for weight-only), sorted (Kestrel quantizes them per token
    dynamically whatever they say). 4-bit formats (method "awq" / "gptq"): bits 4,
    group_size (-1: all of K), sym (GPTQ's symmetric flag; AWQ False), strategies
    ("group",), activations ("none",)."""

    method: str
    strategies: tuple[str, ...]
    block: tuple[int, int] | None
    activations: tuple[str, ...]
    bits: int = 8
    group_size: int | None = None
    sym: bool = False

    @property
    def is_w4(self) -> bool:
        """Whether this is a 4-bit AWQ / GPTQ checkpoint (not FP8)."""
        return self.method in W4A16_METHODS

    def describe(self) -> str:
        """One phrase for the startup report, e.g. "compressed-tensors fp8 (channel)",
        "awq 4-bit (group 128)"."""
        if self.is_w4:
            sym = ", symmetric" if self.sym else ""
            return f"{self.method} 4-bit (group {self.group_size}{sym})"
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
    if method in W4A16_METHODS:
        return _parse_w4(qc, method, where)
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


def _parse_w4(qc: Mapping, method: str, where: str) -> CheckpointQuant:
    """The `CheckpointQuant` of an AWQ / GPTQ quantization_config (module docstring)."""
    if qc.get("bits") != 4:
        raise ValueError(f"{where}: {method} with bits {qc.get('bits')!r} is not supported (4 only)")
    g = qc.get("group_size", 128)
    if not isinstance(g, int) or isinstance(g, bool) or not (g == -1 or (g > 0 and g % 8 == 0)):
        raise ValueError(f"{where}: {method} group_size {g!r} is not supported (-1 or a positive multiple of 8)")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}: awq version {qc.get('version')!r} is not supported; Kestrel reads "
                             "AutoAWQ's 'gemm' layout (qweight [K, N/8])")
        if qc.get("zero_point", True) is not True:
            raise ValueError(f"{where}: awq with zero_point false is not supported (zero points required)")
        return CheckpointQuant("awq", ("group",), None, ("none",), 4, g, False)
    if qc.get("desc_act"):
        raise ValueError(f"{where}: gptq with desc_act true (act-order) is not supported: Kestrel does not "
                         "reorder by g_idx; use a checkpoint quantized with desc_act false")
    form = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if form != "gptq" or qc.get("is_marlin_format"):
        raise ValueError(f"{where}: gptq checkpoint_format {form!r} is not supported (the v1 'gptq' format)")
    return CheckpointQuant("gptq", ("group",), None, ("none",), 4, g, bool(qc.get("sym", True)))


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
    return (quantization == "none" and checkpoint is not None and not checkpoint.is_w4 and device == "cuda"
            and dtype == FP8_DTYPE
            and capability is not None and tuple(capability) >= FP8_MIN_CAPABILITY)


def check_w4a16_setting(quantization: str, device: str, dtype: str, checkpoint: CheckpointQuant | None,
                        dummy: bool) -> None:
    """Refuse what cannot work with 4-bit weights: `quantization` "awq" / "gptq" off CUDA, with
    a dtype other than bf16 / fp16, or with real weights whose checkpoint is not of that
    method (dummy: --load-format dummy, random packed weights); "fp8" on a 4-bit checkpoint.
    Other combinations pass (an AWQ / GPTQ checkpoint with "none" runs packed on CUDA, is
    dequantized elsewhere; int8 / int4 on the CPU quantize the dequantized weights again).
    Raises ValueError naming the setting and what works."""
    w4 = checkpoint is not None and checkpoint.is_w4
    if quantization == "fp8" and w4:
        assert checkpoint is not None
        raise ValueError(f"setting quantization: 'fp8' on a {checkpoint.method} 4-bit checkpoint; use "
                         f"--quantization {checkpoint.method} or none (the 4-bit weights run as W4A16 on CUDA)")
    if quantization not in W4A16_METHODS:
        return
    if device != "cuda":
        raise ValueError(f"setting quantization: {quantization!r} (W4A16) runs on CUDA only (device {device!r}); "
                         "on the CPU use --quantization none (an AWQ / GPTQ checkpoint is then dequantized "
                         "at load) or int8 / int4 (the dequantized weights quantized again)")
    if dtype not in W4A16_DTYPES and dtype != "auto":
        raise ValueError(f"setting dtype: {dtype!r} with --quantization {quantization}: the W4A16 kernels take "
                         "bfloat16 or float16 activations; use --dtype bfloat16, float16 or auto")
    if dummy:
        return
    if checkpoint is None or checkpoint.method != quantization:
        have = f"a {checkpoint.method} checkpoint" if checkpoint is not None else "a checkpoint without quantization_config"
        raise ValueError(f"setting quantization: {quantization!r} needs a checkpoint quantized with "
                         f"{quantization} (quantization_config quant_method {quantization!r}), this is {have}; "
                         "Kestrel does not quantize to 4 bits at load: use such a checkpoint, --quantization "
                         "none, fp8, or --load-format dummy to time random packed weights")


def w4a16_in_use(quantization: str, checkpoint: CheckpointQuant | None, device: str, dtype: str,
                 dummy: bool) -> bool:
    """Whether a worker keeps 4-bit weights packed (after `check_w4a16_setting`): CUDA with
    dtype bf16 / fp16, and a 4-bit checkpoint with `quantization` "none" or its method, or
    dummy weights with "awq" / "gptq". Otherwise a 4-bit checkpoint is dequantized at load."""
    if device != "cuda" or dtype not in W4A16_DTYPES:
        return False
    if dummy:
        return quantization in W4A16_METHODS
    return checkpoint is not None and checkpoint.is_w4 and quantization in ("none", checkpoint.method)
