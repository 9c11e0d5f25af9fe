"""Position encodings behind one interface (see ``base``); importing this package registers all."""

from tpe_train.positions import absolute, contextual, fire, kernel, relative, rotary
from tpe_train.positions.base import (
    POSITIONS,
    PositionArgs,
    PositionEncoding,
    build_position,
)

__all__ = ["POSITIONS", "PositionArgs", "PositionEncoding", "build_position"]
_REGISTERED = (absolute, relative, rotary, kernel, fire, contextual)
