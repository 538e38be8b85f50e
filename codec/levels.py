"""Quality levels: a name that requests use, bound to an encoding scheme."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Scheme(enum.IntEnum):
    """The scheme byte of the chunk header."""

    RAW = 0
    ZSTD = 1


@dataclass(frozen=True)
class Level:
    name: str
    scheme: Scheme
    lossless: bool = True


LOSSLESS = Level("lossless", Scheme.RAW)

DEFAULT_LEVELS: tuple[Level, ...] = (LOSSLESS,)


def level_by_name(name: str, levels: tuple[Level, ...] = DEFAULT_LEVELS) -> Level:
    for level in levels:
        if level.name == name:
            return level
    raise KeyError(name)
