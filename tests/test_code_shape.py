"""The model code stays readable: no function in glmjax/model/ is longer than a screen (60 lines, issue 48), so
each path reads from start to finish."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 60


def long_functions(folder: str, most: int = MAX_LINES) -> list[str]:
    """'file:line name (n lines)' of every function or method in folder/*.py longer than `most` lines."""
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > most:
                        out.append(f"{name}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_model_function_is_longer_than_a_screen():
    assert long_functions(os.path.join(ROOT, "glmjax", "model")) == []
    assert long_functions(os.path.join(ROOT, "glmjax", "model"), 40)  # the check sees functions (negative control)
