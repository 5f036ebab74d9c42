"""A hybrid model's kvstore (services/kvstore; docs/ARCHITECTURE.md §4.5, §4.7): a real
`kestrel kvstore` subprocess on a Qwen3-Next config.json keeps the recurrent-state
checkpoints beside the KV blocks: a second shm pool of state slots sized from the
config (`shared.state_layout`), a second disk folder under the state identity, a hello
that must name the same state layout. The truths: the bytes written into a slot, the sizes
the config implies, the files on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from services.kvstore.disk_tier import HEADER
from shared.config import build_config
from shared.kv_layout import KVLayout
from shared.kvstore_client import KVStoreRefused
from shared.model_spec import load_model_spec
from shared.state_layout import StateLayout
from tests.kvstore_helpers import BLOCK, GIB, REPO, Store, chain, load_blocks, payload, store_blocks, wait_for

# 2 gated DeltaNet layers: conv [2*2*16 + 4*16, 3] + state [4, 16, 16], fp32: 11264 bytes a request
HYBRID = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 64,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 4,
          "vocab_size": 100, "layer_types": ["linear_attention", "full_attention"] * 2,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
STATE_BYTES = 2 * ((2 * 2 * 16 + 4 * 16) * 3 * 4 + 4 * 16 * 16 * 4)
STATE_FILE = HEADER.size + STATE_BYTES


@pytest.fixture
def hybrid_dir():
    d = tempfile.mkdtemp(prefix="kvh-model-")
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(HYBRID, fh)
    yield d
    subprocess.run(["rm", "-rf", d])


@pytest.fixture
def disk_dir():
    d = tempfile.mkdtemp(prefix="kvh-disk-")
    yield d
    subprocess.run(["rm", "-rf", d])


@pytest.fixture
def stores():
    made: list[Store] = []

    def make(*a, **kw) -> Store:
        s = Store(*a, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def state_of(model: str) -> tuple[bytes, int]:
    """(state identity, state bytes) as the engine derives them for --dtype float32, blocks of 16."""
    spec = load_model_spec(model)
    layout = StateLayout.for_model(spec, KVLayout.for_model(spec, 16))
    assert layout is not None
    return layout.state_identity, layout.state_bytes


def state_payload(h: bytes) -> bytes:
    return (h[::-1] * (STATE_BYTES // len(h) + 1))[:STATE_BYTES]


def pool_args(kv_slots: int, state_slots: float) -> tuple:
    """--kv-offload-cpu-gib for a pool of kv_slots blocks and state_slots checkpoints at the
    default fraction 0.5 (each part gets half)."""
    part = max(kv_slots * BLOCK, state_slots * STATE_BYTES)
    return ("--kv-offload-cpu-gib", repr(2 * part / GIB))


def store_states(c, names: list[bytes]) -> list[int]:
    pool = c.attach_state_pool()
    prep = c.prepare_store([], names)
    assert prep.slots == []
    for h, s in zip(names, prep.state_slots):
        if s >= 0:
            pool.slot(s)[:] = state_payload(h)
    got = [s for s in prep.state_slots if s >= 0]
    if got:
        assert c.complete_store([], True, got) == len(got)
    return prep.state_slots


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_the_state_layout_is_what_the_models_recurrent_layers_keep(hybrid_dir, layout):
    """StateLayout (from config.json, for the store) against the layer's own state shapes
    (services/worker/layers/gated_deltanet.py, what the worker allocates and copies)."""
    from services.worker.layers.gated_deltanet import GatedDeltaNet
    from services.worker.state_cache import StateSpec

    spec = load_model_spec(hybrid_dir)
    state = StateLayout.for_model(spec, KVLayout.for_model(spec, 16))
    gdn = GatedDeltaNet.from_hf_config(HYBRID, layout)
    shapes = gdn.state_shapes()
    one = StateSpec(tuple(x.shape for x in shapes), tuple(x.dtype for x in shapes))
    assert state is not None and len(state.layers) == 2
    assert [(t.shape, t.dtype) for t in state.layers[0]] == [(x.shape, str(x.dtype).removeprefix("torch."))
                                                          for x in shapes]
    assert state.state_bytes == 2 * one.slot_bytes == STATE_BYTES
    dense = load_model_spec(hybrid_dir)
    object.__setattr__(dense, "layer_types", ())
    assert StateLayout.for_model(dense, KVLayout.for_model(dense, 16)) is None


def test_checkpoints_live_in_a_second_pool_named_by_their_block_and_load_back_identical(stores, hybrid_dir):
    assert state_of(hybrid_dir)[1] == STATE_BYTES
    s = stores(0, model=hybrid_dir, extra=pool_args(8, 4.5))
    c = s.client(state=state_of(hybrid_dir))
    assert c.info.state_n_slots == 4 and c.info.state_slot_bytes == STATE_BYTES and c.info.n_slots == 12
    hs = chain(s.model, 4)
    assert all(x >= 0 for x in store_blocks(c, hs))
    assert all(x >= 0 for x in store_states(c, [hs[1], hs[3]]))
    # blocks and checkpoints are separate names: a block is no checkpoint, and each checkpoint
    # is looked up on its own (not as a run)
    assert c.lookup(hs) == ["cpu"] * 4
    assert c.lookup_states(hs) == ["", "cpu", "", "cpu"]
    assert store_states(c, [hs[3]]) == [-1]  # stored already
    slots, state_slots = c.reserve(hs[:2], [hs[1]])
    assert len(slots) == 2 and len(state_slots) == 1
    assert bytes(c.attach_state_pool().slot(state_slots[0])) == state_payload(hs[1])
    assert [bytes(c.attach_pool().slot(x)) for x in slots] == [payload(h) for h in hs[:2]]
    assert c.complete_load(slots, state_slots) == 3
    st = c.stats()
    assert st["state_cpu_blocks"] == 2 and st["cpu_blocks"] == 4
    ls = subprocess.run([sys.executable, "-m", "services.cli", "shm", "ls", "--instance", s.instance],
                        cwd=REPO, capture_output=True, text=True, timeout=30).stdout
    assert f"kestrel-{s.instance}-statepool" in ls and f"kestrel-{s.instance}-kvpool" in ls
    assert s.stop() == 0
    assert not os.path.exists(f"/dev/shm/kestrel-{s.instance}-statepool")


def test_a_hello_without_the_same_state_layout_is_refused(stores, hybrid_dir):
    s = stores(0, model=hybrid_dir, extra=pool_args(4, 2))
    with pytest.raises(KVStoreRefused, match="recurrent-state layout differs"):
        s.client()  # a dense model's engine (no state checkpoints)
    ident, n = state_of(hybrid_dir)
    with pytest.raises(KVStoreRefused, match="recurrent-state layout differs"):
        s.client(state=(bytes(32), n))  # another layout of the same size
    with pytest.raises(KVStoreRefused, match="recurrent-state layout differs"):
        s.client(state=(ident, n + 4))
    s.client(state=(ident, n))


def test_checkpoints_demote_to_their_own_disk_folder_promote_with_blocks_and_survive_a_restart(
        stores, hybrid_dir, disk_dir):
    disk = ("--kv-offload-disk-dir", disk_dir, "--kv-offload-disk-gib", repr(2 * 10 * STATE_FILE / GIB))
    s = stores(0, model=hybrid_dir, extra=pool_args(4, 1.5) + disk)
    state = state_of(hybrid_dir)
    c = s.client(state=state)
    assert c.info.state_n_slots == 1 and c.info.n_slots == 4
    hs = chain(s.model, 5)
    store_blocks(c, hs[:4])
    store_blocks(c, hs[4:])                    # hs[0] demoted
    store_states(c, [hs[0]])
    store_states(c, [hs[4]])                   # the only state slot: hs[0]'s checkpoint demoted
    wait_for(lambda: c.lookup_states([hs[0], hs[4]]) == ["disk", "cpu"] and c.lookup(hs[:1]) == ["disk"],
             what="demotions")
    folder = os.path.join(disk_dir, state[0].hex())
    assert os.path.getsize(os.path.join(folder, hs[0].hex() + ".kvb")) == STATE_FILE
    # one reservation, both promotions: ready once both are in their slots
    slots, state_slots = c.reserve(hs[:1], [hs[0]])
    assert len(slots) == 1 and len(state_slots) == 1
    assert bytes(c.attach_state_pool().slot(state_slots[0])) == state_payload(hs[0])
    assert bytes(c.attach_pool().slot(slots[0])) == payload(hs[0])
    c.complete_load(slots, state_slots)
    wait_for(lambda: c.lookup_states([hs[4]]) == ["disk"], what="the promotion's demotion")
    assert s.stop() == 0
    again = stores(0, model=hybrid_dir, extra=pool_args(4, 1.5) + disk, instance=s.instance)
    c = again.client(state=state)
    assert c.lookup_states([hs[0], hs[4], hs[2]]) == ["disk", "disk", ""]
    _, state_slots = c.reserve([], [hs[4]])
    assert bytes(c.attach_state_pool().slot(state_slots[0])) == state_payload(hs[4])
    assert load_blocks(c, hs[:1]) == [payload(hs[0])]


def test_the_state_fraction_splits_both_tiers_and_is_refused_when_it_holds_no_checkpoint(hybrid_dir, disk_dir):
    from services.kvstore.settings import ConfigError, resolve_setup

    cli = {"model": hybrid_dir, "device": "cpu", "dtype": "float32", "block_size": "16",
           "kv_offload_block_bytes": str(BLOCK), "kv_offload_cpu_gib": repr(40 * STATE_BYTES / GIB),
           "kv_offload_disk_dir": disk_dir, "kv_offload_disk_gib": repr(40 * STATE_FILE / GIB),
           "kv_offload_state_fraction": "0.25"}
    setup = resolve_setup(build_config(cli=cli, env={}))
    assert (setup.state_bytes, setup.state_n_slots, setup.state_disk_capacity) == (STATE_BYTES, 10, 10)
    assert setup.n_slots == 30 * STATE_BYTES // BLOCK
    assert setup.disk_capacity == 30 * STATE_FILE // (HEADER.size + BLOCK)
    with pytest.raises(ConfigError, match="kv_offload_state_fraction"):
        resolve_setup(build_config(cli=cli | {"kv_offload_state_fraction": "0.02"}, env={}))


def test_the_worker_moves_checkpoints_between_its_state_cache_and_the_state_pool_byte_for_byte(hybrid_dir):
    """KVTransfer's state copies (services/worker/kv_transfer.py): checkpoint slots of a
    StateCache with random states go into the state pool after a step (state_stores) and
    come back into other checkpoint slots before one (state_loads); the bytes in a slot are
    StateLayout's (layer-major, conv then the recurrent matrix)."""
    import uuid

    import torch

    from services.kvstore.cpu_tier import OwnedPool
    from services.worker.kv_cache import KVCache, PagedKVSpec
    from services.worker.kv_transfer import KVTransfer
    from services.worker.layers.gated_deltanet import GatedDeltaNet
    from services.worker.state_cache import StateCache, StateSpec
    from shared.kv_pool import state_pool_name
    from shared.protocol import StepPlan

    spec = load_model_spec(hybrid_dir)
    lay = KVLayout.for_model(spec, 16)
    layout = StateLayout.for_model(spec, lay)
    shapes = GatedDeltaNet.from_hf_config(HYBRID).state_shapes()
    one = StateSpec(tuple(x.shape for x in shapes), tuple(x.dtype for x in shapes))
    cache = StateCache([one, one], num_slots=6, device="cpu")
    g = torch.Generator().manual_seed(3)
    for layer in cache.layers:
        for t in layer:
            t.copy_(torch.randn(t.shape, generator=g))
    kv = KVCache([PagedKVSpec(lay.kv_heads_per_rank, lay.head_dim)] * lay.num_layers, 4, 16, torch.float32, "cpu")
    xfer = KVTransfer(kv, lay, cache)
    assert layout is not None and xfer.state_bytes == layout.state_bytes == STATE_BYTES
    inst = "kvs" + uuid.uuid4().hex[:8]
    pool = OwnedPool.create(inst, 3, STATE_BYTES, layout.state_identity, name=state_pool_name(inst))
    try:
        def slot_bytes(slot: int) -> bytes:  # StateLayout's order, from the cache's tensors
            return b"".join(t[slot].contiguous().view(torch.uint8).numpy().tobytes()
                            for layer in cache.layers for t in layer)

        want = [slot_bytes(4), slot_bytes(5)]
        plan = StepPlan(1, [], kv_pool_pid=7, state_stores=[(4, 2), (5, 0)], state_pool=pool.name)
        assert xfer.after_step(plan) == ""
        assert [bytes(pool.slot(2)), bytes(pool.slot(0))] == want
        xfer.before_step(StepPlan(2, [], kv_pool_pid=7, state_loads=[(0, 1), (2, 3)], state_pool=pool.name))
        assert [slot_bytes(3), slot_bytes(1)] == want
        gone = StepPlan(3, [], kv_pool_pid=8, state_stores=[(4, 2)], state_pool="kestrel-gone-statepool")
        assert xfer.after_step(gone).startswith("FileNotFoundError")  # reported, the step's tokens stand
    finally:
        xfer.detach()
        pool.close()
