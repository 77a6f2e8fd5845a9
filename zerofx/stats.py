"""What a step reports about itself: `StepStats`, read with ``step.stats()``."""

from __future__ import annotations

from dataclasses import dataclass, field

from zerofx.collectives import CollectiveRecord


@dataclass
class StepStats:
    stage: int
    world_size: int
    num_params: int  # Ψ: elements of the distinct trainable parameters
    collectives: list[CollectiveRecord] = field(default_factory=list)  # the last step's, in issue order
    traces: int = 0  # graphs captured so far (one per guard key)

    def data_collectives(self) -> list[CollectiveRecord]:
        return [r for r in self.collectives if r.purpose == "data"]
