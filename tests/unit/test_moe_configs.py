"""The tuned launch configs of the fused MoE kernel: the JSON files benchmarks/moe_tune.py
writes are read into `kernels.moe_triton.TUNED_CONFIGS` and picked by token bucket."""

from __future__ import annotations

import json

import pytest

mt = pytest.importorskip("kernels.moe_triton")


def test_tuned_configs_load_by_bucket_and_a_malformed_file_is_named(tmp_path):
    cfg = {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    (tmp_path / "dev_E8_N64_K32_bf16.json").write_text(json.dumps(
        {"N": 64, "K": 32, "device": "dev", "configs": {"16": cfg}, "timings_us": {}}))
    (tmp_path / "README.md").write_text("not a config")
    loaded = mt.load_tuned_configs(str(tmp_path))
    assert loaded == {(16, 64, 32): cfg}
    old = dict(mt.TUNED_CONFIGS)
    try:
        mt.TUNED_CONFIGS.update(loaded)
        assert mt.pick_config(9, 8, 2, 64, 32) == cfg  # 9 tokens -> bucket 16
        assert mt.pick_config(17, 8, 2, 64, 32) == mt.default_config(17, 8, 2)  # bucket 32: untuned
        assert mt.pick_config(9, 8, 2, 64, 32, dtype_bytes=4) == mt.default_config(9, 8, 2, 4)
    finally:
        mt.TUNED_CONFIGS.clear()
        mt.TUNED_CONFIGS.update(old)
    (tmp_path / "bad.json").write_text('{"N": 64}')
    with pytest.raises(ValueError, match="bad.json"):
        mt.load_tuned_configs(str(tmp_path))
    assert mt.load_tuned_configs(str(tmp_path / "missing")) == {}
