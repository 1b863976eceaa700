"""Every vLLM name, signature and call site this plugin relies on (`RELIED_ON`), and a check of a vLLM source tree
against them that reads the sources with `ast` and imports nothing: an installed vLLM, an unpacked tree, or a wheel
read in place (vLLM 0.33's GPU wheel is checked on a CPU-only machine that way).

    python -m poss_vllm.interfaces [--wheel W.whl | --source DIR | --installed] [--compare OTHER] [--json OUT]

Kinds of need:

* `Symbol(module, name, call=...)`: `module.name` resolves (through re-exports, `if TYPE_CHECKING` imports and class
  bases, e.g. `vllm.config.VllmConfig` or `vllm.ModelRegistry.register_model`); with `call=Call(n, keywords)`, a call
  with `n` positional arguments (after self) and those keywords binds to its signature (classes: their `__init__`).
* `Member(module, cls, names)`: the class (or a base) has those attributes: methods, properties, class-level or
  dataclass fields, or `self.name = ...` in one of its methods.
* `Uses(module, function, calls=..., attributes=..., strings=...)`: the function's body calls `callee(...)` with those
  keywords, reads those attributes, holds those string constants (e.g. the proposer's model-input keys). `function`
  None: the whole module.

`check(tree)` returns one `Finding` per need; `plugin_imports()` lists the `from vllm... import` names of the
plugin's own modules (a test checks each is a `Symbol` here); `fingerprints(tree)` hashes each relied-on definition's
AST, so two versions can be compared for what changed behind an unchanged name.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import sys
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

PROPOSER = "vllm.v1.spec_decode.llm_base_proposer"
PROPOSER_CLASS = "SpecDecodeBaseProposer"
SPECULATORS_BASE = "vllm.transformers_utils.configs.speculators.base"
SPECULATORS_ALGOS = "vllm.transformers_utils.configs.speculators.algos"


@dataclass(frozen=True)
class Call:
    """A call shape: `positional` arguments after self/cls, then `keywords`."""

    positional: int = 0
    keywords: tuple[str, ...] = ()


@dataclass(frozen=True)
class Symbol:
    module: str
    name: str
    why: str
    call: Call | None = None

    @property
    def label(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True)
class Member:
    module: str
    cls: str
    names: tuple[str, ...]
    why: str

    @property
    def label(self) -> str:
        return f"{self.module}.{self.cls}: {', '.join(self.names)}"


@dataclass(frozen=True)
class Uses:
    module: str
    function: str | None
    why: str
    calls: tuple[tuple[str, tuple[str, ...]], ...] = ()
    attributes: tuple[str, ...] = ()
    strings: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        parts = [f"{callee}({', '.join(k + '=' for k in keywords)})" for callee, keywords in self.calls]
        parts += [f".{name}" for name in self.attributes] + [repr(s) for s in self.strings]
        return f"{self.module}.{self.function or '<module>'} uses {', '.join(parts)}"


# ---- what the plugin relies on -----------------------------------------------------------------------------------
RELIED_ON: tuple[Symbol | Member | Uses, ...] = (
    # the version and the plugin's registrations (__init__.py)
    Symbol("vllm", "__version__", "check_vllm_version reads it"),
    Symbol("vllm", "ModelRegistry.register_model", "registers the two PosS model classes", Call(2)),
    # the speculators config types (config.py)
    Symbol("vllm.transformers_utils.configs.speculators", "algos", "the speculators type registry's module"),
    Symbol(SPECULATORS_ALGOS, "SUPPORTED_SPECULATORS_TYPES", "the 'eagle' type is added, 'eagle3' wrapped"),
    Symbol(SPECULATORS_ALGOS, "update_eagle3", "the wrapped 'eagle3' updater is called with these keywords",
           Call(0, ("config_dict", "pre_trained_config"))),
    Uses(SPECULATORS_BASE, "SpeculatorsConfig.extract_transformers_pre_trained_config",
         "vLLM calls a type's updater with these keywords", calls=(("algo_updater", ("config_dict",
                                                                                     "pre_trained_config")),)),
    Symbol(SPECULATORS_BASE, "SpeculatorsConfig.from_pretrained", "wrapped: the weights are checked on reading",
           Call(1)),
    Symbol("vllm.transformers_utils.config", "maybe_override_with_speculators",
           "wrapped: `vllm serve EXPORT` gets the export's batch-size schedule",
           Call(2, ("trust_remote_code", "revision", "vllm_speculative_config", "hf_token"))),
    Uses("vllm.engine.arg_utils", "EngineArgs.__post_init__", "plugins register before the engine config is built",
         calls=(("load_general_plugins", ()),)),
    Uses("vllm.engine.arg_utils", "EngineArgs.create_engine_config",
         "calls the wrapped function by its module-level name, user's --speculative-config as this keyword",
         calls=(("maybe_override_with_speculators", ("vllm_speculative_config",)),)),
    # the draft step (draft_index.py)
    Symbol(PROPOSER, f"{PROPOSER_CLASS}.build_per_group_and_layer_attn_metadata",
           "wrapped: tells the PosS model the draft step of its next call", Call(1, ("draft_index",))),
    Uses(PROPOSER, f"{PROPOSER_CLASS}.propose", "builds attention metadata with the draft index before each step",
         calls=(("build_per_group_and_layer_attn_metadata", ("draft_index",)),)),
    Member(PROPOSER, PROPOSER_CLASS, ("model", "load_model", "propose"), "the wrapper reads the proposer's model"),
    Member("vllm.compilation.breakable_cudagraph", "BreakableCUDAGraphWrapper", ("unwrap",),
           "the wrapper unwraps a graph-wrapped draft model"),
    Symbol("vllm.compilation.breakable_cudagraph", "is_breakable_cudagraph_enabled",
           "PosS drafters refuse a graph captured around them", Call(0)),
    # the proposer -> model protocol (model.py's forward, compute_logits, combine_hidden_states, sharing)
    Uses(PROPOSER, f"{PROPOSER_CLASS}.build_model_inputs_first_pass", "the first pass's model inputs",
         strings=("input_ids", "positions", "inputs_embeds", "hidden_states")),
    Uses(PROPOSER, f"{PROPOSER_CLASS}.propose", "the draft steps' model inputs and the EAGLE-3 fusion",
         attributes=("combine_hidden_states", "model_returns_tuple"),
         strings=("input_ids", "positions", "inputs_embeds", "hidden_states")),
    Uses(PROPOSER, f"{PROPOSER_CLASS}._greedy_sample", "draft logits", attributes=("compute_logits",)),
    Uses(PROPOSER, f"{PROPOSER_CLASS}._maybe_share_embeddings", "the target's embedding is shared",
         attributes=("has_own_embed_tokens", "embed_tokens")),
    Uses(PROPOSER, f"{PROPOSER_CLASS}._maybe_share_lm_head", "the target's lm_head is shared (EAGLE-1/2 style)",
         attributes=("has_own_lm_head", "lm_head")),
    # configs read at model build (model.py, config.py)
    Symbol("vllm.config", "VllmConfig", "the model classes' constructor argument"),
    Member("vllm.config", "VllmConfig", ("speculative_config", "model_config", "compilation_config",
                                         "use_v2_model_runner"), "read at model build"),
    Member("vllm.config.speculative", "SpeculativeConfig",
           ("method", "num_speculative_tokens", "draft_model_config", "enforce_eager",
            "num_speculative_tokens_per_batch_size"), "read at model build; the batch-size schedule"),
    Member("vllm.config.model", "ModelConfig", ("hf_config", "model", "get_total_num_hidden_layers",
                                                "get_vocab_size"), "the target's and the drafter's configs"),
    Symbol("vllm.config.model", "ModelConfig.get_total_num_hidden_layers", "layer prefixes", Call(0)),
    Symbol("vllm.config.model", "ModelConfig.get_vocab_size", "the target vocabulary", Call(0)),
    Member("vllm.config.compilation", "CompilationConfig", ("cudagraph_mode",), "graph capture check"),
    Uses("vllm.envs", None, "environment variables the plugin sets or reads (V1 model runner, graph capture)",
         strings=("VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_BREAKABLE_CUDAGRAPH")),
    Symbol("vllm.v1.spec_decode.dynamic.utils", "build_dynamic_sd_schedule_lookup",
           "how vLLM expands the batch-size schedule the export suggests",
           Call(0, ("num_speculative_tokens_per_batch_size", "vllm_max_batch_size", "vllm_num_speculative_tokens"))),
    # model building blocks (model.py)
    Symbol("vllm.forward_context", "get_forward_context", "dummy runs are told apart by their metadata", Call(0)),
    Symbol("vllm.forward_context", "is_forward_context_available", "as above", Call(0)),
    Member("vllm.forward_context", "ForwardContext", ("attn_metadata",), "as above"),
    Symbol("vllm.model_executor.layers.layernorm", "RMSNorm", "EAGLE-3 final norm", Call(1, ("eps",))),
    Symbol("vllm.model_executor.layers.layernorm", "RMSNorm.forward_native", "called as norm(hidden, residual)",
           Call(2)),
    Symbol("vllm.model_executor.models.llama", "LlamaDecoderLayer", "EAGLE-1/2 specialists subclass it",
           Call(1, ("prefix", "config"))),
    Symbol("vllm.model_executor.models.llama", "LlamaDecoderLayer.forward",
           "specialist_forward calls it as forward(positions, hidden, None)", Call(3)),
    Member("vllm.model_executor.models.llama", "LlamaDecoderLayer", ("input_layernorm", "get_quant_config"),
           "the specialist drops its input norm and quantizes as a draft layer"),
    Uses("vllm.model_executor.models.llama", "LlamaDecoderLayer.__init__",
         "the overridden get_quant_config is called while building", attributes=("get_quant_config",)),
    Symbol("vllm.model_executor.models.llama_eagle", "EagleLlamaForCausalLM", "base of PosSEagleForCausalLM"),
    Symbol("vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM",
           "base of PosSEagle3LlamaForCausalLM (the proposer asserts an EAGLE-3 model is one)"),
    Symbol("vllm.model_executor.models.llama_eagle3", "LlamaDecoderLayer", "EAGLE-3 specialists",
           Call(1, ("prefix", "config", "layer_idx"))),
    Symbol("vllm.model_executor.models.llama_eagle3", "LlamaDecoderLayer.forward", "called with these keywords",
           Call(0, ("positions", "embeds", "hidden_states", "residual"))),
    Symbol("vllm.model_executor.models.utils", "get_draft_quant_config", "draft-layer quantization", Call(1)),
    Symbol("vllm.model_executor.models.utils", "maybe_prefix", "layer prefixes", Call(2)),
)


# ---- reading a source tree ---------------------------------------------------------------------------------------
class SourceTree:
    """vLLM's Python sources, read by relative path (`vllm/config/__init__.py`), parsed once each."""

    def __init__(self, read: Callable[[str], str | None], origin: str):
        self._read, self.origin = read, origin
        self._modules: dict[str, tuple[ast.Module, bool] | None] = {}

    @classmethod
    def from_directory(cls, root: str | Path) -> "SourceTree":
        """`root` holds the `vllm` package (site-packages, an unpacked wheel)."""
        root = Path(root)
        if not (root / "vllm" / "__init__.py").is_file() and (root / "__init__.py").is_file():
            root = root.parent  # the package folder itself

        def read(relative: str) -> str | None:
            path = root / relative
            return path.read_text(encoding="utf-8") if path.is_file() else None

        return cls(read, str(root))

    @classmethod
    def from_wheel(cls, wheel: str | Path) -> "SourceTree":
        archive = zipfile.ZipFile(wheel)
        names = set(archive.namelist())

        def read(relative: str) -> str | None:
            return archive.read(relative).decode("utf-8") if relative in names else None

        return cls(read, str(wheel))

    @classmethod
    def installed(cls) -> "SourceTree":
        """The vLLM this interpreter would import (found without importing it)."""
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("vLLM is not installed in this environment")
        return cls.from_directory(Path(list(spec.submodule_search_locations)[0]).parent)

    def module(self, dotted: str) -> tuple[ast.Module, bool] | None:
        """(parsed module, is a package) or None."""
        if dotted not in self._modules:
            base = dotted.replace(".", "/")
            found = None
            for relative, package in ((base + ".py", False), (base + "/__init__.py", True)):
                text = self._read(relative)
                if text is not None:
                    found = (ast.parse(text, filename=relative), package)
                    break
            self._modules[dotted] = found
        return self._modules[dotted]

    def version(self) -> str:
        parsed = self.module("vllm._version")
        for node in ast.walk(parsed[0]) if parsed else ():
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                if any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
                    return str(node.value.value)
        return "unknown"


@dataclass
class Found:
    """A resolved name: a module, or a definition (class, function, assignment) inside `module`."""

    module: str
    node: ast.AST | None = None  # None: the module itself
    owner: "Found | None" = None  # the class a member was found in
    chain: list[str] = field(default_factory=list)  # where it was found, for messages


def _top_level(statements: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """A module's statements, with those under if/try/with at top level (TYPE_CHECKING imports, fallbacks)."""
    for statement in statements:
        yield statement
        if isinstance(statement, ast.If):
            yield from _top_level(statement.body)
            yield from _top_level(statement.orelse)
        elif isinstance(statement, ast.Try):
            for block in (statement.body, statement.orelse, statement.finalbody, *[h.body for h in
                                                                                     statement.handlers]):
                yield from _top_level(block)
        elif isinstance(statement, ast.With):
            yield from _top_level(statement.body)


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    if not level:
        return target or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


class Resolver:
    def __init__(self, tree: SourceTree):
        self.tree = tree

    def binding(self, module: str, name: str, seen: frozenset = frozenset()) -> Found | None:
        """What `name` is bound to at the top level of `module` (following imports)."""
        key = (module, name)
        if key in seen:
            return None
        seen = seen | {key}
        parsed = self.tree.module(module)
        if parsed is None:
            return None
        tree, is_package = parsed
        found = None
        for statement in _top_level(tree.body):
            if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == name:
                found = Found(module, statement, chain=[module])
            elif isinstance(statement, ast.Assign) and any(_binds(t, name) for t in statement.targets):
                found = Found(module, statement, chain=[module])
            elif isinstance(statement, ast.AnnAssign) and _binds(statement.target, name):
                found = Found(module, statement, chain=[module])
            elif isinstance(statement, ast.ImportFrom):
                for alias in statement.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, is_package, statement.level, statement.module)
                        submodule = f"{source}.{alias.name}" if source else alias.name
                        if self.tree.module(submodule) is not None:
                            found = Found(submodule, chain=[module, submodule])
                        else:
                            inner = self.binding(source, alias.name, seen)
                            if inner is not None:
                                found = Found(inner.module, inner.node, chain=[module, *inner.chain])
            elif isinstance(statement, ast.Import):
                for alias in statement.names:
                    if alias.asname == name:
                        found = Found(alias.name, chain=[module, alias.name])
            if found is not None and isinstance(found.node, (ast.ClassDef, ast.FunctionDef)):
                break  # a definition wins over an earlier fallback binding
        if found is None and is_package and self.tree.module(f"{module}.{name}") is not None:
            found = Found(f"{module}.{name}", chain=[module, f"{module}.{name}"])
        return found

    def resolve(self, module: str, dotted: str) -> Found | None:
        """`module` + `a.b.c`: modules, classes (members through bases) and instances of classes."""
        current = Found(module, chain=[module]) if self.tree.module(module) else None
        for part in dotted.split("."):
            if current is None:
                return None
            current = self.attribute(current, part)
        return current

    def attribute(self, found: Found, name: str) -> Found | None:
        node = found.node
        if node is None:  # a module
            return self.binding(found.module, name)
        if isinstance(node, ast.ClassDef):
            return self.member(found, name)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):  # an instance: X = Class(...)
            cls = self.expression(found.module, node.value.func)
            if cls is not None and isinstance(cls.node, ast.ClassDef):
                return self.member(cls, name)
        return None

    def expression(self, module: str, expr: ast.expr) -> Found | None:
        if isinstance(expr, ast.Name):
            return self.binding(module, expr.id)
        if isinstance(expr, ast.Attribute):
            base = self.expression(module, expr.value)
            return self.attribute(base, expr.attr) if base else None
        if isinstance(expr, ast.Subscript):  # Generic[...] bases
            return self.expression(module, expr.value)
        return None

    def bases(self, cls: Found) -> list[Found]:
        out = []
        for base in cls.node.bases:
            resolved = self.expression(cls.module, base)
            if resolved is not None and isinstance(resolved.node, ast.ClassDef):
                out.append(resolved)
        return out

    def member(self, cls: Found, name: str, depth: int = 0) -> Found | None:
        if depth > 20:
            return None
        node = cls.node
        for statement in node.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and statement.name == name:
                return Found(cls.module, statement, owner=cls, chain=[*cls.chain, node.name])
            if isinstance(statement, ast.AnnAssign) and _binds(statement.target, name):
                return Found(cls.module, statement, owner=cls, chain=[*cls.chain, node.name])
            if isinstance(statement, ast.Assign) and any(_binds(t, name) for t in statement.targets):
                return Found(cls.module, statement, owner=cls, chain=[*cls.chain, node.name])
        for statement in node.body:  # instance attributes: self.name = ... in a method
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(statement):
                    targets = sub.targets if isinstance(sub, ast.Assign) else (
                        [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else [])
                    for target in targets:
                        if (isinstance(target, ast.Attribute) and target.attr == name
                                and isinstance(target.value, ast.Name) and target.value.id == "self"):
                            return Found(cls.module, sub, owner=cls, chain=[*cls.chain, node.name])
        for base in self.bases(cls):
            inherited = self.member(base, name, depth + 1)
            if inherited is not None:
                return inherited
        return None


def _binds(target: ast.expr, name: str) -> bool:
    if isinstance(target, ast.Name):
        return target.id == name
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_binds(t, name) for t in target.elts)
    return False


def _decorators(node: ast.AST) -> set[str]:
    names = set()
    for decorator in getattr(node, "decorator_list", ()):
        if isinstance(decorator, ast.Name):
            names.add(decorator.id)
        elif isinstance(decorator, ast.Attribute):
            names.add(decorator.attr)
    return names


def bind_call(function: ast.FunctionDef, call: Call, method: bool) -> str | None:
    """Why a call of shape `call` does not bind to `function`'s signature, or None when it does."""
    arguments = function.args
    positional = [a.arg for a in arguments.posonlyargs + arguments.args]
    if method and "staticmethod" not in _decorators(function):
        positional = positional[1:]
    defaults = len(arguments.defaults)
    required = set(positional[: len(positional) - defaults] if defaults else positional)
    required |= {a.arg for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults) if d is None}
    if call.positional > len(positional) and arguments.vararg is None:
        return f"takes {len(positional)} positional arguments, the plugin passes {call.positional}"
    bound = set(positional[: call.positional])
    keyword_names = set(positional[call.positional:]) | {a.arg for a in arguments.kwonlyargs}
    posonly = {a.arg for a in arguments.posonlyargs}
    for keyword in call.keywords:
        if keyword in bound:
            return f"{keyword!r} would be given twice"
        if keyword in posonly or (keyword not in keyword_names and arguments.kwarg is None):
            return f"has no keyword parameter {keyword!r}"
        bound.add(keyword)
    missing = sorted(required - bound)
    if missing:
        return f"requires {missing}, which the plugin does not pass"
    return None


def signature_text(function: ast.FunctionDef) -> str:
    return f"{function.name}({ast.unparse(function.args)})"


@dataclass
class Finding:
    need: Symbol | Member | Uses
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.need.label}: {self.detail}"


def _function(resolver: Resolver, module: str, qualname: str | None) -> tuple[ast.AST | None, str]:
    if qualname is None:
        parsed = resolver.tree.module(module)
        return (parsed[0] if parsed else None), module
    found = resolver.resolve(module, qualname)
    if found is None or not isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None, f"{module}.{qualname}"
    return found.node, ".".join(found.chain)


def check_need(resolver: Resolver, need: Symbol | Member | Uses) -> Finding:
    if isinstance(need, Symbol):
        found = resolver.resolve(need.module, need.name)
        if found is None:
            return Finding(need, False, "not found")
        where = " -> ".join(found.chain)
        if need.call is None:
            return Finding(need, True, f"found ({where})")
        function, method = found.node, found.owner is not None
        if isinstance(function, ast.ClassDef):
            init = resolver.member(found, "__init__")
            if init is None or not isinstance(init.node, ast.FunctionDef):
                return Finding(need, False, f"{where}: no __init__ to check the call against")
            function, method = init.node, True
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Finding(need, False, f"{where}: not a function or class")
        problem = bind_call(function, need.call, method)
        signature = signature_text(function)
        return Finding(need, problem is None, f"{signature}" + (f": {problem}" if problem else ""))
    if isinstance(need, Member):
        cls = resolver.resolve(need.module, need.cls)
        if cls is None or not isinstance(cls.node, ast.ClassDef):
            return Finding(need, False, f"class {need.cls} not found")
        missing = [name for name in need.names if resolver.member(cls, name) is None]
        return Finding(need, not missing, f"missing {missing}" if missing else "all present")
    node, where = _function(resolver, need.module, need.function)
    if node is None:
        return Finding(need, False, f"{where} not found")
    problems = []
    for callee, keywords in need.calls:
        calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and (
            (isinstance(c.func, ast.Attribute) and c.func.attr == callee)
            or (isinstance(c.func, ast.Name) and c.func.id == callee))]
        if not calls:
            problems.append(f"no call to {callee}")
        elif not any(set(keywords) <= {k.arg for k in c.keywords} for c in calls):
            problems.append(f"no call to {callee} with keywords {list(keywords)}")
    attributes = {a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute)}
    problems += [f"no .{name}" for name in need.attributes if name not in attributes]
    strings = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    problems += [f"no {s!r}" for s in need.strings if s not in strings]
    return Finding(need, not problems, "; ".join(problems) if problems else f"as relied on ({where})")


def check(tree: SourceTree, needs: Iterable = RELIED_ON) -> list[Finding]:
    resolver = Resolver(tree)
    return [check_need(resolver, need) for need in needs]


def fingerprints(tree: SourceTree, needs: Iterable = RELIED_ON) -> dict[str, str]:
    """label -> short hash of the AST of what each need resolves to (the function for `Uses`, the definition
    otherwise), so two versions can be compared for changes behind unchanged names."""
    resolver, out = Resolver(tree), {}
    for need in needs:
        if isinstance(need, Uses):
            node, _ = _function(resolver, need.module, need.function)
        elif isinstance(need, Member):
            found = resolver.resolve(need.module, need.cls)
            node = found.node if found else None
        else:
            found = resolver.resolve(need.module, need.name)
            node = found.node if found else None
        text = ast.dump(node, include_attributes=False) if node is not None else ""
        out[need.label] = hashlib.sha256(text.encode()).hexdigest()[:12] if text else "missing"
    return out


def plugin_imports(package: Path | None = None) -> list[tuple[str, str]]:
    """(module, name) of every `from vllm... import name` in the plugin's own modules."""
    package = package or Path(__file__).resolve().parent
    out = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                out += [(node.module, alias.name) for alias in node.names]
    return sorted(set(out))


def report(tree: SourceTree, compare: SourceTree | None = None) -> dict:
    findings = check(tree)
    result = {"origin": tree.origin, "version": tree.version(), "needs": len(findings),
              "failed": [f.line() for f in findings if not f.ok], "findings": [f.line() for f in findings]}
    if compare is not None:
        ours, theirs = fingerprints(tree), fingerprints(compare)
        result["compared_with"] = {"origin": compare.origin, "version": compare.version(),
                                   "changed": sorted(k for k in ours if ours[k] != theirs.get(k)),
                                   "unchanged": sum(ours[k] == theirs.get(k) for k in ours)}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--wheel", help="a vLLM wheel, read in place")
    source.add_argument("--source", help="a folder holding the vllm package")
    source.add_argument("--installed", action="store_true", help="the vLLM of this interpreter (default)")
    parser.add_argument("--compare", help="another wheel or folder: list the relied-on definitions that differ")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)

    def open_tree(location: str | None) -> SourceTree:
        if location is None:
            return SourceTree.installed()
        return SourceTree.from_wheel(location) if location.endswith(".whl") else SourceTree.from_directory(location)

    tree = open_tree(args.wheel or args.source)
    result = report(tree, open_tree(args.compare) if args.compare else None)
    print(f"vLLM {result['version']} ({result['origin']}): {result['needs'] - len(result['failed'])}/"
          f"{result['needs']} needs met")
    for line in result["findings"]:
        print("  " + line)
    if "compared_with" in result:
        other = result["compared_with"]
        print(f"against vLLM {other['version']}: {other['unchanged']} definitions identical, changed:")
        for label in other["changed"]:
            print("  " + label)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
