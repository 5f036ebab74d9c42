"""`Module`: the base of Kestrel's model modules, an `nn.Module` whose call runs `forward`
directly while neither the module nor torch's global registries hold a hook.

Why: a CPU decode step of a small model is bound by Python, not by its products, and
`nn.Module.__call__` (`_wrapped_call_impl`, `_call_impl`: two frames and eight hook checks)
runs some 275 times a step for SmolLM2. Measured on the 2-core dev VM (2026-12-07, SmolLM2-135M,
2 threads, the two calls rotated step by step in one process, 4 rounds of 48 steps, load 0.6-1.1;
`benchmarks/cpu_decode_profile.py --call-ab --quantization int4 gguf --threads 2 --steps 48
--rounds 4`, benchmarks/results/2026-12-07_cpu2_cpu_decode_call_ab.json): int4 12.98 -> 12.57 ms a
step (1.032x, rounds 1.017-1.033), gguf 15.94 -> 15.59 (1.022x), greedy ids equal. With a hook
registered (a test records the residual stream with one) the call is `nn.Module`'s, so hooks
still run. docs/ARCHITECTURE.md §6.1.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules import module as _torch_module

# torch's global hook registries (dicts it mutates in place, never rebinds)
_GLOBAL_HOOKS = (_torch_module._global_forward_hooks, _torch_module._global_forward_pre_hooks,
                 _torch_module._global_backward_hooks, _torch_module._global_backward_pre_hooks)


class Module(nn.Module):
    """`nn.Module` with the direct call (module doc); subclass it as `nn.Module`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks
                or any(_GLOBAL_HOOKS)):
            return super().__call__(*args, **kwargs)
        return self.forward(*args, **kwargs)
