"""Benchmark shapes and implementation names as the command line spells them; no torch
import, so the command line can check its arguments before loading anything heavy."""

from __future__ import annotations

from dataclasses import dataclass

IMPLS = ("eager", "compile", "fused", "fused_eager", "fused_plan")


@dataclass(frozen=True)
class Shape:
    lens: tuple
    d: int
    ratio: int
    coff: int

    @property
    def name(self) -> str:
        if len(set(self.lens)) == 1 and len(self.lens) > 0:
            pack = f"{len(self.lens)}x{self.lens[0]}"
        else:
            pack = "[" + ",".join(map(str, self.lens)) + "]"
        return f"{pack}:{self.d}:{self.ratio}:{self.coff}"


def parse_shape(text: str) -> Shape:
    """``3x8192:512:4:2`` or ``1023+2048+509+3+0+77:128:4:2`` (pack:head_dim:ratio:coff)."""
    try:
        pack, d, ratio, coff = text.strip().split(":")
        if "x" in pack:
            b, n = pack.split("x")
            lens = (int(n),) * int(b)
        else:
            lens = tuple(int(x) for x in pack.strip("[]").replace(",", "+").split("+"))
        shape = Shape(lens, int(d), int(ratio), int(coff))
    except ValueError as exc:
        raise ValueError(f"--shapes: cannot parse {text!r}; expected e.g. 3x8192:512:4:2") from exc
    if (not shape.lens or min(shape.lens) < 0 or shape.d < 1 or shape.ratio < 1
            or shape.coff not in (1, 2)):
        raise ValueError(f"--shapes: {text!r} needs one or more segment lengths >= 0, "
                         "head_dim >= 1, ratio >= 1 and coff 1 or 2")
    return shape


PRODUCTION = [parse_shape(s) for s in (
    "1x8192:128:4:2", "3x8192:128:4:2", "1x8192:512:4:2", "3x8192:512:4:2",
    "1023+2048+509+3+0+77:128:4:2", "1x8192:128:128:1", "3x8192:512:128:1",
)]
DEFAULT = PRODUCTION + [parse_shape(s) for s in ("1x8192:512:128:2", "3x8192:512:2:2")]
EXTRA = [parse_shape(s) for s in ("2048x64:128:4:2", "1x131072:128:4:2", "1x8192:65:3:2")]
# torch.compile costs tens of seconds per shape: by default it runs on these four.
COMPILE_DEFAULT = {"1x8192:128:4:2", "3x8192:512:4:2", "1x8192:128:128:1", "3x8192:512:128:1"}


def shapes_from_arg(arg: str | None) -> list[Shape]:
    """``default``, ``production``, ``all``, or shapes separated by commas."""
    if arg in (None, "default"):
        return list(DEFAULT)
    if arg == "production":
        return list(PRODUCTION)
    if arg == "all":
        return list(DEFAULT) + list(EXTRA)
    shapes = [parse_shape(s) for s in arg.split(",") if s.strip()]
    if not shapes:
        raise ValueError(f"--shapes: no shape in {arg!r}")
    return shapes


def parse_impls(arg: str) -> tuple:
    names = tuple(n.strip() for n in arg.split(",") if n.strip())
    unknown = [n for n in names if n not in IMPLS]
    if unknown or not names:
        raise ValueError(f"--impls: expected names from {', '.join(IMPLS)}, got {arg!r}")
    return names
