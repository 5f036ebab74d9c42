"""GGUF 4-bit blocks as the CPU int4 kernel's groups (kernels/gguf_quant.py), the GGUF header
reader (shared/gguf_source.py) and the rotary row order (services/worker/gguf_names.py).

Truths: the int4 kernel itself (its scale/zero convention, by a round trip through it), the
`gguf` package's dequantizers and reader, llama.cpp's rotary permutation as its converter
writes it (tests/gguf_tiny.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from kernels import cpu_quant_linear as cq
from kernels.gguf_quant import INT4_TYPES, int4_groups
from services.worker.gguf_names import rotary_row_order, unpermute_rotary
from shared.gguf_source import (check_tensor_data, gguf_architecture, read_header, require_gguf,
                                tensor_bytes, write_pointer)
from tests.gguf_tiny import permute_rotary, quantized, write_tiny_llama_gguf

BF16_REL = 2.0 ** -8  # bf16: 8 significant bits, round to nearest (unit roundoff 2^-8)


def _weights(n: int, k: int, seed: int) -> np.ndarray:
    """Random [n, k] fp32 with outliers, and one row shifted positive (Q4_K's mins clamp at 0)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w.reshape(-1)[rng.integers(0, n * k, max(1, n * k // 97))] *= 12.0
    w[-1] = np.abs(w[-1]) + 0.01
    return w


def test_int4_kernel_reads_q_minus_8_times_scale_plus_zero():
    """ATen's CPU int4 convention, from the kernel itself: identity rows read back
    bf16((q - 8) * scale + zero) for random codes, scales and zeros (not q * scale + zero,
    nor (q - 8) * scale - zero)."""
    g = torch.Generator().manual_seed(0)
    n, k, group = 32, 128, 32
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = torch.randn(n, k // group, generator=g).to(torch.bfloat16)
    zero = torch.randn(n, k // group, generator=g).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    sz = torch.stack([scale, zero], 2).transpose(0, 1).contiguous()
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=torch.bfloat16), packed, group, sz).t()
    qg = q.float().reshape(n, k // group, group)
    want = ((qg - 8) * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)
    assert torch.equal(got.float(), want.to(torch.bfloat16).float())
    other = (qg * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)
    assert (got.float() - other).abs().max() > 1.0


def _raw(w: np.ndarray, qtype: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(quantized(w, qtype)))


@pytest.mark.parametrize("qtype", sorted(INT4_TYPES))
@pytest.mark.parametrize("shape", [(1, 256), (7, 512), (33, 768)])
def test_int4_groups_are_the_gguf_dequantized_weights(qtype, shape):
    w = _weights(*shape, seed=shape[0])
    raw = _raw(w, qtype)
    truth = dequantize(raw.numpy(), GGMLQuantizationType[qtype])
    q, scale, zero = int4_groups(raw, qtype)
    n, k = shape
    assert q.shape == (n, k) and scale.shape == zero.shape == (n, k // 32)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    mine = ((q.float().reshape(n, -1, 32) - 8) * scale[..., None] + zero[..., None]).reshape(n, k)
    # fp32 rounding of the re-expressed zero (m + 8 d; 8 d sc - dmin m) only
    assert np.abs(mine.numpy() - truth).max() <= 1e-6 * np.abs(truth).max()
    if qtype == "Q4_0":
        assert torch.all(zero == 0)


@pytest.mark.parametrize("qtype", sorted(INT4_TYPES))
def test_the_packed_weight_is_the_gguf_weight_within_bf16_scales(qtype, monkeypatch):
    """pack_int4 of the groups: the kernel's weight (QuantWeight.dequantize, the codes read
    through the kernel) is the GGUF's within the bf16 rounding of each group's scale and
    zero, (|8 scale| + |zero|) 2^-8, and its product is x @ that weight (tinygemm's:
    INT4_VNNI off; the VNNI copy of GGUF groups: tests/unit/test_cpu_int4_vnni.py)."""
    monkeypatch.setattr(cq, "INT4_VNNI", False)
    n, k = 40, 512  # 40 rows: padded to 48 for the kernel
    w = _weights(n, k, seed=3)
    raw = _raw(w, qtype)
    truth = torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType[qtype]))
    q, scale, zero = int4_groups(raw, qtype)
    qw = cq.pack_int4(q, scale, zero)
    assert (qw.out_features, qw.in_features, qw.group_size) == (n, k, 32)
    deq = qw.dequantize()
    bound = ((8 * scale.abs() + zero.abs()) * BF16_REL).repeat_interleave(32, dim=1) + 1e-7
    err = (deq - truth).abs()
    assert torch.all(err <= bound), float((err - bound).max())
    assert err.max() > 0  # (bf16 scales: not exact for these random weights)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    ref = cq.quant_linear_ref(x.to(cq.ACT_DTYPE).float(), deq)
    y = qw.matmul(x)
    assert torch.all((y - ref).abs() <= 2.0 ** -7 * ref.abs().amax(1, keepdim=True) + 1e-4)


def test_int4_groups_refuse_other_types_and_partial_blocks():
    with pytest.raises(ValueError, match="Q8_0"):
        int4_groups(torch.zeros(2, 34, dtype=torch.uint8), "Q8_0")
    with pytest.raises(ValueError, match="not whole blocks of 20 bytes"):
        int4_groups(torch.zeros(2, 30, dtype=torch.uint8), "Q4_1")
    with pytest.raises(ValueError, match="group size"):
        cq.pack_int4(torch.zeros(4, 48, dtype=torch.int32), torch.ones(4, 3), torch.zeros(4, 3))


def test_rotary_row_order_undoes_llama_cpp_permutation():
    for rows, heads in ((64, 1), (576, 9), (192, 3)):
        w = np.random.default_rng(rows).standard_normal((rows, 5)).astype(np.float32)
        stored = permute_rotary(w, heads)  # what llama.cpp's converter writes
        assert np.array_equal(unpermute_rotary(stored, heads), w)
        order = rotary_row_order(rows, heads)
        assert np.array_equal(stored[order.numpy()], w)
    with pytest.raises(ValueError, match="multiple of 2 x 4"):
        rotary_row_order(36, 4)


def test_header_reader_gives_the_gguf_packages_tensor_table(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    types = write_tiny_llama_gguf(path, tied=False)
    head = read_header(path)
    ref = GGUFReader(path)
    assert [t.name for t in head.tensors] == [t.name for t in ref.tensors] == list(types)
    for mine, theirs in zip(head.tensors, ref.tensors):
        assert mine.ggml_type == int(theirs.tensor_type)
        assert list(mine.dims) == [int(d) for d in theirs.shape]
        assert mine.offset == theirs.data_offset
    assert head.metadata["llama.attention.head_count"] == 4 and head.metadata["tokenizer.ggml.tokens"] is None
    assert gguf_architecture(path) == "llama"
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_header(str(bad))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(path, "rb").read()[:200])
    with pytest.raises(ValueError, match="cut short"):
        read_header(str(cut))


def test_tensor_extents_are_the_gguf_packages_and_a_file_cut_in_its_data_is_refused(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_tiny_llama_gguf(path, tied=False)
    head, ref = read_header(path), GGUFReader(path)
    assert [tensor_bytes(t, path) for t in head.tensors] == [int(t.n_bytes) for t in ref.tensors]
    size = len(open(path, "rb").read())
    check_tensor_data(head, path, size)  # the whole file: nothing to say
    need = max(int(t.data_offset) + int(t.n_bytes) for t in ref.tensors)
    with pytest.raises(ValueError, match=f"cut short: {size - 1000} bytes, and its tensor table needs {need}"):
        check_tensor_data(head, path, size - 1000)
    # as `kestrel serve` sees it: the header is whole (the config builder's check passes), the data is not
    folder = tmp_path / "model"
    folder.mkdir()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(path, "rb").read()[:size - 1000])
    write_pointer(str(folder), str(cut))
    assert require_gguf(str(folder)) == str(cut)
    with pytest.raises(ValueError, match="cut short"):
        require_gguf(str(folder), data=True)


def test_a_gguf_record_naming_a_folder_is_refused_as_a_folder(tmp_path):
    folder, kept = tmp_path / "model", tmp_path / ".gguf"
    folder.mkdir()
    kept.mkdir()
    write_pointer(str(folder), str(kept))
    with pytest.raises(ValueError, match="which is a folder, not a file"):
        require_gguf(str(folder))
