"""Tools for multi-turn rollouts: a sandboxed Python runner and a safe arithmetic calculator.

Not imported by `import otbrl`; use `from otbrl.tools import run_python, calculator`. A tool call site
does `run_python(code, timeout_s=2, memory_mb=256, max_output_bytes=2000).to_text()` or
`calculator(expression)`; both return text for the model and never raise.
"""

from otbrl.tools.calculator import CalculatorError, calculate, calculator
from otbrl.tools.sandbox import ToolResult, run_python

__all__ = ["CalculatorError", "ToolResult", "calculate", "calculator", "run_python"]
