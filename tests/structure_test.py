"""No function in tfdist/, models/ or flags/ is longer than
`MAX_FUNCTION_LINES` code lines (issue 43: "no function over 60 code
lines").

Code lines are the lines of a function from its `def` to its end, less
blank lines, comment lines and the lines of docstrings (its own and those
of the functions and classes inside it); a nested function's lines count
in the function around it too.
"""

import ast
import io
import os
import tempfile
import tokenize

from absl.testing import absltest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tfdist", "models", "flags")
MAX_FUNCTION_LINES = 60


def _comment_lines(source: str) -> set:
  """Line numbers that hold only a comment."""
  lines = set()
  code = set()
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      lines.add(token.start[0])
    elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
      code.update(range(token.start[0], token.end[0] + 1))
  return lines - code


def _docstring_lines(tree: ast.AST) -> set:
  """Line numbers of every docstring (module, class, function)."""
  lines = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
          and isinstance(first.value.value, str)):
        lines.update(range(first.lineno, first.end_lineno + 1))
  return lines


def function_lengths(source: str) -> dict:
  """`{qualified name: code lines}` of every function in `source`."""
  tree = ast.parse(source)
  text = source.split("\n")
  skipped = _comment_lines(source) | _docstring_lines(tree)
  out = {}

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        name = f"{prefix}{child.name}"
        out[name] = sum(
            1 for n in range(child.lineno, child.end_lineno + 1)
            if n not in skipped and text[n - 1].strip())
        visit(child, name + ".")
      elif isinstance(child, ast.ClassDef):
        visit(child, f"{prefix}{child.name}.")
      else:
        visit(child, prefix)

  visit(tree, "")
  return out


def long_functions(root: str = ROOT, limit: int = MAX_FUNCTION_LINES) -> dict:
  """`{"path:name": code lines}` of the functions over `limit`."""
  found = {}
  for package in PACKAGES:
    for folder, dirs, names in os.walk(os.path.join(root, package)):
      dirs[:] = sorted(d for d in dirs if d != "__pycache__")
      for name in sorted(names):
        if not name.endswith(".py"):
          continue
        path = os.path.join(folder, name)
        with open(path) as f:
          source = f.read()
        rel = os.path.relpath(path, root)
        for function, lines in function_lengths(source).items():
          if lines > limit:
            found[f"{rel}:{function}"] = lines
  return found


class FunctionLengthTest(absltest.TestCase):

  def test_no_function_over_the_limit(self):
    found = long_functions()
    self.assertEqual(sorted(found), [], "functions over "
                     f"{MAX_FUNCTION_LINES} code lines: split them:\n" +
                     "\n".join(f"{n} ({found[n]} lines)"
                                for n in sorted(found)))

  def test_counts_code_lines_only(self):
    source = (
        "def f(x):\n"
        "  \"\"\"Docstring,\n\n  three lines.\"\"\"\n"
        "  # A comment.\n"
        "\n"
        "  y = x  # Code with a comment.\n"
        "  def g():\n"
        "    '''Nested docstring.'''\n"
        "    return '''a\n"
        "# not a comment: inside a string\n"
        "'''\n"
        "  return g\n"
        "class C:\n"
        "  def m(self):\n"
        "    pass\n")
    self.assertEqual(function_lengths(source),
                     {"f": 7, "f.g": 4, "C.m": 2})

  def test_a_long_function_is_found(self):
    root = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    os.makedirs(os.path.join(root, PACKAGES[0]))
    body = "".join(f"  x{i} = {i}\n" for i in range(59))
    with open(os.path.join(root, PACKAGES[0], "m.py"), "w") as f:
      # 60 code lines (the limit), then 61.
      f.write(f"def short():\n{body}\ndef long():\n{body}  return x0\n")
    self.assertEqual(long_functions(root),
                     {os.path.join(PACKAGES[0], "m.py") + ":long": 61})


if __name__ == "__main__":
  absltest.main()
