"""services.worker.layers.module.Module: the call runs forward directly while no hook is
registered, and nn.Module's call (which runs the hooks) as soon as one is, on the module or
in torch's global registries."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.layers.module import Module


class Double(Module):
    def forward(self, x: torch.Tensor, *, plus: float = 0.0) -> torch.Tensor:
        return 2 * x + plus


def test_no_hook_skips_nn_module_call_and_gives_forward_result(monkeypatch):
    calls = []
    real = nn.Module._call_impl
    monkeypatch.setattr(nn.Module, "_call_impl", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    m = Double()
    assert torch.equal(m(torch.ones(2), plus=1.0), torch.full((2,), 3.0))
    assert calls == []  # forward ran without torch's dispatch
    assert torch.equal(nn.Sequential(m)(torch.ones(1)), torch.full((1,), 2.0))  # as a child of a torch module


def test_module_hooks_run():
    m, seen = Double(), []
    pre = m.register_forward_pre_hook(lambda _m, args: (args[0] + 1,))
    post = m.register_forward_hook(lambda _m, _args, out: seen.append(out.clone()) or out * 10)
    assert torch.equal(m(torch.zeros(1)), torch.full((1,), 20.0))  # pre: x + 1; forward: 2x; post: x 10
    assert torch.equal(seen[0], torch.full((1,), 2.0))
    pre.remove()
    post.remove()
    assert torch.equal(m(torch.zeros(1)), torch.zeros(1))  # removed: the direct call again


def test_global_hooks_run():
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, _a, out: seen.append(type(mod)))
    try:
        Double()(torch.zeros(1))
    finally:
        handle.remove()
    assert seen == [Double]
