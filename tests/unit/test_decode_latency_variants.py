"""benchmarks/decode_latency.py's variants (`VARIANTS`, used by --ab and --variants) on the CPU:
each named variant sets the module switches its old definition set (the --ab tuples of
(kernels.moe.DECODE_FUSED, the decode kernels' fused_merge, the rotary decode kernel's
programs_per_sm) and the --variants dicts over the defaults), leaves every other switch at the
run's baseline, and the switches are back at the baseline after a run; --ab's and --variants'
JSON rows keep their fields; every variant the device scripts name exists. The GPU work
(graph capture, the timed steps) is stubbed: what is checked is which switches are set when
the graphs are captured."""

from __future__ import annotations

import argparse
import json
import pathlib
import re

import pytest

from benchmarks import decode_latency as dl
from kernels import attention_triton as at
from kernels import fp8_gemv, gdn_decode, linear, moe, moe_decode_triton, norm, rope_decode, w4a16_gemv
from services.worker import fusion
from services.worker.layers import gated_deltanet
from services.worker.models import qwen3_moe, qwen3_next, qwen3_next_blocks

ROOT = pathlib.Path(__file__).resolve().parents[2]
SKINNY = linear.SKINNY_MAX_WEIGHT
# what each variant changes, as the module state it must give (attribute, or (dict, key)):
# from the --ab tuples and the --variants dicts before the two shared VARIANTS
EXPECTED = {
    "old": {"DECODE_FUSED": False, "fused_merge": False},
    "new": {"DECODE_FUSED": True, "fused_merge": True},
    "moe": {"DECODE_FUSED": True, "fused_merge": False},
    "merge": {"DECODE_FUSED": False, "fused_merge": True},
    "pps1": {"DECODE_FUSED": True, "fused_merge": False, "programs_per_sm": 1},
    "pps2": {"DECODE_FUSED": True, "fused_merge": False, "programs_per_sm": 2},
    "in_place": {},
    "gathered": {"IN_PLACE_DECODE": False, "GATED_TRITON": False, "GEMV_MAX_WEIGHT": SKINNY},
    "in_place_cublas": {"GEMV_MAX_WEIGHT": SKINNY},
    "in_place_bv32": {"rec_table": False, "block_v": 32, "rec_warps": 4},
    "glue_off": {"FUSED_GLUE": False},
    "glue_on": {"FUSED_GLUE": True},
    "moe_fused_glue_on_apart": {"DECODE_FUSED": True, "FUSED_GLUE": True, "SHARED_IN_DOWN": False},
    "moe_tuned": {"USE_TUNED": True},
    "moe_untuned": {"USE_TUNED": False},
    "q_old": {"ONE_ROW": "legacy", "FUSE_QUANTIZED_ONE_ROW": False, "FP8_PLANS": False, "W4_PLANS": False,
              "sum_chunk": 8},
    "q_new": {"ONE_ROW": "gemv", "FUSE_QUANTIZED_ONE_ROW": True, "FP8_PLANS": True, "W4_PLANS": True,
              "sum_chunk": 16},
    "q_unfused": {"ONE_ROW": "gemv", "FUSE_QUANTIZED_ONE_ROW": False, "FP8_PLANS": True, "W4_PLANS": True,
                  "sum_chunk": 16},
    "layers_fused": {"FUSE_ONE_ROW": True, "FUSE_MOE_LAYERS": True, "GATE_UP": "grouped"},
    "layers_unfused": {"FUSE_ONE_ROW": False, "FUSE_MOE_LAYERS": False, "GATE_UP": "grouped"},
    "moe_gate_up_grouped": {"GATE_UP": "grouped"},
    "moe_gate_up_gemv": {"GATE_UP": "gemv"},
    "layers_fused_gemv": {"FUSE_ONE_ROW": True, "FUSE_MOE_LAYERS": True, "GATE_UP": "gemv"},
    "hybrid_fused": {"FUSE_ONE_ROW": True, "FUSE_LAYERS": True, "FUSED_GLUE": True},
    "hybrid_unfused": {"FUSE_ONE_ROW": True, "FUSE_LAYERS": False, "FUSED_GLUE": True},
}


def state() -> dict:
    """The switches as the modules hold them (read directly, not through decode_latency)."""
    s = {"IN_PLACE_DECODE": gated_deltanet.IN_PLACE_DECODE, "GATED_TRITON": norm.GATED_TRITON,
         "GEMV_MAX_WEIGHT": linear.GEMV_MAX_WEIGHT, "FUSED_GLUE": qwen3_next_blocks.FUSED_GLUE,
         "DECODE_FUSED": moe.DECODE_FUSED, "SHARED_IN_DOWN": moe.SHARED_IN_DOWN,
         "USE_TUNED": moe_decode_triton.USE_TUNED, "ONE_ROW": fp8_gemv.ONE_ROW,
         "FUSE_QUANTIZED_ONE_ROW": fusion.FUSE_QUANTIZED_ONE_ROW, "FP8_PLANS": fp8_gemv.USE_PLANS,
         "W4_PLANS": w4a16_gemv.USE_PLANS, "w4": dict(w4a16_gemv.GEMV1_DEFAULTS),
         "FUSE_ONE_ROW": fusion.FUSE_ONE_ROW, "GATE_UP": moe_decode_triton.GATE_UP,
         "FUSE_MOE_LAYERS": qwen3_moe.FUSE_MOE_LAYERS, "FUSE_LAYERS": qwen3_next.FUSE_LAYERS,
         "rope": dict(rope_decode.ROPE_DECODE_DEFAULTS), "attn": dict(at.DECODE_DEFAULTS),
         "tuning": dict(gdn_decode.TUNING)}
    return s


def with_changes(base: dict, changes: dict) -> dict:
    """`base` (a `state()`) with a variant's EXPECTED changes applied."""
    s = {**base, "rope": dict(base["rope"]), "attn": dict(base["attn"]), "tuning": dict(base["tuning"]),
         "w4": dict(base["w4"])}
    for k, v in changes.items():
        if k == "fused_merge":
            s["rope"][k] = s["attn"][k] = v
        elif k == "programs_per_sm":
            s["rope"][k] = v
        elif k in s["tuning"]:
            s["tuning"][k] = v
        elif k in s["w4"]:
            s["w4"][k] = v
        else:
            s[k] = v
    return s


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    """Every switch back at its value after the test (the dicts as copies of their own)."""
    for mod, name in ((gated_deltanet, "IN_PLACE_DECODE"), (norm, "GATED_TRITON"), (linear, "GEMV_MAX_WEIGHT"),
                      (qwen3_next_blocks, "FUSED_GLUE"), (moe, "DECODE_FUSED"), (moe, "SHARED_IN_DOWN"),
                      (moe_decode_triton, "USE_TUNED"), (fp8_gemv, "ONE_ROW"), (fusion, "FUSE_QUANTIZED_ONE_ROW"),
                      (fp8_gemv, "USE_PLANS"), (w4a16_gemv, "USE_PLANS"), (fusion, "FUSE_ONE_ROW"),
                      (moe_decode_triton, "GATE_UP"), (qwen3_moe, "FUSE_MOE_LAYERS"), (qwen3_next, "FUSE_LAYERS")):
        monkeypatch.setattr(mod, name, getattr(mod, name))
    monkeypatch.setattr(rope_decode, "ROPE_DECODE_DEFAULTS", dict(rope_decode.ROPE_DECODE_DEFAULTS))
    monkeypatch.setattr(at, "DECODE_DEFAULTS", dict(at.DECODE_DEFAULTS))
    monkeypatch.setattr(gdn_decode, "TUNING", dict(gdn_decode.TUNING))
    monkeypatch.setattr(w4a16_gemv, "GEMV1_DEFAULTS", dict(w4a16_gemv.GEMV1_DEFAULTS))


def test_the_variants_are_those_the_two_flags_accepted_less_the_two_duplicates():
    assert set(dl.VARIANTS) == set(EXPECTED)
    assert set(dl.KNOB_NAMES) == set(dl.read_knobs())


@pytest.mark.parametrize("cli", ["defaults", "moe_launches_torch", "attn_pps1_merge"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_variant_sets_its_switches_over_the_baseline_and_the_baseline_comes_back(name, cli):
    if cli == "moe_launches_torch":  # what --moe-launches torch sets before the baseline is read
        moe.DECODE_FUSED = False
    elif cli == "attn_pps1_merge":  # --attn '{"programs_per_sm": 1, "fused_merge": true}' (rope decode on)
        rope_decode.ROPE_DECODE_DEFAULTS.update(programs_per_sm=1, fused_merge=True)
        at.DECODE_DEFAULTS["fused_merge"] = True
    before = state()
    baseline = dl.read_knobs()
    dl.set_knobs(dl.variant_knobs(name, baseline))
    assert state() == with_changes(before, EXPECTED[name])
    dl.set_knobs(baseline)
    assert state() == before


class StubRunner:
    """What run_variants / run_ab use of a ModelRunner; records the switches at each capture."""

    graphs = object()
    state_cache = object()  # a hybrid's: no logits check

    def __init__(self) -> None:
        self.captured: list[dict] = []

    def recapture_graphs(self) -> float:
        self.captured.append(state())
        return 0.25


@pytest.fixture
def stub_gpu(monkeypatch):
    monkeypatch.setattr(dl.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(dl, "decode_steps", lambda runner, prompt, table, steps, replay: ([2e-3] * steps,
                                                                                          [1e-3] * steps))


def test_variants_rows_keep_their_fields_and_capture_each_variants_switches(stub_gpu):
    before, runner = state(), StubRunner()
    rows = dl.run_variants(runner, ["gathered", "glue_on", "gathered"], dl.read_knobs(), [1], [0], [1], 4, 1e-3)
    assert runner.captured == [with_changes(before, EXPECTED[n]) for n in ("gathered", "glue_on", "gathered")]
    assert state() == before
    old_fields = {"variant", "in_place_decode", "gated_norm_triton", "gemv_max_weight", "rec_table", "block_v",
                  "rec_warps", "rec_order", "fused_glue", "moe_decode_fused", "shared_in_down", "capture_seconds",
                  "tpot_ms", "gpu_forward_ms", "fraction_of_roofline", "gpu_fraction_of_roofline"}
    assert all(old_fields <= set(r) for r in rows)
    assert [r["variant"] for r in rows] == ["gathered", "glue_on", "gathered"]
    assert (rows[0]["in_place_decode"], rows[1]["fused_glue"], rows[0]["capture_seconds"]) == (False, True, 0.25)
    assert (rows[1]["tpot_ms"], rows[1]["fraction_of_roofline"], rows[1]["gpu_fraction_of_roofline"]) == (2.0, 0.5, 1.0)


def test_ab_rounds_keep_their_fields_and_capture_each_variants_switches(stub_gpu, tmp_path):
    before, runner = state(), StubRunner()
    a = argparse.Namespace(ab=["old", "pps1"], ab_rounds=2, steps=4, out=str(tmp_path / "ab.json"))
    res: dict = {}
    dl.run_ab(runner, a, res, dl.read_knobs(), [1], [0], [1], 1e-3)
    assert runner.captured == [with_changes(before, EXPECTED[n]) for n in ("old", "pps1", "old", "pps1")]
    assert state() == before
    assert res["ab_variants"] == {"old": {"moe_decode_fused": False, "fused_merge": False, "programs_per_sm": None},
                                  "pps1": {"moe_decode_fused": True, "fused_merge": False, "programs_per_sm": 1}}
    assert [(r["round"], r["variant"]) for r in res["ab"]] == [(0, "old"), (0, "pps1"), (1, "old"), (1, "pps1")]
    assert all(set(r) == {"round", "variant", "capture_s", "tpot_ms", "gpu_forward_ms", "fraction_of_roofline",
                          "gpu_fraction_of_roofline", "fused_one_row"} for r in res["ab"])
    assert all(r["fused_one_row"] is None for r in res["ab"])  # the stub has no fusion plan
    assert res["ab_median"]["pps1"] == {"tpot_ms": 2.0, "gpu_forward_ms": 1.0, "fraction_of_roofline": 0.5}
    assert json.loads((tmp_path / "ab.json").read_text()) == res


def test_the_switches_come_back_when_a_variant_fails(stub_gpu):
    class Failing(StubRunner):
        def recapture_graphs(self) -> float:
            raise RuntimeError("capture failed")

    before = state()
    with pytest.raises(RuntimeError, match="capture failed"):
        dl.run_variants(Failing(), ["gathered"], dl.read_knobs(), [1], [0], [1], 4, 1e-3)
    assert state() == before


def test_every_variant_the_device_scripts_name_exists():
    named = set()
    for sh in sorted((ROOT / "scripts").glob("*.sh")):
        text = sh.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            if "decode_latency.py" in line and not line.lstrip().startswith("#"):
                for m in re.finditer(r"--(?:ab|variants)((?:\s+[a-z][a-z0-9_]*)+)", line):
                    named.update(m.group(1).split())
    assert named, "no --ab / --variants run found in scripts/"
    assert named <= set(dl.VARIANTS), named - set(dl.VARIANTS)
