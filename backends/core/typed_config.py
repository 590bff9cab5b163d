"""Configs as typed dataclasses, built from dicts (JSON) that may hold only the keys they declare."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


def strict_from_dict(cls, data: Mapping[str, Any], what: str):
    """Build dataclass `cls` from `data`, refusing keys it does not declare."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown}; allowed: {sorted(names)}")
    return cls(**data)
