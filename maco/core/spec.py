"""The workload: one 2-D convolution, described by its shapes alone.

Everything in MACO (bounds, schedules, kernels, layouts) keys on a ConvSpec, so it
validates eagerly and names the bad value: a wrong shape found late costs a tuning run.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from maco.core.errors import MacoError
from maco.core.files import load_json, short

Pair = tuple[int, int]
DTYPE_BYTES = 4  # fp32 everywhere
# The largest size along any axis, padded extents included: the generated kernels index rows,
# columns and channels with C ints (a bigger one would wrap), and numpy sizes stay int64.
MAX_EXTENT = 2**31 - 1


def _pair(name: str, value: int | tuple[int, int] | list[int]) -> Pair:
    if isinstance(value, bool):
        raise MacoError(f"{name} must be an int or an (h, w) pair, got {value!r}")
    if isinstance(value, int):
        return (int(value), int(value))
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return (int(value[0]), int(value[1]))
    raise MacoError(f"{name} must be an int or an (h, w) pair, got {short(value)}")


@dataclass(frozen=True)
class ConvSpec:
    """A conv2d: input (n, c, h, w), k filters of kh x kw over c/groups channels.

    stride, padding and dilation accept an int or an (h, w) pair and are stored as pairs.
    """

    n: int
    c: int
    h: int
    w: int
    k: int
    kh: int
    kw: int
    stride: Pair = (1, 1)
    padding: Pair = (0, 0)
    dilation: Pair = (1, 1)
    groups: int = 1

    def __post_init__(self) -> None:
        for name in ("n", "c", "h", "w", "k", "kh", "kw", "groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise MacoError(f"ConvSpec.{name} must be a positive int, got {short(value)}")
            object.__setattr__(self, name, int(value))  # a plain int, whatever subclass came in
        for name in ("stride", "padding", "dilation"):
            object.__setattr__(self, name, _pair(name, getattr(self, name)))
        if min(self.stride) <= 0:
            raise MacoError(f"ConvSpec.stride must be positive, got {self.stride}")
        if min(self.dilation) <= 0:
            raise MacoError(f"ConvSpec.dilation must be positive, got {self.dilation}")
        if min(self.padding) < 0:
            raise MacoError(f"ConvSpec.padding must be >= 0, got {self.padding}")
        for name in ("n", "c", "h", "w", "k", "kh", "kw", "groups", "stride", "padding", "dilation"):
            value = getattr(self, name)
            if max(value if isinstance(value, tuple) else (value,)) > MAX_EXTENT:
                raise MacoError(f"ConvSpec.{name}={short(value)} is past {MAX_EXTENT}, the largest "
                                "size MACO's kernels index along an axis")
        if self.c % self.groups:
            raise MacoError(f"ConvSpec.c={self.c} is not divisible by groups={self.groups}")
        if self.k % self.groups:
            raise MacoError(f"ConvSpec.k={self.k} is not divisible by groups={self.groups}")
        for axis, size, pad, ext in (
            ("h", self.h, self.padding[0], self.dilated_kh),
            ("w", self.w, self.padding[1], self.dilated_kw),
        ):
            if ext > size + 2 * pad:
                raise MacoError(
                    f"kernel extent {ext} along {axis} is larger than the padded input "
                    f"{size} + 2*{pad} = {size + 2 * pad}"
                )
            if size + 2 * pad > MAX_EXTENT:
                raise MacoError(f"the padded input {size} + 2*{pad} along {axis} is past {MAX_EXTENT}, "
                                "the largest size MACO's kernels index along an axis")

    # -- derived sizes -------------------------------------------------------
    @property
    def dilated_kh(self) -> int:
        return (self.kh - 1) * self.dilation[0] + 1

    @property
    def dilated_kw(self) -> int:
        return (self.kw - 1) * self.dilation[1] + 1

    @property
    def out_h(self) -> int:
        return (self.h + 2 * self.padding[0] - self.dilated_kh) // self.stride[0] + 1

    @property
    def out_w(self) -> int:
        return (self.w + 2 * self.padding[1] - self.dilated_kw) // self.stride[1] + 1

    @property
    def c_per_group(self) -> int:
        return self.c // self.groups

    @property
    def k_per_group(self) -> int:
        return self.k // self.groups

    @property
    def is_depthwise(self) -> bool:
        return self.groups == self.c and self.groups > 1

    @property
    def macs(self) -> int:
        return self.n * self.k * self.out_h * self.out_w * self.c_per_group * self.kh * self.kw

    @property
    def flops(self) -> int:
        """2 flops per multiply-add, the convention of every GFLOP/s figure in MACO."""
        return 2 * self.macs

    @property
    def input_elems(self) -> int:
        return self.n * self.c * self.h * self.w

    @property
    def weight_elems(self) -> int:
        return self.k * self.c_per_group * self.kh * self.kw

    @property
    def output_elems(self) -> int:
        return self.n * self.k * self.out_h * self.out_w

    @property
    def input_bytes(self) -> int:
        return self.input_elems * DTYPE_BYTES

    @property
    def weight_bytes(self) -> int:
        return self.weight_elems * DTYPE_BYTES

    @property
    def output_bytes(self) -> int:
        return self.output_elems * DTYPE_BYTES

    @property
    def working_bytes(self) -> int:
        """What one timed run holds: input and weight in two layouts (plus packed weights) and
        four outputs (reference, candidate, torch's, a residual): the memory to ask for first."""
        return 3 * (self.input_bytes + self.weight_bytes) + 4 * self.output_bytes

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.c, self.h, self.w)

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        return (self.k, self.c_per_group, self.kh, self.kw)

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.k, self.out_h, self.out_w)

    def with_batch(self, n: int) -> "ConvSpec":
        return ConvSpec(**{**self.to_dict(), "n": n})

    # -- construction and serialisation -------------------------------------
    @classmethod
    def from_module(cls, conv: Any, input_shape: tuple[int, ...] | list[int]) -> "ConvSpec":
        """From a torch.nn.Conv2d and the (n, c, h, w) shape of its input."""
        import torch

        if not isinstance(conv, torch.nn.Conv2d):
            raise MacoError(f"expected a torch.nn.Conv2d, got {type(conv).__name__}")
        if len(input_shape) != 4:
            raise MacoError(f"input_shape must be (n, c, h, w), got {tuple(input_shape)}")
        if isinstance(conv.padding, str):
            raise MacoError(f"padding={conv.padding!r} is not supported; give explicit padding")
        if conv.padding_mode != "zeros":
            raise MacoError(f"padding_mode={conv.padding_mode!r} is not supported (zeros only)")
        n, c, h, w = (int(v) for v in input_shape)
        if c != conv.in_channels:
            raise MacoError(f"input has {c} channels but the conv expects {conv.in_channels}")
        kh, kw = conv.kernel_size
        return cls(n, c, h, w, conv.out_channels, kh, kw, tuple(conv.stride),
                   tuple(conv.padding), tuple(conv.dilation), conv.groups)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("stride", "padding", "dilation"):
            d[name] = list(d[name])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ConvSpec":
        if not isinstance(d, dict):
            raise MacoError(f"a ConvSpec must be a JSON object, got {type(d).__name__}")
        known = {"n", "c", "h", "w", "k", "kh", "kw", "stride", "padding", "dilation", "groups"}
        unknown = set(d) - known
        if unknown:
            raise MacoError(f"unknown ConvSpec field(s): {short(sorted(map(str, unknown)))}")
        missing = {"n", "c", "h", "w", "k", "kh", "kw"} - set(d)
        if missing:
            raise MacoError(f"ConvSpec is missing field(s): {sorted(missing)}")
        return cls(**{key: (tuple(v) if isinstance(v, list) else v) for key, v in d.items()})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ConvSpec":
        return cls.from_dict(load_json(text, "ConvSpec JSON"))

    # -- a compact text form for the CLI and for file names -----------------
    def __str__(self) -> str:
        parts = [f"n{self.n}", f"c{self.c}", f"h{self.h}", f"w{self.w}", f"k{self.k}",
                 f"r{self.kh}x{self.kw}"]
        for tag, value, default in (("s", self.stride, 1), ("p", self.padding, 0),
                                    ("d", self.dilation, 1)):
            if value != (default, default):
                parts.append(f"{tag}{value[0]}" if value[0] == value[1] else f"{tag}{value[0]}x{value[1]}")
        if self.groups != 1:
            parts.append(f"g{self.groups}")
        return "_".join(parts)

    @classmethod
    def parse(cls, text: str) -> "ConvSpec":
        """Parse the form str() writes, e.g. ``n1_c64_h56_w56_k64_r3x3_p1`` (n defaults to 1,
        ``r3`` means 3x3, s/p/d take ``2`` or ``2x1``, ``g`` is groups)."""
        names = {"n": "n", "c": "c", "h": "h", "w": "w", "k": "k", "g": "groups",
                 "s": "stride", "p": "padding", "d": "dilation", "r": "kernel"}
        fields: dict[str, Any] = {"n": 1}
        for part in text.strip().split("_"):
            tag, value = part[:1], part[1:]
            if tag not in names or not value:
                raise MacoError(f"bad layer spec part {short(part)} in {short(text)}; "
                                "expected e.g. n1_c64_h56_w56_k64_r3x3_s1_p1_d1_g1")
            try:
                nums = [int(v) for v in value.split("x")]
            except ValueError:
                raise MacoError(f"bad number in layer spec part {short(part)} of {short(text)}") from None
            if len(nums) not in (1, 2) or (len(nums) == 2 and tag not in "rspd"):
                raise MacoError(f"bad layer spec part {short(part)} in {short(text)}")
            if tag == "r":
                fields["kh"], fields["kw"] = (nums[0], nums[-1])
            else:
                fields[names[tag]] = nums[0] if len(nums) == 1 else tuple(nums)
        missing = [t for t in "chwk" if t not in fields] + ([] if "kh" in fields else ["r"])
        if missing:
            raise MacoError(f"layer spec {short(text)} is missing {', '.join(missing)}")
        return cls(**fields)
