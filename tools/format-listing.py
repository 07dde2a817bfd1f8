#!/usr/bin/env python3
"""mongotx's stored format as text: one line per (collection, field path) of what mongotx stores.

    python3 tools/format-listing.py                  print the listing
    python3 tools/format-listing.py --check FILE     exit 1 if FILE differs, or if the stored
                                                     format changed without a new format version
    python3 tools/format-listing.py --write FILE     regenerate FILE

The listing is generated from the JSON Schemas in schemas/ that describe mongotx's own documents
(the system fields of managed documents, the transaction records, the registry, the coordination
modules' collections), not the examples' and tests' collections. Each line names the collection
(by its default name; `*` for every managed collection), the field path (`a.b` for a field of a
document, `a[]` for the items of an array, `a.*` for the values of an open map, `a<kind>` for one
alternative of a `oneOf`), its BSON type(s) (an `enum` lists its values) and whether it is
`required` or `optional` (`each`: every item, map value or alternative is of that type;
`absent`: the field must not be there). Descriptions and bounds are left out: the listing says what a reader may meet, not what
it means (docs/format.md does).

The check keeps the stored format and its version together: docs/format.md's History table gives
each format version the fingerprint of its listing (the first 12 hex digits of the SHA-256 of the
lines after the `format N` header), and the current format's row must match the listing the
schemas give now. So a change of a stored field's name, type, place or requiredness fails here
until it comes with a new format version. The current format is the code's
`pub const FORMAT` where src/ has one, else the History table's last row.
"""

import difflib
import hashlib
import json
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
HISTORY = os.path.join(ROOT, "docs", "format.md")

# What mongotx stores, by default collection name, and the schema describing it.
STORED = [
    ("*", "managed_system_fields.json"),
    ("mongotx_transactions", "mongotx_transactions.json"),
    ("mongotx_meta", "mongotx_meta.json"),
    ("quota_providers", "quota_providers.json"),
    ("obts", "obts.json"),
    ("obt_tokens", "obt_tokens.json"),
    ("obt_fences", "obt_fences.json"),
    ("ratelimits", "ratelimits.json"),
    ("batches", "batches.json"),
    ("batches_services", "batch_services.json"),
    ("mongotx_contention", "mongotx_contention.json"),
]
# The examples' and tests' own collections: data of a service, not mongotx's format.
NOT_STORED = {"accounts", "counters", "dlvs", "lists", "notes", "profiles", "transfers"}

TYPE_NAMES = {"boolean": "bool", "integer": "int"}


class Problem(Exception):
    pass


def types_of(node):
    """The BSON type(s) of a schema node, as the listing shows them."""
    listed = node.get("bsonType", node.get("type"))
    if isinstance(listed, str):
        listed = [listed]
    shown = "|".join(sorted(TYPE_NAMES.get(t, t) for t in listed)) if listed else ""
    if "enum" in node:
        values = ",".join(sorted(json.dumps(v, sort_keys=True) for v in node["enum"]))
        shown = (shown + " " if shown else "") + f"enum({values})"
    alternatives = node.get("oneOf") or node.get("anyOf")
    if alternatives:
        kinds = "|".join(alternative_name(a, i) for i, a in enumerate(alternatives))
        shown = (shown + " " if shown else "") + f"oneOf({kinds})"
    return shown or "any"


def alternative_name(node, index):
    return node.get("title") or str(index)


def walk(node, path, presence, out):
    """Lines for `node` at `path` (when it has one) and everything below it. `presence` is
    `required` or `optional` for a field, `each` for the items of an array, the values of an open
    map and the alternatives of a `oneOf`."""
    if path:
        out.append((path, types_of(node), presence))
    alternatives = node.get("oneOf") or node.get("anyOf") or []
    for i, alternative in enumerate(alternatives):
        walk(alternative, f"{path}<{alternative_name(alternative, i)}>", "each", out)
    # `not` of required fields: fields that must be absent.
    refused = node.get("not")
    if isinstance(refused, dict):
        for alternative in refused.get("anyOf", [refused]):
            if set(alternative) == {"required"} and len(alternative["required"]) == 1:
                name = alternative["required"][0]
                out.append((f"{path}.{name}" if path else name, "-", "absent"))
    needed = set(node.get("required", []))
    for name, sub in node.get("properties", {}).items():
        walk(sub, f"{path}.{name}" if path else name, "required" if name in needed else "optional", out)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        walk(extra, f"{path}.*" if path else "*", "each", out)
    items = node.get("items")
    if isinstance(items, dict):
        walk(items, f"{path}[]", "each", out)
    elif isinstance(items, list):
        for i, item in enumerate(items):
            walk(item, f"{path}[{i}]", "each", out)


def schema_lines(collection, file):
    with open(os.path.join(ROOT, "schemas", file), encoding="utf-8") as f:
        schema = json.load(f)
    found = []
    alternatives = schema.get("oneOf") or schema.get("anyOf")
    if alternatives and "properties" not in schema:
        # Documents of several kinds in one collection (the registry): one block per kind.
        for i, alternative in enumerate(alternatives):
            kind = f"{collection}<{alternative_name(alternative, i)}>"
            found += [(kind,) + line for line in sorted(lines(alternative))]
    else:
        found += [(collection,) + line for line in sorted(lines(schema))]
    return found


def lines(schema):
    out = []
    walk(schema, "", "required", out)
    return out


def check_holds(rows):
    """Every schema that describes `_hold` in full describes it as the managed documents do."""
    def hold_of(collection):
        return [
            (path, types, req)
            for (c, path, types, req) in rows
            if c == collection and (path == "_hold" or path.startswith("_hold."))
        ]

    reference = hold_of("*<stamped>")
    for collection, _ in STORED:
        held = hold_of(collection)
        if collection != "*" and len(held) > 1 and held != reference:
            raise Problem(
                f"schemas: the _hold of {collection} differs from managed_system_fields.json's; "
                "a hold is the same in every managed collection"
            )


def listing():
    on_disk = {f[: -len(".json")] for f in os.listdir(os.path.join(ROOT, "schemas")) if f.endswith(".json")}
    listed = {f[: -len(".json")] for _, f in STORED}
    unknown = sorted(on_disk - listed - NOT_STORED)
    if unknown:
        raise Problem(
            f"schemas/{unknown[0]}.json is neither in the stored format (STORED) nor an example's "
            "collection (NOT_STORED) in tools/format-listing.py: say which"
        )
    rows = []
    for collection, file in STORED:
        rows += schema_lines(collection, file)
    check_holds(rows)
    return [f"{c}  {path}  {types}  {req}" for (c, path, types, req) in rows]


def fingerprint(body):
    return hashlib.sha256("".join(line + "\n" for line in body).encode("utf-8")).hexdigest()[:12]


def history():
    """(format, fingerprint) of each row of docs/format.md's History table, in order."""
    try:
        text = open(HISTORY, encoding="utf-8").read()
    except OSError as e:
        raise Problem(f"{HISTORY}: {e}")
    section = re.search(r"^## History\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if not section:
        raise Problem("docs/format.md has no `## History` section")
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*`?([0-9a-f]{12})`?\s*\|", section.group(1), re.M)
    if not rows:
        raise Problem("docs/format.md's History table has no row `| N | fingerprint | ... |`")
    return [(int(n), f) for n, f in rows]


def code_format():
    """The format the code writes, if src/ declares it (`pub const FORMAT: ... = N;`)."""
    for root, dirs, files in os.walk(os.path.join(ROOT, "src")):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".rs"):
                text = open(os.path.join(root, name), encoding="utf-8").read()
                found = re.search(r"pub const FORMAT\s*:\s*\w+\s*=\s*(\d+)\s*;", text)
                if found:
                    return int(found.group(1)), os.path.relpath(os.path.join(root, name), ROOT)
    return None, None


def current(rows):
    n, where = code_format()
    last = rows[-1][0]
    if n is None:
        return last, "the History table's last row"
    if n != last:
        raise Problem(
            f"{where} says format {n}, docs/format.md's History ends at format {last}: "
            "the code's format and the documented one must be the same"
        )
    return n, where


def generate():
    """The listing with its header, and what the check has to say about its version."""
    body = listing()
    rows = history()
    n, source = current(rows)
    now = fingerprint(body)
    recorded = dict(rows).get(n)
    complaint = None
    if recorded != now:
        complaint = (
            f"the stored format changed: format {n} ({source}) has fingerprint {recorded} in "
            f"docs/format.md's History, but the schemas now give {now}.\n"
            "A change of what mongotx stores (a field's name, type, place, requiredness or enum "
            f"values) is a new format: describe it in docs/format.md, add the row\n"
            f"  | {n + 1} | `{now}` | <release> | <what changed> |\n"
            "to its History table (and step the code's FORMAT, with the reading and the gate for "
            "it), then regenerate the listing with\n"
            "  python3 tools/format-listing.py --write docs/format.txt\n"
            "If the schemas should not have changed, put them back."
        )
    return [f"format {n}"] + body, complaint


def main(argv):
    mode, target = None, None
    if argv and argv[0] in ("--check", "--write"):
        if len(argv) < 2:
            sys.exit(f"usage: {sys.argv[0]} [--check FILE | --write FILE]")
        mode, target = argv[0], argv[1]
    try:
        listed, complaint = generate()
    except Problem as e:
        print(f"format listing: {e}", file=sys.stderr)
        return 1
    now = [line + "\n" for line in listed]
    if mode is None:
        sys.stdout.writelines(now)
        return 0
    if mode == "--write":
        with open(target, "w", encoding="utf-8") as out:
            out.writelines(now)
        print(f"{target}: {listed[0]}, {len(now) - 1} fields, fingerprint {fingerprint(listed[1:])}")
        if complaint:
            print(complaint, file=sys.stderr)
            return 1
        return 0
    try:
        before = open(target, encoding="utf-8").readlines()
    except OSError as e:
        print(f"format listing: {e}", file=sys.stderr)
        return 1
    failed = False
    if before != now:
        sys.stdout.writelines(difflib.unified_diff(before, now, target, "the schemas now"))
        print(
            f"the stored format listing differs from {target}; if the change is meant, regenerate "
            f"it with\n  python3 tools/format-listing.py --write {target}"
        )
        failed = True
    if complaint:
        print(complaint)
        failed = True
    if failed:
        return 1
    print(
        f"stored format unchanged: {listed[0]}, {len(now) - 1} fields, "
        f"fingerprint {fingerprint(listed[1:])} ({target})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
