"""Parses Megatron's data blends ("0.3 prefixA 0.7 prefixB") and splits ("949,50,1") with clear errors."""
import math
import re
from typing import Optional

BLEND_FORMS = "'W1 PREFIX1 W2 PREFIX2 ...' (weights > 0) or 'PREFIX1 PREFIX2 ...' (weighted by size)"
Blend = tuple[list[str], Optional[list[float]]]  # megatron-core's (prefixes, weights or None)
SPLIT_PATTERN = re.compile(r"\s*\d+(\.\d*)?(\s*,\s*\d+(\.\d*)?){0,2}\s*")


def _number(word: str) -> Optional[float]:
    try:
        return float(word)
    except ValueError:
        return None


def parse_blend(text: str, key: str = "data.blend") -> Blend:
    """(prefixes, weights or None), megatron-core's blend tuple, from Megatron's --data-path words."""
    words = text.split()
    if not words:
        raise ValueError(f"{key} = {text!r} is empty; expected {BLEND_FORMS}")
    numbers = [_number(word) for word in words]
    if all(n is None for n in numbers):
        return words, None
    if len(words) % 2:
        raise ValueError(f"{key} = {text!r} does not parse: {len(words)} words mix weights and prefixes; "
                         f"expected {BLEND_FORMS}")
    weights, prefixes = numbers[0::2], words[1::2]
    for position, (weight, word) in enumerate(zip(weights, words[0::2])):
        if weight is None:
            raise ValueError(f"{key} = {text!r} does not parse: weight {position + 1} is {word!r}, not a "
                             f"number; expected {BLEND_FORMS}")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"{key} = {text!r}: weight {position + 1} is {word}; weights must be finite "
                             "and > 0")
    for position, (number, word) in enumerate(zip(numbers[1::2], prefixes)):
        if number is not None:
            raise ValueError(f"{key} = {text!r} does not parse: prefix {position + 1} is the number {word!r}; "
                             f"expected {BLEND_FORMS}")
    return prefixes, weights


def parse_split(text: str, key: str = "data.split") -> list[float]:
    """Megatron's "train,valid,test" shares (1 to 3 numbers, missing ones 0), normalised to sum to 1."""
    if not SPLIT_PATTERN.fullmatch(text):
        raise ValueError(f"{key} = {text!r} does not parse; expected 1 to 3 comma-separated shares "
                         "train,valid,test, e.g. \"949,50,1\"")
    shares = [float(part) for part in text.split(",")] + [0.0] * (3 - len(text.split(",")))
    if shares[0] <= 0:
        raise ValueError(f"{key} = {text!r} gives the training split no share; the first number must be > 0")
    return [share / sum(shares) for share in shares]
