"""What a family's report part returns (``planner.families``): rich renderables (tables)
printed as they are, and ``Paragraph``s that the report wraps to its width."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Paragraph:
    """A paragraph of the report: ``text`` wrapped to the report's width, every line indented
    by ``indent`` and, after the first, by ``hanging`` when given."""

    text: str
    indent: str = "  "
    hanging: str | None = None
