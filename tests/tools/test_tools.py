"""The calculator tool and the ordinary (non-hostile) behaviour of `run_python`."""

import os
import sys
import threading
from fractions import Fraction

import pytest

from otbrl.tools import CalculatorError, ToolResult, calculate, calculator, run_python

# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 * (3 + 4.5)", "15"),
        ("0.1 + 0.2", "0.3"),  # exact: not 0.30000000000000004
        ("1/3", "0.33333333333333333333"),
        ("-2**2", "-4"),
        ("(-2)**2", "4"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2**-2", "0.25"),
        ("2**0.5", "1.4142135623730951"),
        ("1_000 + 1", "1001"),
        ("3.0", "3"),
        ("+5 - -5", "10"),
        ("12345678901234567890 * 98765432109876543210", str(12345678901234567890 * 98765432109876543210)),
    ],
)
def test_calculator_values(expression, expected):
    assert calculator(expression) == expected


def test_evaluate_is_exact():
    assert calculate("1/3 + 1/6") == Fraction(1, 2)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9**9**9", "too large"),  # refused before computing: this must return at once
        ("10**2000", "too large"),
        ("(10**1000) * (10**1000)", "too large"),
        ("2^3", "use ** for powers"),
        ("__import__('os').system('true')", "only numbers"),
        ("x + 1", "only numbers"),
        ("'a' * 3", "unsupported literal"),
        ("1j", "unsupported literal"),
        ("(-8) ** (1/3)", "negative"),
        ("2 +", "not a valid expression"),
        ("(" * 300 + "1" + ")" * 300, "not a valid expression"),
        ("1" * 2000, "longer than"),
    ],
)
def test_calculator_errors_are_text(expression, message):
    text = calculator(expression)
    assert text.startswith("Error: ") and message in text
    with pytest.raises(CalculatorError):
        calculate(expression)


def test_calculator_never_raises_on_non_strings():
    assert calculator(None).startswith("Error: ")  # type: ignore[arg-type]


# ---------------------------------------------------------------- run_python, ordinary use

pytestmark_linux = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux-only")


@pytestmark_linux
def test_hello_world():
    result = run_python("print('hello', 6 * 7)", timeout_s=5)
    assert isinstance(result, ToolResult)
    assert result.ok and result.exit_code == 0 and result.limit_hit is None
    assert result.stdout == "hello 42\n" and result.stderr == ""
    assert result.to_text() == "hello 42"


@pytestmark_linux
def test_exception_is_reported_with_traceback_and_exit_code():
    result = run_python("print('before')\n1/0", timeout_s=5)
    assert result.exit_code == 1 and not result.ok
    assert "ZeroDivisionError" in result.stderr
    text = result.to_text()
    assert text.startswith("before") and "ZeroDivisionError" in text and "[exit code 1]" in text


@pytestmark_linux
def test_no_output_text():
    assert run_python("x = 1", timeout_s=5).to_text() == "(no output)"


@pytestmark_linux
def test_working_directory_is_private_writable_and_removed():
    code = "import os\nopen('f.txt', 'w').write('data')\nprint(os.getcwd())\nprint(open('f.txt').read())"
    result = run_python(code, timeout_s=5)
    assert result.ok, result.to_text()
    workdir, content = result.stdout.split()
    assert content == "data"
    assert os.path.basename(workdir) == "work" and not os.path.exists(os.path.dirname(workdir))


@pytestmark_linux
def test_stdlib_imports_work():
    result = run_python("import math, fractions, json, re, itertools\nprint(math.comb(10, 3))", timeout_s=5)
    assert result.stdout == "120\n", result.to_text()


@pytestmark_linux
def test_to_text_keeps_stderr_tail_within_budget():
    code = "print('x' * 2900)\nraise ValueError('the real problem')"
    result = run_python(code, timeout_s=5, max_output_bytes=3000)
    assert result.limit_hit is None and len(result.stdout) + len(result.stderr) > 3000
    text = result.to_text()
    assert "the real problem" in text and "output truncated" in text
    assert len(text) < 3000 + 100


@pytestmark_linux
@pytest.mark.parametrize("bad", [{"timeout_s": 0}, {"memory_mb": -1}, {"max_output_bytes": 0}])
def test_bad_arguments_give_an_error_result_not_an_exception(bad):
    result = run_python("print(1)", **bad)
    assert result.error is not None and result.to_text().startswith("[sandbox error]")


@pytestmark_linux
def test_non_string_code_gives_an_error_result():
    assert run_python(b"print(1)").error is not None  # type: ignore[arg-type]


@pytestmark_linux
def test_concurrent_calls_get_their_own_results():
    n = 6
    results: list[ToolResult | None] = [None] * n

    def call(i: int) -> None:
        code = f"import os, time\nopen('mine', 'w').write('{i}')\ntime.sleep(0.2)\nprint(open('mine').read())"
        results[i] = run_python(code, timeout_s=10)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, result in enumerate(results):
        assert result is not None and result.ok, result and result.to_text()
        assert result.stdout == f"{i}\n"


def test_import_otbrl_does_not_import_the_tools():
    # statically, because a fresh `import otbrl` (torch) costs seconds: the package must not import tools
    import ast
    from pathlib import Path

    import otbrl

    tree = ast.parse(Path(otbrl.__file__).read_text())
    imported = [getattr(n, "module", None) or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [
        f"{m}.{a.name}"
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        for m in [n.module or ""]
        for a in n.names
    ]
    assert imported and not any("tools" in name for name in imported)
