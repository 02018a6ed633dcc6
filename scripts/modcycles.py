#!/usr/bin/env python3
"""No import cycle between the modules of any crate (issue 24).

For every crate under crates/ (and fuzz/ is not one), each module file
(src/lib.rs or src/main.rs is the root, src/a.rs and src/a/mod.rs are `a`,
src/a/b.rs is `a::b`) is a node. An edge A -> B is any path in A's code
(comments and string literals left out) that names module B or an item in
it: `crate::b::...`, `super::...`, `self::...`, or a child module's name
(`b::x`, `use b::{...}`). Inline modules (`mod tests { ... }`) count as
their file. A path to an item of the crate root that the root imports
(`pub use error::Error`) counts as a path to the module it comes from.
Paths between a module and its own ancestors are left out: the crate root
(lib.rs, main.rs) and a directory module (a/mod.rs) declare their children
and hold their common face (types, re-exports), which the children use; the
loops that matter are between modules side by side. Test code (`#[cfg(test)]
mod tests { ... }` and modules declared `#[cfg(test)] mod x;`) is left out.

Prints every cycle (one per strongly connected component of more than one
module) and exits 1 if there is any. Usage: scripts/modcycles.py [ROOT]
"""

import os
import re
import sys


def strip(text):
    """Code without comments, string and char literals (kept the same length of lines)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    out.append("\n" if text[i] == "\n" else "")
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + len(m.group(0)))
            i = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and re.match(r"'(\\.|[^\\'])'|'\\u\{[0-9a-fA-F]+\}'|'\\x[0-9a-fA-F]{2}'", text[i:i + 12]):
            m = re.match(r"'(\\.|[^\\'])'|'\\u\{[0-9a-fA-F]+\}'|'\\x[0-9a-fA-F]{2}'", text[i:i + 12])
            i += len(m.group(0))
            out.append("' '")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def modules(src):
    """{module path tuple: file} of one crate's src directory."""
    found = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src)
            parts = rel[:-3].split(os.sep)
            if parts in (["lib"], ["main"]):
                parts = []
            elif parts[-1] == "mod":
                parts = parts[:-1]
            found[tuple(parts)] = os.path.join(dirpath, f)
    return found


PATH = re.compile(r"\b((?:crate|super|self|[A-Za-z_][A-Za-z0-9_]*)(?:\s*::\s*(?:[A-Za-z_][A-Za-z0-9_]*|\{[^;]*?\}|\*))+)")
USE = re.compile(r"\buse\s+([^;]+);")


def expand(path):
    """`a::{b, c::d}` -> [a::b, a::c::d] (nested groups too)."""
    path = re.sub(r"\s+as\s+", "@", path)
    path = re.sub(r"\s+", "", path)
    m = re.search(r"\{", path)
    if not m:
        return [path]
    head = path[:m.start()]
    depth, end = 0, None
    for k in range(m.start(), len(path)):
        depth += {"{": 1, "}": -1}.get(path[k], 0)
        if depth == 0:
            end = k
            break
    inner, rest = path[m.start() + 1:end], path[end + 1:]
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        cur += ch
    parts.append(cur)
    out = []
    for p in parts:
        if p:
            out.extend(expand(head + p + rest))
    return out


def root_imports(code):
    """{name: path} of what the crate root imports (`use a::B;`, `pub use a::{B as C};`)."""
    names = {}
    for m in USE.finditer(code):
        for p in expand(m.group(1)):
            segs = p.split("::")
            original, _, alias = segs[-1].partition("@")
            if original in ("*", "self"):
                continue
            name = alias or original
            segs = segs[:-1] + [original]
            names[name] = segs
    return names


def crate_edges(src):
    mods = modules(src)
    texts = {m: strip(open(f, encoding="utf-8").read()) for m, f in mods.items()}
    imports = root_imports(texts.get((), ""))

    def resolve(start, segs, seen=()):
        """The file module a path from module `start` names, or None if outside the crate."""
        if not segs:
            return None
        if segs[0] == "crate":
            cur, segs = (), segs[1:]
        elif segs[0] in ("super", "self"):
            cur = start
            while segs and segs[0] in ("super", "self"):
                if segs[0] == "super":
                    cur = cur[:-1]
                segs = segs[1:]
        elif start + (segs[0],) in mods:
            cur = start
        else:
            return None
        best = cur
        for s in segs:
            if cur + (s,) in mods:
                cur = cur + (s,)
                best = cur
            else:
                if cur == () and s in imports and s not in seen:
                    target = resolve((), imports[s], seen + (s,))
                    if target is not None:
                        return target
                break
        return best

    tests = test_modules(texts)
    edges = {m: set() for m in mods if m not in tests}
    for m, code in texts.items():
        if m in tests:
            continue
        code = without_tests(code)
        for match in PATH.finditer(code):
            for p in expand(match.group(1)):
                segs = [s.partition("@")[0] for s in p.split("::") if s]
                if not segs or segs[0] in ("std", "core", "alloc"):
                    continue
                target = resolve(m, segs)
                if target is None or target in tests or related(m, target):
                    continue
                edges[m].add(target)
    return mods, edges


TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")
TEST_BLOCK = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{")


def test_modules(texts):
    """File modules declared `#[cfg(test)] mod x;` (and what is under them)."""
    out = set()
    for m, code in texts.items():
        for t in TEST_MOD.finditer(code):
            out.add(m + (t.group(1),))
    return {m for m in texts if any(m[:len(t)] == t for t in out)}


def without_tests(code):
    """The code without its inline `#[cfg(test)] mod x { ... }` blocks."""
    while True:
        m = TEST_BLOCK.search(code)
        if not m:
            return code
        depth, k = 0, m.end() - 1
        while k < len(code):
            depth += {"{": 1, "}": -1}.get(code[k], 0)
            if depth == 0:
                break
            k += 1
        code = code[:m.start()] + code[k + 1:]


def related(a, b):
    """One module is the other's ancestor: a directory module (and the crate
    root) declares its children and holds their common face, as the root does."""
    return a[:len(b)] == b or b[:len(a)] == a


def cycles(edges):
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def name(m):
    return "::".join(m) or "(root)"


def self_test():
    """The checker finds a loop through `crate::`, `super::` and a child's
    name, and leaves out test code and paths to ancestors."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "src")
        os.makedirs(os.path.join(src, "b"))
        files = {
            "lib.rs": "mod a;\nmod b;\nmod c;\n#[cfg(test)]\nmod t;\npub use a::A;\n",
            "a.rs": "// crate::c::X in a comment\nuse crate::b::leaf::L;\npub struct A;\nconst S: &str = \"crate::c\";\n",
            "b/mod.rs": "pub mod leaf;\nuse crate::A;\n",
            "b/leaf.rs": "pub struct L(super::super::c::C);\nfn f() -> super::Y { todo!() }\n",
            "c.rs": "pub struct C;\n#[cfg(test)]\nmod tests {\n    use crate::a::A;\n}\nfn g() { crate::t::x(); }\n",
            "t.rs": "use crate::a::A;\n",
        }
        for f, text in files.items():
            with open(os.path.join(src, f), "w") as out:
                out.write(text)
        mods, edges = crate_edges(src)
        got = {name(a): sorted(name(b) for b in bs) for a, bs in edges.items()}
        want = {"(root)": [], "a": ["b::leaf"], "b": ["a"], "b::leaf": ["c"], "c": []}
        assert got == want, got
        assert cycles(edges) == [], cycles(edges)
        with open(os.path.join(src, "c.rs"), "a") as out:
            out.write("use super::b::leaf;\n")
        assert [[name(m) for m in c] for c in cycles(crate_edges(src)[1])] == [["b::leaf", "c"]]
    print("modcycles self-test: ok")


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    crates = os.path.join(root, "crates")
    bad = 0
    for crate in sorted(os.listdir(crates)):
        src = os.path.join(crates, crate, "src")
        if not os.path.isdir(src):
            continue
        mods, edges = crate_edges(src)
        found = cycles(edges)
        for comp in found:
            bad += 1
            inside = set(comp)
            links = [f"{name(a)} -> {name(b)}" for a in comp for b in sorted(edges[a]) if b in inside]
            print(f"{crate}: import cycle among {', '.join(name(m) for m in comp)}: {'; '.join(links)}")
        if not found:
            print(f"{crate}: {len(mods)} modules, no import cycle")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
