"""The predicted cost of one planning decision, split so a report can explain it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostParts:
    """Predicted cost of one decision, split so a report can explain it (seconds, bytes)."""

    compute_s: float = 0.0
    communication_s: float = 0.0
    resharding_s: float = 0.0
    memory_bytes: int = 0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.communication_s + self.resharding_s
