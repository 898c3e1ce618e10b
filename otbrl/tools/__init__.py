"""Tools for multi-turn rollouts: a sandboxed Python runner and a safe arithmetic calculator.

Not imported by `import otbrl`; use `from otbrl.tools import run_python, calculator`.
"""

from otbrl.tools.sandbox import ToolResult, run_python

__all__ = ["ToolResult", "run_python"]
