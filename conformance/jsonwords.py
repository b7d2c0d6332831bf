"""The words for what is wrong with a JSON line or value, shared by both trace formats' readers.

orjson, the readers' parser, refuses ``NaN`` and ``Infinity`` (they are not JSON) with "unexpected
character", and reads an integer beyond 64 bits as a float. Said as it is, that misleads: a NaN is
not a truncated line, and 10^30 is not "a number with a fraction". These functions say what the
line or value really is; they run only on lines already refused, so they cost nothing otherwise.
"""

from __future__ import annotations

import json
import math

_NON_JSON = ("NaN", "Infinity", "-Infinity")


def json_error(raw: bytes, err: Exception) -> str:
    """Why ``raw`` (refused by orjson with ``err``) is not JSON, in a few words."""
    text = raw.decode("utf-8", "replace")
    constants: list[str] = []
    try:
        json.loads(text, parse_constant=lambda name: constants.append(name))
    except (ValueError, RecursionError):
        pass
    if constants:
        return f"not JSON: {constants[0]} is not a JSON number (write a number, or null)"
    message = str(err)
    if "unexpected end of data" in message or "EOF" in message:
        return f"not JSON (truncated line?): {message}"
    return f"not JSON: {message}"


def json_type(value: object) -> str:
    """What a JSON value is, for "must be X, got Y"."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "a number that is not finite"
        if value.is_integer():
            if abs(value) >= 2**63:
                return f"{value:.3g}, a number beyond the 64-bit integers"
            return f"{value!r}, a number written with a decimal point or an exponent"
        return f"{value!r}, a number with a fraction"
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        int: "an integer",
    }.get(type(value), "null")
