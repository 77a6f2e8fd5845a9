"""What a pass may know: the communication group and the rank-independent configuration. Never the rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PassContext:
    stage: int
    world_size: int
    group_name: str | None  # resolved by the functional collectives; None when world_size is 1
    bucket_bytes: int
    artifacts: dict[str, Any] = field(default_factory=dict)  # what passes leave for the runtime and reports
