"""How one request's recurrent state is laid out as bytes, for the engine, the workers and the
kvstore (docs/ARCHITECTURE.md §4.5, §4.7).

A hybrid model's recurrent layers (gated DeltaNet) keep a fixed-size state per request: per
layer its short-conv window [conv_dim, conv_kernel - 1] in the model dtype and its recurrent
matrix [value heads, key head dim, value head dim] in fp32 (conv_dim = 2 * key heads * key
head dim + value heads * value head dim). A state checkpoint (the state after the last token
of a cached block chain, services/engine/state_slots.py) is that state for every recurrent
layer. In a kvstore state slot it is laid out layer-major, each layer's tensors in that order
(conv, then recurrent matrix), each C-contiguous: `state_bytes` bytes
(services/worker/kv_transfer.py copies it).

The state identity names what those bytes depend on: the model identity (model folder,
dtype, KV dtype, block size, parallel layout: `shared.kv_layout`) and the per-layer shapes and
dtypes. The kvstore is bound to it as to the model identity (a KVHello with another is
refused) and its disk tier keeps checkpoint files under it, so a different model, or the same
folder with another state layout, never reads them. Derived once here from a `ModelSpec`; the
worker checks its model's state specs against it (as it checks its KV shape against
`KVLayout`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.kv_layout import KVLayout
from shared.model_spec import LINEAR_ATTENTION, ModelSpec, dtype_bytes, model_spec_for

if TYPE_CHECKING:  # no import at run time: shared.config imports shared.model_spec
    from shared.config import KestrelConfig

_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
           "linear_value_head_dim", "linear_conv_kernel_dim")


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a recurrent layer's per-request state: shape (elements) and dtype name."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def bytes(self) -> int:
        """Bytes of this tensor for one request."""
        n = 1
        for d in self.shape:
            n *= d
        return n * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class StateLayout:
    """The per-request recurrent state of a hybrid model. Build it with `for_model` or
    `state_layout_for`.

    layers: per recurrent layer (in layer order) its tensors (conv window, recurrent
    matrix). state_identity: 32 bytes (module doc). Sizes in bytes: `state_bytes`.
    """

    layers: tuple[tuple[StateTensor, ...], ...]
    state_identity: bytes

    @classmethod
    def for_model(cls, spec: ModelSpec, kv: KVLayout) -> StateLayout | None:
        """The state layout of `spec` (None for a model without recurrent layers); kv: its
        KV layout (the identity's root). Raises ValueError naming a missing config field."""
        if not spec.has_recurrent_state:
            return None
        text: Mapping[str, Any] = spec.text_config
        missing = [f for f in _FIELDS if f not in text]
        if missing:
            raise ValueError(f"config.json of {spec.path!r} lacks the gated DeltaNet fields {missing}")
        hk, hv, dk, dv, w = (int(text[f]) for f in _FIELDS)
        conv = StateTensor((2 * hk * dk + hv * dv, w - 1), spec.dtype)
        ssm = StateTensor((hv, dk, dv), "float32")
        n = sum(1 for t in spec.layer_types if t == LINEAR_ATTENTION)
        layers = ((conv, ssm),) * n
        h = hashlib.sha256(b"kestrel-state-layout-v1")
        h.update(kv.model_identity)
        for layer in layers:
            for t in layer:
                h.update(struct.pack(f"<I{len(t.shape)}q", len(t.shape), *t.shape))
                h.update(t.dtype.encode() + b"\0")
        return cls(layers, h.digest())

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state over every recurrent layer (one checkpoint, one
        kvstore state slot)."""
        return sum(t.bytes for layer in self.layers for t in layer)


def state_layout_for(cfg: KestrelConfig) -> StateLayout | None:
    """The state layout for a config (None for a dense model). Raises ModelFolderError,
    ValueError as `load_model_spec`, `KVLayout.for_model` and `StateLayout.for_model`."""
    spec = model_spec_for(cfg)
    return StateLayout.for_model(spec, KVLayout.for_model(spec, cfg.block_size))
