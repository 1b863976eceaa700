"""The `poss` command module is imported by nothing in the package: `cli` imports the subcommand modules, never the
reverse (an import back through `importlib` is a cycle import checkers do not see)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import transformers_poss

PACKAGE_DIR = Path(transformers_poss.__file__).resolve().parent
CLI_MODULE = "transformers_poss.cli"
ALLOWED = {CLI_MODULE, "transformers_poss.__main__"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """The absolute name of `from <level dots><module> import ...` written in `importer`."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _string_value(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def imports_of_cli(source: str, importer: str, is_package: bool) -> list[str]:
    """Each place in `source` that imports transformers_poss.cli, as 'line N: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {alias.name}" for alias in node.names
                      if alias.name == CLI_MODULE or alias.name.startswith(CLI_MODULE + ".")]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node.module, node.level, importer, is_package)
            if target == CLI_MODULE or target.startswith(CLI_MODULE + "."):
                found.append(f"line {node.lineno}: from {'.' * node.level}{node.module or ''} import ...")
            elif any(f"{target}.{alias.name}" == CLI_MODULE for alias in node.names):
                found.append(f"line {node.lineno}: from {'.' * node.level}{node.module or ''} import cli")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name not in ("import_module", "__import__") or not node.args:
                continue
            first = _string_value(node.args[0])
            if first is None:
                continue
            if first.startswith("."):  # import_module(".cli", package=...)
                package = next((_string_value(k.value) for k in node.keywords if k.arg == "package"),
                               _string_value(node.args[1]) if len(node.args) > 1 else None)
                level = len(first) - len(first.lstrip("."))
                first = _resolve(first[level:], level, (package or importer) + ".x", False)
            if first == CLI_MODULE:
                found.append(f"line {node.lineno}: {name}({_string_value(node.args[0])!r})")
    return found


def test_checker_sees_every_spelling():
    spellings = ["import transformers_poss.cli", "from transformers_poss.cli import main",
                 "from transformers_poss import cli", "from ..cli import typed_command", "from .. import cli",
                 "importlib.import_module('transformers_poss.cli')", "import_module('..cli', 'transformers_poss.x')",
                 "__import__('transformers_poss.cli')"]
    for spelling in spellings:
        assert imports_of_cli(spelling, "transformers_poss.evaluation.report", False), spelling
    assert imports_of_cli("from .cli import main", "transformers_poss.tuning", False)
    assert imports_of_cli("from . import cli", "transformers_poss", True)
    # the subpackages' own `cli` modules are not the `poss` command
    assert not imports_of_cli("from .cli import add_arguments", "transformers_poss.training.pipeline", False)
    assert not imports_of_cli("from . import cli", "transformers_poss.checkpoints", True)
    assert not imports_of_cli("from .._cli_common import typed_command", "transformers_poss.tuning", False)


def test_no_module_imports_the_poss_command_module():
    offenders = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        name = _module_name(path)
        if name in ALLOWED:
            continue
        found = imports_of_cli(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")
        if found:
            offenders[name] = found
    assert not offenders, ("transformers_poss.cli imports the subcommand modules; they must not import it back "
                           f"(move what they share to transformers_poss._cli_common): {offenders}")


def test_subcommand_modules_load_without_the_poss_command_module():
    """At run time too: importing every subcommand module leaves `transformers_poss.cli` unloaded."""
    from transformers_poss.cli import SUBCOMMAND_MODULES

    code = ("import importlib, sys\n"
            f"for name in {list(SUBCOMMAND_MODULES)!r}:\n"
            "    importlib.import_module(name)\n"
            f"print({CLI_MODULE!r} in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
