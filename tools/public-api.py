#!/usr/bin/env python3
"""The public API of mongotx as text: one line per public item of the build rustdoc documented.

    python3 tools/public-api.py [DOC_DIR]            print the listing
    python3 tools/public-api.py --check FILE [DIR]   exit 1 with a diff if FILE differs
    python3 tools/public-api.py --write FILE [DIR]   regenerate FILE

DOC_DIR is the crate's rustdoc output (default target/doc/mongotx, as `cargo doc --no-deps --lib`
leaves it). CI compares the checked-in docs/public-api.txt with the default build's listing, so a
change of the surface shows up as a diff in review instead of in a user's build.

Why parse rustdoc's HTML: the tools that list an API exactly (cargo-public-api) read rustdoc's JSON,
which stable Rust does not emit, and CI has only stable. The HTML carries the same facts (every
item's page, its declaration, each inherent method's signature, the traits implemented), and only
the text of the declarations is kept, so the listing does not depend on the page layout beyond the
element classes read below.
"""

import difflib
import html
import os
import re
import sys

KINDS = ("struct", "enum", "trait", "fn", "constant", "type", "macro", "static", "union")
TAG = re.compile(r"<[^>]+>")


def text(fragment):
    """The text of an HTML fragment on one line, as a reader of the signature sees it."""
    # A long declaration folds its fields or variants under a "Show N variants" toggle, and an
    # attribute sits in its own block above the item.
    fragment = re.sub(r'<summary class="hideme">.*?</summary>', "", fragment, flags=re.S)
    fragment = fragment.replace("</div>", " </div>")
    plain = html.unescape(TAG.sub("", fragment)).replace("\u00a7", "")
    plain = re.sub(r"\s+", " ", plain).strip()
    # rustdoc breaks long signatures after an opening bracket and before a closing one.
    plain = re.sub(r"([(<\[]) ", r"\1", plain)
    plain = re.sub(r",? ([)>\]])", r"\1", plain)
    return plain


def declaration(page):
    found = re.search(r'<pre class="rust item-decl">(.*?)</pre>', page, re.S)
    decl = text(found.group(1)) if found else ""
    # A schema constant is a whole JSON document; its content is reviewed in schemas/.
    return re.sub(r'(&str = )"(?:[^"\\]|\\.){60,}";$', r'\1"...";', decl)


def sections(page, start, *ends):
    """The `code-header` texts of the items between two section ids (one impl block list)."""
    begin = page.find(f'id="{start}"')
    if begin < 0:
        return []
    # The list ends where the next one starts; a type may lack any of them.
    stops = [page.find(f'id="{e}"', begin) for e in ends]
    stops = [s for s in stops if s > begin]
    part = page[begin : min(stops) if stops else len(page)]
    found = []
    for kind, header in re.findall(
        r'<section id="[^"]*" class="(impl|method|variant|structfield|associatedconstant|'
        r'associatedtype|tymethod)[^"]*"[^>]*>.*?<(?:h3|h4|code)[^>]*>(.*?)</(?:h3|h4|code)>',
        part,
        re.S,
    ):
        found.append((kind, text(header)))
    return found


def fields(page):
    """Public fields and variants, as rustdoc lists them under the declaration."""
    found = []
    for kind, name, rest in re.findall(
        r'<span id="(structfield|variant)\.([^"]+)" class="[^"]*">(.*?)</span>', page, re.S
    ):
        found.append((kind, text(rest)))
    for name, header in re.findall(
        r'<section id="variant\.([^"]+)" class="variant">.*?<h3 class="code-header">(.*?)</h3>',
        page,
        re.S,
    ):
        found.append(("variant", text(header)))
    return found


def trait_impls(page, start):
    """`impl ...` headers of one list of trait implementations, up to the next list."""
    nxt = (
        "synthetic-implementations-list",
        "blanket-implementations-list",
        "trait-implementations-list",
    )
    ends = [other for other in nxt if other != start]
    return [header for kind, header in sections(page, start, *ends) if kind == "impl"]


def listing(doc_dir):
    crate = os.path.basename(os.path.normpath(doc_dir))
    lines = []
    for root, dirs, files in os.walk(doc_dir):
        dirs.sort()
        rel = os.path.relpath(root, doc_dir)
        module = crate if rel == "." else crate + "::" + rel.replace(os.sep, "::")
        for name in sorted(files):
            if not name.endswith(".html") or name == "all.html":
                continue
            page = open(os.path.join(root, name), encoding="utf-8").read()
            if 'http-equiv="refresh"' in page:
                continue  # a private path's redirect to where the item is documented
            if name == "index.html":
                lines.append(f"mod {module}")
                # An item re-exported from another public module has no page of its own here.
                for alias, code in re.findall(
                    r'<dt id="reexport\.([^"]+)"><code>(.*?)</code></dt>', page, re.S
                ):
                    target = re.search(r'title="[a-z]+ ([^"]+)"', code)
                    shown = target.group(1) if target else text(code)
                    lines.append(f"reexport {module}::{alias} = {shown}")
                continue
            kind, _, rest = name.partition(".")
            if kind not in KINDS:
                continue
            path = f"{module}::{rest[: -len('.html')]}"
            head = [f"{kind} {path}: {declaration(page)}".rstrip(": ")]
            body = [f"  {sub} {header}" for sub, header in fields(page)]
            body += [
                f"  {sub} {header}"
                for sub, header in sections(
                    page,
                    "implementations-list",
                    "trait-implementations",
                    "synthetic-implementations",
                    "blanket-implementations",
                )
                if sub not in ("impl",)
            ]
            body += [
                f"  {h}"
                for h in trait_impls(page, "trait-implementations-list")
                if not h.startswith("impl StructuralPartialEq ")  # the compiler's, from derive
            ]
            # Of the automatic traits only the two a service relies on across tasks; the others
            # (Freeze, UnsafeUnpin, ...) come and go with the compiler version.
            body += [
                f"  {h}"
                for h in trait_impls(page, "synthetic-implementations-list")
                if re.match(r"impl !?(Send|Sync) for ", h)
            ]
            lines += head + sorted(set(body))
    return lines


def main(argv):
    mode, target = None, None
    if argv and argv[0] in ("--check", "--write"):
        mode, target, argv = argv[0], argv[1], argv[2:]
    doc_dir = argv[0] if argv else "target/doc/mongotx"
    if not os.path.isfile(os.path.join(doc_dir, "index.html")):
        sys.exit(f"{doc_dir}: no rustdoc output (run `cargo doc --no-deps --lib` first)")
    now = [line + "\n" for line in listing(doc_dir)]
    if mode is None:
        sys.stdout.writelines(now)
        return 0
    if mode == "--write":
        with open(target, "w", encoding="utf-8") as out:
            out.writelines(now)
        print(f"{target}: {len(now)} lines")
        return 0
    before = open(target, encoding="utf-8").readlines()
    if before == now:
        items = sum(1 for line in now if not line.startswith(" "))
        print(f"public API unchanged: {items} items, {len(now)} lines ({target})")
        return 0
    sys.stdout.writelines(difflib.unified_diff(before, now, target, "the build now"))
    print(
        f"the public API differs from {target}; if the change is meant, regenerate it with\n"
        f"  cargo doc --no-deps --lib && python3 tools/public-api.py --write {target}"
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
