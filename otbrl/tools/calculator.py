"""A safe arithmetic calculator tool: `calculator("2 * (3 + 4.5)") -> "15"`.

The expression is parsed with `ast` and only numbers, + - * / // % **, unary minus/plus and parentheses
are evaluated -- no names, calls or attributes, and never `eval`. Arithmetic is exact on fractions, so
`0.1 + 0.2` is `0.3` and `1/3` prints as a 20-significant-digit decimal. Sizes are bounded so hostile
input cannot hang the trainer: at most `MAX_CHARS` characters, and every intermediate value (numerator
and denominator) at most `MAX_BITS` bits -- `9**9**9` is rejected before it is computed. A non-integer
power (`2 ** 0.5`) is computed in floating point.

`calculate` returns the exact value or raises `CalculatorError`; `calculator` is the tool: it returns
the result as text, or "Error: ..." text, and never raises.
"""

from __future__ import annotations

import ast
import math
from decimal import Context, Decimal
from fractions import Fraction

__all__ = ["CalculatorError", "calculator", "calculate"]

MAX_CHARS = 1000
MAX_BITS = 4096  # about 1233 decimal digits
_DIGITS = 20

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
}
_SYMBOL = {
    ast.BitXor: "^ (use ** for powers)",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.MatMult: "@",
}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or cannot be evaluated (division by zero, too large)."""


def calculate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (see the module docstring)."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not a valid expression ({type(e).__name__})") from None
    try:
        return _eval(tree.body, expression.strip())
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def calculator(expression: str) -> str:
    """The tool: the value as text (an integer, or a decimal), or 'Error: <why>'. Never raises."""
    try:
        return format_number(calculate(expression))
    except CalculatorError as e:
        return f"Error: {e}"
    except Exception as e:  # noqa: BLE001 - a tool must not raise into the trainer
        return f"Error: {type(e).__name__}"


def format_number(value: Fraction) -> str:
    """An integer exactly; otherwise a decimal, exact when it terminates within 20 digits."""
    if value.denominator == 1:
        return str(value.numerator)
    ctx = Context(prec=_DIGITS)
    text = ctx.divide(Decimal(value.numerator), Decimal(value.denominator)).normalize(ctx)
    return format(text, "f") if abs(text.adjusted()) < _DIGITS else str(text)


def _eval(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"unsupported literal {ast.get_source_segment(source, node)!r}")
        if isinstance(node.value, int):
            return _checked(Fraction(node.value))
        try:  # from the source text, so 0.1 is exactly 1/10 rather than the nearest binary float
            return _checked(Fraction(ast.get_source_segment(source, node).replace("_", "")))
        except (ValueError, AttributeError):
            return _checked(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, source), _eval(node.right, source)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        if type(node.op) in _BINARY:
            if right == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
                raise CalculatorError("division by zero")
            return _checked(_BINARY[type(node.op)](left, right))
        raise CalculatorError(f"unsupported operator {_SYMBOL.get(type(node.op), type(node.op).__name__)}")
    what = ast.get_source_segment(source, node) or type(node).__name__
    raise CalculatorError(f"only numbers and + - * / // % ** ( ) are allowed, not {what!r}")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:  # roots are irrational in general: floating point
        if base < 0:
            raise CalculatorError("fractional power of a negative number")
        try:
            return Fraction(repr(math.pow(base, exponent)))  # repr: no binary-expansion noise digits
        except (OverflowError, ValueError):
            raise CalculatorError("result too large") from None
    n = abs(exponent.numerator)
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    # bits of the result ~ n * bits of the base: refuse before computing (9**9**9 would take forever)
    size = max(base.numerator.bit_length(), base.denominator.bit_length())
    if n > 1 and abs(base) != 1 and (size - 1) * n > MAX_BITS:
        raise CalculatorError(f"result too large (more than {MAX_BITS} bits)")
    return base**exponent.numerator


def _checked(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise CalculatorError(f"result too large (more than {MAX_BITS} bits)")
    return value
