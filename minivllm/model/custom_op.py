"""Layers with a plain-PyTorch specification and, per platform, a faster forward of equal results.

vLLM gives every layer that a kernel speeds up a `CustomOp` base (vllm/model_executor/custom_op.py):
`forward_native` in plain PyTorch is the specification, and `forward_cuda` / `forward_cpu` call
fused kernels. `forward()` does not choose at every call: `dispatch_forward` picks one method, once,
from the platform, and `forward` calls it.

Here the same, with one difference in where the fast forwards are written. The model's files hold
the math only: each op's `forward_native` (RMSNorm, SiLU·mul, RoPE, the parallel linears, the LM
head). A platform's forwards live with the platform (`minivllm/cpu/op_forwards.py` for the CPU)
and register themselves for the op class they speed up with `register_forward`; a learner reads
the model without meeting a kernel, and reads the kernels where the platform is. The platform
calls `dispatch_forward` on every op once the weights are loaded (`Platform.dispatch_custom_ops`);
an op without a forward for the platform, or a model loaded with `custom_ops="none"`, runs
`forward_native`. The parity tests run both, greedy token-exact against transformers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class PlatformForward:
    """One op's forward on one platform, as registered by that platform's op module."""

    forward: Callable[..., Any]  # forward(op, *args): what `op(*args)` computes, faster
    # Run once per op after its weights are loaded, before the first forward (vLLM's name for the
    # step: process_weights_after_loading); e.g. the CPU LM head's weight in oneDNN's layout.
    process_weights_after_loading: Callable[[Any], None] | None = None


# (op class, device type) -> its forward there; filled by `register_forward`.
_PLATFORM_FORWARDS: dict[tuple[type, str], PlatformForward] = {}


def register_forward(
    op_class: type[CustomOp],
    device_type: str,
    process_weights_after_loading: Callable[[Any], None] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `fn(op, *args)` is `op_class`'s forward (and its subclasses') on `device_type`."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _PLATFORM_FORWARDS[(op_class, device_type)] = PlatformForward(
            fn, process_weights_after_loading
        )
        return fn

    return register


def platform_forward(op_class: type, device_type: str) -> PlatformForward | None:
    """The forward registered for `op_class` or its nearest base class, if any."""
    for cls in op_class.__mro__:
        found = _PLATFORM_FORWARDS.get((cls, device_type))
        if found is not None:
            return found
    return None


class CustomOp(nn.Module):
    """A layer whose `forward` runs the method `dispatch_forward` chose: `forward_native` until a
    platform picks its own."""

    def __init__(self) -> None:
        super().__init__()
        self._forward_method: Callable[..., Any] = self.forward_native
        self.dispatched_to = "native"  # or the device type whose registered forward runs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def dispatch_forward(self, device_type: str | None) -> bool:
        """Run the forward registered for `device_type` from now on (None: `forward_native`).
        Returns whether a registered forward was found."""
        found = platform_forward(type(self), device_type) if device_type else None
        if found is None:
            self._forward_method, self.dispatched_to = self.forward_native, "native"
            return False
        if found.process_weights_after_loading is not None:
            found.process_weights_after_loading(self)
        self._forward_method = functools.partial(found.forward, self)
        self.dispatched_to = device_type or "native"
        return True
