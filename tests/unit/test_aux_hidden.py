"""The target-side seam of EAGLE / DFlash (services/worker/models/base.py, llama.py):
`aux_hidden_layers` makes every forward store the residual stream after the named decoder
layers. Truth: forward hooks on the decoder layers of a plain forward (CPU, dummy weights)."""

from __future__ import annotations

import pytest
import torch

from services.worker.fusion import FusionPlan
from shared.protocol import SamplingParams, ScheduledSeq
from tests.unit.spec_head_rig import tiny_runner


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    r, _ = tiny_runner(tmp_path_factory.mktemp("aux"), num_hidden_layers=6)
    return r


def _forward(runner, fused: bool):
    seqs = [ScheduledSeq("a", list(range(3, 20)), 0, [0, 1], True, SamplingParams()),
            ScheduledSeq("b", [5, 9, 4], 0, [2], True, SamplingParams())]
    with torch.inference_mode():
        ids, pos, meta = runner._prepare(seqs)
        old = runner.fusion
        runner.fusion = FusionPlan(None if fused else frozenset())
        try:
            return runner.run_model(ids, pos, meta)
        finally:
            runner.fusion = old


def _recorded(runner, fused: bool) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """A plain forward (no aux layers) and the residual stream after every decoder layer,
    recorded around the layers: a forward hook on the unfused path ((mlp out, residual) ->
    their sum), a wrapper of forward_fused (it returns the stream) on the fused one."""
    streams: dict[int, torch.Tensor] = {}
    layers = runner.model.model.decoder_layers
    hooks = []
    for i, layer in enumerate(layers):
        if fused:
            def wrapped(*a, _orig=layer.forward_fused, _i=i):
                out = _orig(*a)
                streams[_i] = out.clone()
                return out
            layer.forward_fused = wrapped
        else:
            hooks.append(layer.register_forward_hook(
                lambda _m, _in, out, _i=i: streams.__setitem__(_i, (out[0] + out[1]).clone())))
    try:
        return _forward(runner, fused), streams
    finally:
        for h in hooks:
            h.remove()
        for layer in layers:
            layer.__dict__.pop("forward_fused", None)


@pytest.mark.parametrize("fused", [False, True])
def test_aux_hidden_is_the_residual_stream_after_the_named_layers(runner, fused):
    model = runner.model
    model.aux_hidden_layers = ()
    plain, streams = _recorded(runner, fused)
    assert len(streams) == 6 and model.aux_hidden is None  # empty: nothing stored
    model.aux_hidden_layers = (4, 0, 4, 5)  # any order, repeats allowed
    try:
        hidden = _forward(runner, fused)
        aux = model.aux_hidden
    finally:
        model.aux_hidden_layers = ()
    torch.testing.assert_close(hidden, plain, rtol=0, atol=0)  # the output does not change
    assert aux.shape == (20, 4 * 64)
    for j, i in enumerate((4, 0, 4, 5)):
        torch.testing.assert_close(aux[:, j * 64:(j + 1) * 64], streams[i], rtol=0, atol=0)


def test_aux_hidden_layers_are_checked_against_the_model(runner):
    with pytest.raises(ValueError, match="outside"):
        runner.model.aux_hidden_layers = (0, 6)
    runner.model.aux_hidden_layers = [1, 2]
    assert runner.model.aux_hidden_layers == (1, 2) and runner.model.aux_hidden is None
    runner.model.aux_hidden_layers = ()
