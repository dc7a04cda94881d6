"""The SUMMA part of the strategy vocabulary (``planner.strategy`` re-exports it): the layout
a matmul-like op runs in when it is a 2-D SUMMA, 2.5-D or 3-D matmul, and the mesh axes and
families it uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SUMMA_AXES", "SUMMA_FAMILIES", "SummaLayout"]

SUMMA_FAMILIES = ("2d", "2.5d", "3d")
SUMMA_AXES = ("row", "col", "dep")


@dataclass(frozen=True)
class SummaLayout:
    """A matmul-like op run as a 2-D SUMMA, 2.5-D (Tesseract) or 3-D matmul over the mesh axes
    ``row`` (q), ``col`` (q) and, for 2.5-D and 3-D, ``dep`` (d). ``cost_model/summa.py``
    prices the algorithms and ``codegen/runtime/summa.py`` runs them.

    Families and the block layout each keeps (placements of a linear ``y = x W^T + b`` with
    x ``(..., K)``, W ``(N, K)``, l the leading dim of x that carries the rows, usually the
    batch; mesh axes in the order the mesh lists them):

    - ``2d`` (``d == 1``, mesh ``... row x col``) and ``2.5d`` (``d >= 2``, mesh
      ``... dep x row x col``, the depth outermost so its once-per-step gradient all-reduce may
      cross nodes): x and y are ``S(l)`` on ``dep`` and ``row`` and ``S(-1)`` on ``col``;
      W is ``S(1)`` (K) on ``row`` and ``S(0)`` (N) on ``col``, replicated on ``dep``; the
      bias is ``S(0)`` on ``col``. Each of the q rounds broadcasts a block of x along the
      mesh's ``col`` axis and a block of W along ``row``.
    - ``3d`` (``d == q``, mesh ``... row x col x dep``, ``dep`` innermost): with roles
      b = ``row``, c = ``col`` (``swapped`` exchanges them), x is ``S(l)`` on b and ``dep``
      and ``S(-1)`` on c; W is ``S(1)`` (K) on c and ``dep`` and ``S(0)`` (N) on b; y is
      ``S(l)`` on c and ``dep`` and ``S(-1)`` on b; the bias is ``S(0)`` on b. The op
      all-gathers W over ``dep`` and x over b, multiplies, and reduce-scatters y over c; the
      next matmul of a pair is ``swapped``, so an MLP returns to its input's layout.
      ``keep_gathered`` (3-D only): the forward keeps its gathered x and W blocks for the
      backward instead of gathering them again (two all-gathers fewer per matmul, saved
      blocks of 1/q^2 rather than 1/q^3 of the tensors).

    Ops other than matmuls in a block layout (norms over the split hidden dim) carry the
    layout of the SUMMA family they sit in, so the program knows which axis holds the hidden
    dim (``hidden_axis``).
    """

    q: int
    d: int = 1
    family: str = ""
    swapped: bool = False
    keep_gathered: bool = False

    def __post_init__(self) -> None:
        if self.q < 1 or self.d < 1:
            raise ValueError(f"SUMMA layout needs q >= 1 and d >= 1, got q={self.q}, d={self.d}")
        family = self.family or ("2d" if self.d == 1 else "2.5d")
        object.__setattr__(self, "family", family)
        if family not in SUMMA_FAMILIES:
            raise ValueError(f"SUMMA family must be one of {SUMMA_FAMILIES}, got {str(family)[:40]!r}")
        if family == "2d" and self.d != 1:
            raise ValueError(f"a 2d SUMMA layout has depth 1, got d={self.d}")
        if family == "2.5d" and not 2 <= self.d <= self.q:
            raise ValueError(f"a 2.5d SUMMA layout needs 2 <= d <= q, got q={self.q}, d={self.d}")
        if family == "3d" and self.d != self.q:
            raise ValueError(f"a 3d SUMMA layout needs d == q, got q={self.q}, d={self.d}")
        if self.swapped and family != "3d":
            raise ValueError("only 3d SUMMA layouts swap their row and column roles")
        if self.keep_gathered and family != "3d":
            raise ValueError("only 3d SUMMA layouts keep their gathered operands (keep_gathered)")

    @property
    def devices(self) -> int:
        return self.q * self.q * self.d

    @property
    def hidden_axis(self) -> str:
        """The mesh axis over which the hidden (last) dim of x is split."""
        if self.family != "3d":
            return "col"
        return "row" if self.swapped else "col"

    def describe(self) -> str:
        """``2.5-D SUMMA q=2 d=2``-style words for reports."""
        words = {"2d": "2-D SUMMA", "2.5d": "2.5-D SUMMA", "3d": "3-D"}[self.family]
        text = f"{words} q={self.q}" + (f" d={self.d}" if self.family == "2.5d" else "")
        return text + (" (swapped)" if self.swapped else "") + (", gathers kept" if self.keep_gathered else "")

    def to_dict(self) -> dict[str, Any]:
        data = {"kind": "summa", "q": self.q, "d": self.d, "family": self.family, "swapped": self.swapped}
        if self.keep_gathered:  # written only when set, so plans without it read as before
            data["keep_gathered"] = True
        return data

    @classmethod
    def from_dict(cls, data: Any) -> SummaLayout:
        """Inverse of ``to_dict``; ``ValueError``/``TypeError`` name what is wrong."""
        if not isinstance(data, dict) or data.get("kind") != "summa":
            raise ValueError(f"a layout must be an object with kind 'summa', got {str(data)[:80]!r}")
        unknown = set(data) - {"kind", "q", "d", "family", "swapped", "keep_gathered"}
        if unknown:
            raise ValueError(f"unknown SUMMA layout field(s) {sorted(str(u)[:20] for u in unknown)}")
        q, d, family, swapped = data.get("q"), data.get("d", 1), data.get("family", ""), data.get("swapped", False)
        keep_gathered = data.get("keep_gathered", False)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (q, d)):
            raise ValueError(f"SUMMA q and d must be integers, got q={q!r}, d={d!r}")
        if not isinstance(family, str) or not isinstance(swapped, bool) or not isinstance(keep_gathered, bool):
            raise ValueError("SUMMA family must be a string, swapped and keep_gathered booleans")
        return cls(q, d, family, swapped, keep_gathered)
