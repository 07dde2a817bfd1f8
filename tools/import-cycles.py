#!/usr/bin/env python3
"""Fails when the files of src/ (the library) import each other in a cycle, or against the layers,
or when a public type's methods are declared in more than one file.

The layers, top to bottom (a file may import from its own layer's module or from below, never from
above, and the four domain modules never from each other):

    lib.rs, testkit        the crate's front door and the test rig
    runner, error          what spans the modules: the GC runner, the umbrella error
    obt quota ratelimit queue   the domain modules, side by side
    txn                    transactions and the GC
    repo                   documents, holds, schemas, the store
    server                 what the deployment is and what time it is there
    retry, collections, error_kind, metrics   pacing of retries; collection names; kinds of
                           failure; the metrics every layer records

So a name is imported from the module that defines it, not through the crate root's re-exports
(`crate::Store` below lib.rs is an arrow up to lib.rs), and a module that needs a sibling's
constant finds it lower down.

A file's imports are the `crate::a::b` paths it names (in `use` items or inline), each resolved to
the file that defines that module (`src/a/b.rs` or `src/a/b/mod.rs`, else the nearest existing
parent). A `mod.rs` is the module's front door: its re-exports point at its children, so edges into
a `mod.rs` are followed to the child the name comes from when the path names one, and edges from
a `mod.rs` to its own children are not counted (declaring children is not depending on them).
Prints every cycle found (as file lists) and exits 1 if there is one.
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
ROOT = os.path.normpath(ROOT)


def module_files():
    files = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = os.path.relpath(dirpath, ROOT)
        if rel.split(os.sep)[0] == "bin":
            continue
        for f in filenames:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(dirpath, f)
            parts = [] if rel == "." else rel.split(os.sep)
            if f == "lib.rs":
                mod = ()
            elif f == "mod.rs":
                mod = tuple(parts)
            else:
                mod = tuple(parts + [f[:-3]])
            files[mod] = os.path.relpath(path, ROOT)
    return files


def strip_comments_and_tests(text):
    # Unit tests may import anything of their parent; they are not part of the graph.
    text = re.split(r"#\[cfg\(test\)\]\s*mod\s+tests\s*\{", text)[0]
    text = re.sub(r"//[^\n]*", "", text)
    return text


USE = re.compile(r"\buse\s+crate::([^;]+);", re.S)
INLINE = re.compile(r"\bcrate::([a-z_][a-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*)")


def expand(tree):
    """`a::{b, c::{d}}` → ["a::b", "a::c::d"]."""
    tree = re.sub(r"\s+as\s+[A-Za-z0-9_]+", "", tree)
    tree = re.sub(r"\s+", "", tree)
    out = []

    def walk(prefix, s):
        depth, start, items = 0, 0, []
        for i, ch in enumerate(s):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                items.append(s[start:i])
                start = i + 1
        items.append(s[start:])
        for item in items:
            if not item:
                continue
            if "{" in item:
                head, rest = item.split("{", 1)
                walk(prefix + head, rest[:-1])
            else:
                out.append(prefix + item)
    walk("", tree)
    return out


REEXPORT = re.compile(r"\bpub(?:\([^)]*\))?\s+use\s+([a-z_][a-z0-9_]*)::([^;]+);", re.S)


def reexports(files):
    """For each front door (`mod.rs`, `lib.rs` excluded), the names it re-exports from its own
    children: {(module, name): child module}."""
    out = {}
    for mod, rel in files.items():
        if not rel.endswith("mod.rs"):
            continue
        with open(os.path.join(ROOT, rel)) as fh:
            text = strip_comments_and_tests(fh.read())
        for m in REEXPORT.finditer(text):
            child = mod + (m.group(1),)
            if child not in files:
                continue
            for item in expand(m.group(2)):
                name = item.split("::")[-1]
                out[(mod, name)] = resolve(files, "::".join(child + tuple(item.split("::"))))
    return out


def resolve(files, path, exported=None):
    parts = [p for p in path.split("::") if p and p != "self"]
    for n in range(len(parts), -1, -1):
        mod = tuple(parts[:n])
        if mod in files:
            # A name a front door re-exports from one of its children is that child's.
            if exported and n < len(parts) and (mod, parts[n]) in exported:
                return exported[(mod, parts[n])]
            return mod
    return ()


def graph():
    files = module_files()
    exported = reexports(files)
    edges = {m: set() for m in files}
    for mod, rel in files.items():
        with open(os.path.join(ROOT, rel)) as fh:
            text = strip_comments_and_tests(fh.read())
        paths = []
        for m in USE.finditer(text):
            paths.extend(expand(m.group(1)))
        paths.extend(m.group(1) for m in INLINE.finditer(USE.sub("", text)))
        for p in paths:
            target = resolve(files, p, exported)
            if target == mod:
                continue
            # A module's front door declaring or re-exporting its own children.
            if target[: len(mod)] == mod and rel.endswith(("mod.rs", "lib.rs")):
                continue
            edges[mod].add(target)
    return files, edges


def cycles(edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
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
                out.append(comp)

    for v in edges:
        if v not in index:
            strong(v)
    return out


LAYERS = [
    {"", "testkit"},
    {"runner", "error"},
    {"obt", "quota", "ratelimit", "queue"},
    {"txn"},
    {"repo"},
    {"server"},
    {"retry", "collections", "error_kind", "metrics"},
]
PEERS = LAYERS[2]


def layer(mod):
    top = mod[0] if mod else ""
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise SystemExit(f"src/{'/'.join(mod)}: module {top!r} is in no layer of tools/import-cycles.py")


def upward(files, edges):
    """Every import that runs up the layers or across the domain modules, as (from, to) files."""
    found = []
    for mod, targets in edges.items():
        for target in targets:
            up = layer(target) < layer(mod)
            across = (
                layer(mod) == layer(target) == 2 and mod[0] in PEERS and target[0] != mod[0]
            )
            if up or across:
                found.append((files[mod], files[target]))
    return sorted(found)


PUBLIC_TYPE = re.compile(r"^pub (?:struct|enum) ([A-Z][A-Za-z0-9_]*)", re.M)
INHERENT = re.compile(r"^impl(?:<[^>{]*>)? ([A-Z][A-Za-z0-9_]*)(?:<[^>{]*>)?\s*(?:where\b|\{)", re.M)


def scattered(files):
    """Public types (of the library, the rig aside) whose methods are declared in more than one
    file: {type: [files]}. One place per type: a method is found in the type's home file."""
    public, impls = set(), {}
    for mod, rel in files.items():
        if mod[:1] == ("testkit",):
            continue
        with open(os.path.join(ROOT, rel)) as fh:
            text = strip_comments_and_tests(fh.read())
        public.update(PUBLIC_TYPE.findall(text))
        for name in INHERENT.findall(text):
            impls.setdefault(name, set()).add(rel)
    return {t: sorted(fs) for t, fs in impls.items() if t in public and len(fs) > 1}, len(public)


def main():
    files, edges = graph()
    found = cycles(edges)
    against = upward(files, edges)
    spread, n_public = scattered(files)
    n_edges = sum(len(e) for e in edges.values())
    for source, target in against:
        print(f"import against the layers: {source} -> {target}")
    for name, where in sorted(spread.items()):
        print(f"methods of {name} declared in {len(where)} files: {', '.join(where)}")
    if not found and not against and not spread:
        print(
            f"import graph of src/: {len(files)} files, {n_edges} edges, no cycle, "
            f"none against the {len(LAYERS)} layers; each of {n_public} public types has its "
            "methods in one file"
        )
        return 0
    for comp in found:
        print("cycle among: " + ", ".join(sorted(files[m] for m in comp)))
        if "-v" in sys.argv:
            for m in sorted(comp):
                inside = sorted(files[t] for t in edges[m] if t in comp)
                print(f"  {files[m]} -> {', '.join(inside)}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
