"""What a generated conv kernel can do to its outputs before it stores them: add the bias, add a
residual tensor, then apply an activation. A network's conv -> BatchNorm -> (add) -> activation
chains fold into one kernel this way (maco.layouts.fusion), so they cost no extra pass over memory."""
from __future__ import annotations

from maco.core.errors import MacoError

ACTIVATIONS = ("none", "relu", "relu6")  # relu6 = hardtanh(0, 6), MobileNetV2's


def activation_of(relu: bool = False, activation: str | None = None) -> str:
    """The activation a caller asked for: `activation` by name, or relu=True as a shorthand."""
    if activation is None:
        return "relu" if relu else "none"
    if activation not in ACTIVATIONS:
        raise MacoError(f"unknown activation {activation!r}; kernels fuse {', '.join(ACTIVATIONS)}")
    if relu and activation != "relu":
        raise MacoError(f"relu=True contradicts activation={activation!r}")
    return activation
