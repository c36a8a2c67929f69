"""Numbers from outside (annotations, config files, the SR-IOV config file): read without ever building a huge one.

A number written with an exponent (`1e999999`) is small text but a huge value: turned into an `int` it is a
million-digit integer built while the interpreter lock is held (seconds to minutes, the event loop stalled), and
in `decimal` arithmetic it can raise `decimal.Overflow`, which is no `ValueError`. Everything here bounds the
text and the exponent *before* converting, and turns every arithmetic error into a `NumberError` (a
`ValueError`) that names the value, cut short.
"""

from __future__ import annotations

import decimal
import re
from decimal import ROUND_CEILING, Decimal

MAX_NUMBER_TEXT = 64  # characters of one number as written (a quantity, a JSON number)
MAX_DIGITS = 40  # digits of an integer read from a file: far past any real setting, far below a slow int
MAX_EXPONENT = 100  # |decimal exponent| of a quantity: every bound the agent checks is well inside 1e±100
# a context wide enough for any number passed by the checks above; traps make every inexact step an error
_CONTEXT = decimal.Context(prec=MAX_NUMBER_TEXT + 2 * MAX_EXPONENT, Emax=4 * MAX_EXPONENT,
                           Emin=-4 * MAX_EXPONENT, traps=[decimal.Overflow, decimal.InvalidOperation,
                                                          decimal.DivisionByZero])
_QUANTITY = re.compile(r"^([+-]?[0-9]+(?:\.[0-9]*)?|[+-]?\.[0-9]+)"
                       r"(?:([eE])([+-]?)([0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|[mkMGTPE]))?$")
_SUFFIX: dict[str, Decimal] = {
    "": Decimal(1), "m": Decimal("0.001"), "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9),
    "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18), "Ki": Decimal(2**10), "Mi": Decimal(2**20),
    "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50), "Ei": Decimal(2**60)}


class NumberError(ValueError):
    """A number from outside that is not one, or is outside any range the agent reads; the message quotes it."""


def shown(text: object) -> str:
    """The value as it appears in a message: quoted, cut at 64 characters."""
    value = text if isinstance(text, str) else repr(text)
    return repr(value[:MAX_NUMBER_TEXT]) + ("…" if len(value) > MAX_NUMBER_TEXT else "")


def parse_quantity(text: object) -> Decimal:
    """A Kubernetes quantity (`100M`, `1.5Gi`, `1e6`, `1500m`) as an exact Decimal whose magnitude is within
    1e±(MAX_EXPONENT + 64). NumberError for anything else: longer than MAX_NUMBER_TEXT, not a quantity, or an
    exponent beyond ±MAX_EXPONENT (refused before any arithmetic)."""
    if not isinstance(text, str):
        raise NumberError(f"{shown(text)} is not a Kubernetes quantity")
    if len(text) > MAX_NUMBER_TEXT:
        raise NumberError(f"{shown(text)} is longer than {MAX_NUMBER_TEXT} characters: not a quantity")
    match = _QUANTITY.match(text.strip())
    if not match:
        raise NumberError(f"{shown(text)} is not a Kubernetes quantity such as 50M or 1G")
    number, e, sign, digits, suffix = match.groups()
    if e and len(digits.lstrip("0")) > len(str(MAX_EXPONENT)):
        raise NumberError(f"{shown(text)}: exponent out of range (more than ±{MAX_EXPONENT})")
    exponent = (-1 if sign == "-" else 1) * int(digits) if e else 0
    if abs(exponent) > MAX_EXPONENT:
        raise NumberError(f"{shown(text)}: exponent out of range (more than ±{MAX_EXPONENT})")
    try:
        with decimal.localcontext(_CONTEXT):
            return Decimal(number).scaleb(exponent) * _SUFFIX[suffix or ""]
    except ArithmeticError:  # decimal.Overflow, InvalidOperation (DecimalException is an ArithmeticError)
        raise NumberError(f"{shown(text)} is not a Kubernetes quantity") from None


def ceil_int(value: Decimal, text: object) -> int:
    """A `parse_quantity` result rounded up to an integer (as Kubernetes' `Quantity.Value()`); its magnitude is
    bounded there, so this integer has at most a few hundred digits. NumberError naming `text` on any
    arithmetic error."""
    try:
        with decimal.localcontext(_CONTEXT):
            return int(value.to_integral_value(rounding=ROUND_CEILING))
    except (ArithmeticError, ValueError):
        raise NumberError(f"{shown(text)} is not a number in range") from None


def bounded_int(text: str) -> int:
    """An integer as written in a file (JSON's `parse_int`, YAML's int): at most MAX_DIGITS digits."""
    digits = text.lstrip("+-").lstrip("0")
    if len(digits) > MAX_DIGITS:
        raise NumberError(f"{shown(text)}: an integer of {len(digits)} digits is larger than any setting "
                          f"(at most {MAX_DIGITS} digits)")
    return int(text)


def bounded_float(text: str) -> float:
    """A float as written in a JSON file (`parse_float`): finite and at most MAX_NUMBER_TEXT characters."""
    if len(text) > MAX_NUMBER_TEXT:
        raise NumberError(f"{shown(text)} is longer than {MAX_NUMBER_TEXT} characters: not a number")
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise NumberError(f"{shown(text)} is out of range")
    return value


def no_constant(text: str) -> float:
    """JSON's `parse_constant`: NaN and Infinity are not numbers any setting takes."""
    raise NumberError(f"{text} is not a finite number")
