#!/usr/bin/env python3
"""Fails when modules import each other in a circle, in the router and
launcher crates (Rust) or the Python packages (server/ and kernels/), or
when the shard's Python breaks its layering.

A module that imports another must not be imported by it, directly or
through others. The shard's layers, top to bottom (STYLE.md, "imports point
down"):

    batch/servicer   sluice_server.{servicer, batch, model_runner, cli}
    model            sluice_server.models.*, sluice_server.layers.*
    kernels          sluice_kernels.*

Nothing in the model layer or the kernels imports the batch/servicer layer,
directly or through other modules (a fast path that needs the batch lives
above, or is handed plain tensors), and the kernels import nothing of the
server at all. What counts as an import:

- Rust: every `crate::a::b`, `super::x` or `self::x` path in a file (in `use`
  trees and inline in code), and every bare path that starts with the name
  of one of the file's child modules (`stats::queue(..)` in `scheduler/mod.rs`),
  resolved to the file module that defines it (`a/b.rs` or `a/b/mod.rs`); a
  file's inline `mod tests { .. }` counts as the file. `mod x;` declarations are not imports, so a parent's methods
  implemented in child files (`impl Scheduler` in `scheduler/step.rs`) are
  not a circle as long as the parent does not import those children.
- Python: every `import` / `from ... import` statement of the package,
  function-level (lazy) imports included, resolved to the most specific
  module of the package it names.

    python scripts/check_import_cycles.py          # exit 1 and print each circle / breach

Run by scripts/test.sh.
"""

from __future__ import annotations

import ast
import bisect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUST_CRATES = {"router": ROOT / "router" / "src", "launcher": ROOT / "launcher" / "src"}
PYTHON_PACKAGES = [ROOT / "server" / "sluice_server", ROOT / "server" / "sluice_bench", ROOT / "kernels" / "sluice_kernels"]
# The shard's layering (module docstring): module-name prefixes.
MODEL_LAYER = ("sluice_server.models", "sluice_server.layers", "sluice_kernels")
BATCH_LAYER = ("sluice_server.servicer", "sluice_server.batch", "sluice_server.model_runner", "sluice_server.cli")
KERNELS, SERVER = "sluice_kernels", "sluice_server"

Graph = dict[str, set[str]]


# -- Rust ---------------------------------------------------------------------


def rust_modules(src: Path) -> dict[tuple[str, ...], Path]:
    """Module path (crate-relative) -> file, for the library crate rooted at lib.rs
    (or main.rs). Files under src/bin/ are separate crates and are skipped."""
    modules: dict[tuple[str, ...], Path] = {}
    for path in src.rglob("*.rs"):
        rel = path.relative_to(src)
        if rel.parts[0] == "bin":
            continue
        parts = list(rel.with_suffix("").parts)
        if parts in (["lib"], ["main"]):
            parts = []
        elif parts[-1] == "mod":
            parts = parts[:-1]
        modules[tuple(parts)] = path
    return modules


_USE = re.compile(r"\buse\s+([^;]+);", re.S)
_PATH = re.compile(r"\b((?:crate|super|self)(?:\s*::\s*(?:[A-Za-z_][A-Za-z0-9_]*|\*))+)")
_INLINE_MOD = re.compile(r"\bmod\s+\w+\s*\{")


def _expand_use_tree(tree: str) -> list[str]:
    """`crate::a::{b, c::{d, e}}` -> ["crate::a::b", "crate::a::c::d", "crate::a::c::e"]."""
    tree = re.sub(r"\s+", "", tree)
    if "{" not in tree:
        return [tree]
    head, _, rest = tree.partition("{")
    body = rest[: rest.rindex("}")]
    items, depth, current = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        current += ch
    items.append(current)
    out = []
    for item in filter(None, items):
        out.extend(_expand_use_tree(head + item))
    return out


def _blank(match: re.Match) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


def _strip_comments_and_strings(text: str) -> str:
    """Blanks comments and string/char literals, keeping every offset."""
    pattern = r'/\*.*?\*/|//[^\n]*|r#*"(?:.|\n)*?"#*|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])\''
    return re.sub(pattern, _blank, text, flags=re.S)


def _inline_depth(text: str):
    """pos -> how many inline `mod x { .. }` blocks enclose that offset."""
    opens = {m.end() - 1 for m in _INLINE_MOD.finditer(text)}
    stack: list[bool] = []
    changes: list[tuple[int, int]] = [(0, 0)]
    depth = 0
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i in opens)
            if i in opens:
                depth += 1
                changes.append((i, depth))
        elif ch == "}" and stack:
            if stack.pop():
                depth -= 1
                changes.append((i, depth))
    positions = [p for p, _ in changes]

    def at(pos: int) -> int:
        return changes[bisect.bisect_right(positions, pos) - 1][1]

    return at


def _resolve(segments: list[str], here: tuple[str, ...], modules) -> tuple[str, ...] | None:
    first, rest = segments[0], segments[1:]
    if first == "crate":
        base: tuple[str, ...] = ()
    elif first == "self":
        base = here
    else:  # super (possibly repeated)
        base = here[:-1]
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
    path = base + tuple(s for s in rest if s not in ("*", "self"))
    for n in range(len(path), -1, -1):
        if path[:n] in modules:
            return path[:n]
    return None


def rust_graph(src: Path) -> Graph:
    modules = rust_modules(src)

    def name(module: tuple[str, ...]) -> str:
        return "::".join(module) or "crate"

    graph: Graph = {name(m): set() for m in modules}
    for module, path in modules.items():
        text = _strip_comments_and_strings(path.read_text())
        depth = _inline_depth(text)
        found: list[tuple[str, int]] = []
        for use in _USE.finditer(text):
            found.extend((p, use.start()) for p in _expand_use_tree(use.group(1)))
        code = _USE.sub(_blank, text)
        for m in _PATH.finditer(code):
            found.append((m.group(1), m.start()))
        # A bare path that starts with a child module's name (`stats::queue(..)`,
        # `use kv::KvCache`) means `self::child::..`.
        children = [c[-1] for c in modules if len(c) == len(module) + 1 and c[: len(module)] == module]
        if children:
            bare = re.compile(r"(?<![\w:])(" + "|".join(map(re.escape, children)) + r")\s*::")
            for m in bare.finditer(code):
                found.append(("self::" + m.group(1), m.start()))
            for use in _USE.finditer(text):
                for p in _expand_use_tree(use.group(1)):
                    if p.split("::")[0] in children:
                        found.append(("self::" + p, use.start()))
        for p, pos in found:
            segments = [s for s in re.sub(r"\s+", "", p).split("::") if s]
            if not segments or segments[0] not in ("crate", "super", "self"):
                continue
            # Inside an inline module, `super` starts from that module.
            here = module + ("<inline>",) * depth(pos)
            target = _resolve(segments, here, modules)
            if target is not None and target != module:
                graph[name(module)].add(name(target))
    return graph


# -- Python -------------------------------------------------------------------


def python_graph(*packages: Path) -> Graph:
    """Module -> the modules it imports, over all of `packages` (imports
    between them count; others, such as torch, do not)."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in package.rglob("*.py"):
            parts = list(path.relative_to(package.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path

    def most_specific(name: str) -> str | None:
        while name:
            if name in modules:
                return name
            name = name.rpartition(".")[0]
        return None

    graph: Graph = {m: set() for m in modules}
    for me, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = me.split(".")
                    base = base[: len(base) - node.level + (1 if is_package else 0)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{alias.name}" for alias in node.names]
            for target in targets:
                found = most_specific(target)
                if found and found != me:
                    graph[me].add(found)
    return graph


# -- layering -----------------------------------------------------------------


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _import_chain(graph: Graph, start: str, bad) -> list[str] | None:
    """The shortest import chain from `start` to a module for which bad() is
    true (breadth first), or None."""
    parents: dict[str, str | None] = {start: None}
    queue = [start]
    for v in queue:
        for w in sorted(graph.get(v, ())):
            if w in parents:
                continue
            parents[w] = v
            if bad(w):
                chain = [w]
                while parents[chain[-1]] is not None:
                    chain.append(parents[chain[-1]])
                return chain[::-1]
            queue.append(w)
    return None


def layering_breaches(graph: Graph) -> list[str]:
    """Each module of the model layer that reaches the batch/servicer layer
    through its imports, and each kernels module that imports the server,
    with the chain of imports that does it."""
    found = []
    for module in sorted(graph):
        if _under(module, MODEL_LAYER):
            chain = _import_chain(graph, module, lambda m: _under(m, BATCH_LAYER))
            if chain:
                found.append("model layer imports the batch/servicer layer: " + " -> ".join(chain))
        if _under(module, (KERNELS,)):
            for target in sorted(graph[module]):
                if _under(target, (SERVER,)):
                    found.append(f"kernels import the server: {module} -> {target}")
    return found


# -- cycles -------------------------------------------------------------------


def cycles(graph: Graph) -> list[list[str]]:
    """The modules that import each other in a circle, one list per group
    (strongly connected component, Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def main() -> int:
    graphs = {f"{name} crate": rust_graph(src) for name, src in RUST_CRATES.items()}
    python = python_graph(*(p for p in PYTHON_PACKAGES if p.is_dir()))
    graphs["python " + ", ".join(p.name for p in PYTHON_PACKAGES)] = python
    failed = False
    for name, graph in graphs.items():
        found = cycles(graph)
        edges = sum(len(v) for v in graph.values())
        print(f"{name}: {len(graph)} modules, {edges} imports, {len(found)} circles")
        for component in found:
            failed = True
            print("    circle among: " + ", ".join(component))
            for v in component:
                inside = sorted(graph[v] & set(component))
                print(f"        {v} imports {', '.join(inside)}")
    breaches = layering_breaches(python)
    print(f"python layering (model layer and kernels below batch/servicer, kernels apart): {len(breaches)} breaches")
    for breach in breaches:
        failed = True
        print("    " + breach)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
