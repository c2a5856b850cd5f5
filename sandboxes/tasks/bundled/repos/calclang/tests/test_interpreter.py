import pytest

from calclang import CalcRuntimeError, run


def test_arithmetic_and_printing():
    assert run("print(1 + 2 * 3, 7 / 2, 4 / 2, 7 % 3, 2 ** 10, -2 ** 2);") == ["7 3.5 2.0 1 1024 -4"]


def test_strings():
    assert run('let s = "ab" + "cd"; print(s, len(s), str(12) + "!");') == ["abcd 4 12!"]


def test_booleans_nil_and_logic():
    assert run("print(true and 3, nil or 0, false or \"x\", not 0);") == ["3 0 x true"]


def test_if_else():
    source = """
    fn sign(n) {
        if (n < 0) { return -1; } else { if (n == 0) { return 0; } }
        return 1;
    }
    print(sign(-5), sign(0), sign(9));
    """
    assert run(source) == ["-1 0 1"]


def test_while_loop():
    source = "let i = 0; let total = 0; while (i < 5) { total = total + i; i = i + 1; } print(total);"
    assert run(source) == ["10"]


def test_recursion():
    source = "fn fib(n) { if (n < 2) { return n; } return fib(n - 1) + fib(n - 2); } print(fib(15));"
    assert run(source) == ["610"]


def test_block_scope_shadows():
    assert run("let x = 1; { let x = 2; print(x); } print(x);") == ["2", "1"]


def test_functions_are_values():
    assert run("fn twice(f, x) { return f(f(x)); } fn inc(n) { return n + 1; } print(twice(inc, 5));") == ["7"]


def test_runtime_errors():
    with pytest.raises(CalcRuntimeError, match="line 1: division by zero"):
        run("print(1 / 0);")
    with pytest.raises(CalcRuntimeError, match="not declared"):
        run("x = 1;")
    with pytest.raises(CalcRuntimeError, match="already declared"):
        run("let x = 1; let x = 2;")
    with pytest.raises(CalcRuntimeError, match="cannot apply"):
        run('print("a" - 1);')
    with pytest.raises(CalcRuntimeError, match="takes 1 argument"):
        run("fn f(a) { return a; } f(1, 2);")


def test_runaway_recursion_is_stopped():
    with pytest.raises(CalcRuntimeError, match="too much recursion"):
        run("fn f(n) { return f(n + 1); } f(0);")
