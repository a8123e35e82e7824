"""The rules docs/ARCHITECTURE.md states, checked against the code (so the document cannot drift from it).

Each rule reads the package's source with `ast` (no imports, no execution) and names every place that breaks it.
`test_rules_catch_a_violation` feeds each checker a snippet that breaks its rule, so none can pass vacuously.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
AREAS = ("telemetry", "runtime", "trainer", "evals", "recipes")
# which areas each area may import (ARCHITECTURE.md: telemetry <- trainer <- recipes; telemetry <- runtime; evals
# uses telemetry, trainer, runtime; recipes sits on top; nothing imports recipes)
MAY_IMPORT = {"telemetry": set(), "runtime": {"telemetry"}, "trainer": {"telemetry"},
              "evals": {"telemetry", "trainer", "runtime"}, "recipes": {"telemetry", "trainer", "runtime", "evals"}}
# the one module allowed to write files by name (temporary name, fsync, rename)
WRITERS = {"telemetry/atomic.py"}
# where a HF checkpoint is loaded with transformers
LOADERS = {"telemetry/hf.py"}
CLI = {"recipes/cli.py"}


# programs outside the package (not installed): their own argparse, but files written and commits looked up the
# package's one way; experiments/ (one-off studies, when there is one) counts as scripts
SCRIPTS = ("scripts", "experiments")
# the one place that asks git which commit the code is
PROVENANCE = {"telemetry/provenance.py"}


def sources(areas=AREAS) -> dict[str, ast.Module]:
    out = {}
    for area in areas:
        if not (ROOT / area).is_dir():
            continue
        for p in sorted((ROOT / area).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            out[rel] = ast.parse(p.read_text(), rel)
    return out


# --- the checkers: source tree -> list of "file:line: what" ----------------------------------------------------

def import_violations(trees: dict[str, ast.Module]) -> list[str]:
    """An import against the arrows of the diagram, in any form: absolute, relative (resolved through the mapping
    in pyproject.toml), or `importlib.import_module("...")` with a constant name; and bare area names."""
    bad = []
    for rel, tree in trees.items():
        area = rel.split("/")[0]
        mod = module_name(rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [_imported(node, mod, rel.endswith("__init__.py"))[-1]]
            else:
                names = _imported(node, mod, rel.endswith("__init__.py"))
            for name in names:
                parts = name.split(".")
                if parts[0] in AREAS or parts[0] == "scripts":
                    bad.append(f"{rel}:{node.lineno}: imports {name} (bare area name; use expertcache.{name})")
                elif parts[0] == "expertcache" and len(parts) > 1 and parts[1] in AREAS:
                    target = parts[1]
                    if target != area and target not in MAY_IMPORT.get(area, set(AREAS)):
                        bad.append(f"{rel}:{node.lineno}: {area} imports {name}")
    return bad


_MODE = re.compile(r"^[rwxabt+]{1,4}(:\w*)?$")  # a file mode ("w", "ab", "r+b", tarfile's "w:gz")
_WRITE_MODES = re.compile(r"[wax+]")
_WRITE_CALLS = {"write_text", "write_bytes", "savez", "savez_compressed", "save_file", "to_parquet", "to_csv",
                "write_table", "savefig", "save_pretrained"}
# shutil's copies and moves write their destination by name
_COPY_CALLS = {"copy", "copy2", "copyfile", "copytree", "move"}
# module-level openers whose second argument is the mode (a method `.open(mode)` on a path takes it first)
_OPENERS = {"os", "io", "gzip", "bz2", "lzma", "tarfile", "zipfile", "codecs", "builtins"}


# Writers that are not results written whole, each with the reason it may stream: the Parquet trace writer
# appends row groups as a recording goes (so an interrupted recording keeps what it had).
STREAMING = {("telemetry/parquet_trace.py", "write_table")}


def write_violations(trees: dict[str, ast.Module]) -> list[str]:
    """A file written by name outside atomic.py: open() in a writing mode (the builtin, a module's `gzip.open(p,
    "w")`, a path's `.open("w")`, `mode=`), Path.write_*, np.save*, torch.save, safetensors' save_file, pyarrow's
    write_table, savefig, save_pretrained, shutil's copy/copy2/copyfile/copytree/move. Allowed: the functions
    imported from atomic.py, writes into the temporary folder of `with atomic_dir(...)` or into the file object of
    `with atomic_open(...) as f`, the kernel's /proc knobs."""
    bad = []
    for rel, tree in trees.items():
        if rel in WRITERS:
            continue
        from_atomic = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                       and (node.module or "").endswith("atomic") for a in node.names}
        from_shutil = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                       and node.module == "shutil" for a in node.names if a.name in _COPY_CALLS}
        inside_atomic_dir, into_atomic_file = set(), {}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.With, ast.AsyncWith)):
                continue
            for i in node.items:
                if isinstance(i.context_expr, ast.Call) and _name(i.context_expr.func) == "atomic_dir":
                    inside_atomic_dir |= {id(n) for n in ast.walk(node)}
                elif isinstance(i.context_expr, ast.Call) and _name(i.context_expr.func) == "atomic_open" and \
                        isinstance(i.optional_vars, ast.Name):
                    for n in ast.walk(node):
                        into_atomic_file.setdefault(id(n), set()).add(i.optional_vars.id)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or id(node) in inside_atomic_dir:
                continue
            if any(isinstance(a, ast.Name) and a.id in into_atomic_file.get(id(node), ())
                   for a in [*node.args, *(k.value for k in node.keywords)]):
                continue  # writes into the temporary file of `with atomic_open(...) as f` (np.savez(f, ...))
            f = node.func
            name = _name(f) or ""
            if isinstance(f, ast.Name) and name in from_atomic:
                continue
            if (rel, name) in STREAMING or _proc_path(f):
                continue
            if name == "open":
                mode = _open_mode(node)
                if mode is not None and _WRITE_MODES.search(mode):
                    bad.append(f"{rel}:{node.lineno}: open(..., {mode!r})")
            elif name in _COPY_CALLS and (name in from_shutil or isinstance(f, ast.Attribute) and
                                          isinstance(f.value, ast.Name) and f.value.id == "shutil"):
                bad.append(f"{rel}:{node.lineno}: shutil.{name}(...) into a named path")
            elif name in _WRITE_CALLS:
                bad.append(f"{rel}:{node.lineno}: {name}(...)")
            elif name == "save" and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                    and f.value.id in ("torch", "np", "numpy"):
                bad.append(f"{rel}:{node.lineno}: {f.value.id}.save(...)")
    return bad


def _open_mode(node: ast.Call) -> str | None:
    """The constant mode an `open` call is given, wherever it stands: `open(p, m)`, `gzip.open(p, m)`,
    `Path(p).open(m)`, `mode=m`. None when it names no mode (a read) or writes into an object already open
    (`tarfile.open(fileobj=f, mode="w:gz")`: the object's own writer is what the rule checks)."""
    if any(k.arg == "fileobj" for k in node.keywords):
        return None
    f = node.func
    if isinstance(f, ast.Name) or isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and \
            f.value.id in _OPENERS:
        cands = node.args[1:2]
    else:  # a method on a path: Path(p).open("w"), self.path.open("a")
        cands = node.args[0:1]
    cands = cands + [k.value for k in node.keywords if k.arg == "mode"]
    for c in cands:
        if isinstance(c, ast.Constant) and isinstance(c.value, str) and _MODE.match(c.value):
            return c.value
    return None


def _proc_path(f) -> bool:
    """`Path("/proc/...").write_text(...)`: a kernel setting, not a file."""
    return isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) and f.value.args and \
        isinstance(f.value.args[0], ast.Constant) and str(f.value.args[0].value).startswith("/proc/")


def from_pretrained_violations(trees: dict[str, ast.Module]) -> list[str]:
    return [f"{rel}:{node.lineno}: from_pretrained outside {sorted(LOADERS)}"
            for rel, tree in trees.items() if rel not in LOADERS for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "from_pretrained"]


def argparse_violations(trees: dict[str, ast.Module]) -> list[str]:
    bad = []
    for rel, tree in trees.items():
        if rel in CLI:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names) or \
                    isinstance(node, ast.ImportFrom) and node.module == "argparse":
                bad.append(f"{rel}:{node.lineno}: argparse outside the generated CLI")
    return bad


def script_argparse_violations(trees: dict[str, ast.Module]) -> list[str]:
    """A script is a program, not a library: its parser is built inside a function or under
    `if __name__ == "__main__":`, never at module level (importing it would parse the importer's argv)."""
    bad = []
    for rel, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call) and _name(sub.func) in ("ArgumentParser", "parse_args"):
                    bad.append(f"{rel}:{sub.lineno}: argparse run at module level (put it in main())")
    return bad


def script_entry_violations(trees: dict[str, ast.Module]) -> list[str]:
    """A script runs as `sys.exit(run_script(main))` (`telemetry/errors.py`): bad input the package refuses is
    one line and exit 2 there, as in the CLI, not a traceback. A `__main__` block that calls no `run_script`, and a
    script with a `main` but no `__main__` block, break it."""
    bad = []
    for rel, tree in trees.items():
        blocks = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
        if not blocks:
            if has_main:
                bad.append(f"{rel}: a main() and no `if __name__ == \"__main__\":` block")
            continue
        if not any(isinstance(c, ast.Call) and _name(c.func) == "run_script" for b in blocks for c in ast.walk(b)):
            bad.append(f"{rel}:{blocks[0].lineno}: the __main__ block calls main without run_script")
    return bad


def commit_violations(trees: dict[str, ast.Module]) -> list[str]:
    """The commit a result came from is looked up once: `telemetry/provenance.py` (`git_commit`, `provenance`,
    `rev_parse`), which says whether the code is dirty too. Any other `git rev-parse` (a command list or a string
    naming it) is a second lookup."""
    return [f"{rel}:{node.lineno}: git rev-parse outside {sorted(PROVENANCE)} (use telemetry.provenance)"
            for rel, tree in trees.items() if rel not in PROVENANCE for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "rev-parse" in node.value]


HARNESS = "runtime/bench/harness.py"  # the one alternation harness (`order`, `alternate`)


def alternation_violations(trees: dict[str, ast.Module]) -> list[str]:
    """Arms alternated round by round go through `runtime/bench/harness.py` (`alternate`, or `order` where a round
    is asynchronous): a function elsewhere that reverses a sequence (`[::-1]`, `reversed(...)`) and tests a round's
    parity (`% 2`, `& 1`) is a second harness."""
    bad = []
    for rel, tree in trees.items():
        if rel == HARNESS:
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            nodes = list(ast.walk(fn))
            parity = any(isinstance(n, ast.BinOp) and isinstance(n.right, ast.Constant)
                         and ((isinstance(n.op, ast.Mod) and n.right.value == 2)
                              or (isinstance(n.op, ast.BitAnd) and n.right.value == 1)) for n in nodes)
            rev = any((isinstance(n, ast.Slice) and isinstance(n.step, ast.UnaryOp) and isinstance(n.step.op, ast.USub)
                       and isinstance(n.step.operand, ast.Constant) and n.step.operand.value == 1)
                      or (isinstance(n, ast.Call) and _name(n.func) == "reversed") for n in nodes)
            if parity and rev:
                bad.append(f"{rel}:{fn.lineno}: {fn.name} alternates arms itself (use runtime/bench/harness.py)")
    return bad


def pip_violations(trees: dict[str, ast.Module]) -> list[str]:
    """`pip download --no-binary :all:` builds every build dependency from source too (over 8 minutes for
    llama-cpp-python's, against 23 s for `--no-binary llama-cpp-python`): a command list names the package."""
    bad = []
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.List, ast.Tuple)):
                vals = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
                if any(a == "--no-binary" and b == ":all:" for a, b in zip(vals, vals[1:])):
                    bad.append(f"{rel}:{node.lineno}: --no-binary :all: (name the package instead)")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ALL_BINARY.search(node.value):
                bad.append(f"{rel}:{node.lineno}: --no-binary :all: in a command (name the package instead)")
    return bad


ALL_BINARY = re.compile(r"pip\b.*--no-binary[ =]:all:")  # a pip command line that builds everything from source


def text_pip_violations(files: dict[str, str]) -> list[str]:
    """The same rule over the command lines the Makefile, shell scripts and docs give: {path: text}."""
    return [f"{rel}:{i}: --no-binary :all: (name the package instead)"
            for rel, text in files.items() for i, line in enumerate(text.splitlines(), 1) if ALL_BINARY.search(line)]


def command_texts() -> dict[str, str]:
    """The Makefile, scripts/*.sh, the README and docs/*.md: {path: text}."""
    paths = [ROOT / "Makefile", ROOT / "README.md", *sorted((ROOT / "scripts").glob("*.sh")),
             *sorted((ROOT / "docs").glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths if p.is_file()}


# the rules' own homes: the fraction-or-count rule and the budget rule
CAPACITY_HOMES = {("telemetry/cachesim.py", "capacity_count"), ("telemetry/cachesim.py", "budget_capacity")}
# a floor division by a byte size that is not a cache's slot count, each with what it counts
# bytes divided by bytes that are no cache's slots: the experts a precision budget upgrades; how many experts' worth
# of bytes a checksum benchmark hashes
BYTE_COUNTS = {("runtime/kernels/quant_write.py", "allocate_by_usage"), ("runtime/bench/checks.py", "bench_checksum")}
# a value that is E, the experts of a layer, however the code spells it
_EXPERTS = re.compile(r"^(num_experts|num_local_experts|n_routed_experts|n_experts|EXPERTS|E|e|n_e)$")


def _mentions(node, pred) -> bool:
    return any(pred(n) for sub in ast.walk(node) for n in [_name(sub)] if n)


def _defs(tree: ast.Module):
    """(function name, node) for every node: the innermost function each node is in ("" at module level)."""
    out = {}

    def visit(n, fn):
        for c in ast.iter_child_nodes(n):
            name = c.name if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            out[id(c)] = name
            visit(c, name)
    visit(tree, "")
    return out


def capacity_violations(trees: dict[str, ast.Module]) -> list[str]:
    """The capacity rule (a fraction of E or a count: `cachesim.capacity_count`) and the budget rule (bytes of
    slots -> experts per layer: `cachesim.budget_capacity`) each live once. Found by what the code computes, not by
    what it names its variables: E (any spelling) times a float constant, or a product with E rounded (`round`,
    `int`, `ceil`, `floor`): a fraction of E turned into a count; a floor division by a byte size (a `*bytes*`
    name, attribute or call): bytes turned into slots; and, by name, a capacity times E or compared with 1."""
    bad = []
    for rel, tree in trees.items():
        where = _defs(tree)
        for node in ast.walk(tree):
            if (rel, where.get(id(node), "")) in CAPACITY_HOMES:
                continue
            is_e = lambda n: bool(_EXPERTS.match(n))
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                sides = (node.left, node.right)
                names = {_name(node.left), _name(node.right)}
                if any(n and "capacity" in n for n in names) and any(n and "expert" in n for n in names):
                    bad.append(f"{rel}:{node.lineno}: capacity times experts outside capacity_count")
                elif any(_mentions(a, is_e) and isinstance(b, ast.Constant) and isinstance(b.value, float)
                         for a, b in (sides, sides[::-1])):
                    bad.append(f"{rel}:{node.lineno}: a float fraction of E outside capacity_count")
            elif isinstance(node, ast.Call) and _name(node.func) in ("round", "int", "ceil", "floor") and node.args \
                    and isinstance(node.args[0], ast.BinOp) and isinstance(node.args[0].op, ast.Mult) \
                    and _mentions(node.args[0], is_e):
                bad.append(f"{rel}:{node.lineno}: a product with E rounded to a count outside capacity_count")
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and \
                    _mentions(node.right, lambda n: "bytes" in n.lower()) and \
                    (rel, where.get(id(node), "")) not in BYTE_COUNTS:
                bad.append(f"{rel}:{node.lineno}: bytes divided into slots outside cachesim.budget_capacity")
            elif isinstance(node, ast.Compare) and _name(node.left) and "capacity" in _name(node.left) and \
                    any(isinstance(c, ast.Constant) and c.value == 1 for c in node.comparators):
                bad.append(f"{rel}:{node.lineno}: capacity compared with 1 outside capacity_count")
    return sorted(set(bad))


# names of a kind of name a user gives (cache and miss policies, predictors, tiers): each list is a registry
# (`telemetry/registry.py`), and a constant by such a name is derived from it (`POLICIES = REGISTRY.names()`)
_REGISTERED = re.compile(r"(POLICIES|PREDICTORS|TIERS|SYSTEMS|FORMATS|ROUTINGS|KERNELS|SEMANTICS)$")
# literal lists still waiting for their registry, each with why (none: bench big's systems are registered runners,
# `runtime/bench/bigbench.py: SYSTEM_REGISTRY`, their `:variant`s the registry's arguments)
PENDING_LISTS: set[tuple[str, str]] = set()


def name_list_violations(trees: dict[str, ast.Module]) -> list[str]:
    """A `*POLICIES`/`*PREDICTORS`/`*TIERS`/`*SYSTEMS`/`*FORMATS`/`*ROUTINGS`/`*KERNELS`/`*SEMANTICS` bound to a
    literal tuple, list or set of names: a second list beside its registry (or a list with none)."""
    bad = []
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            if not isinstance(value, (ast.Tuple, ast.List, ast.Set)):
                continue
            for t in targets:
                if isinstance(t, ast.Name) and _REGISTERED.search(t.id) and (rel, t.id) not in PENDING_LISTS:
                    bad.append(f"{rel}:{node.lineno}: {t.id} is a literal list of names; register them in a "
                               f"telemetry.registry.Registry and derive it")
    return bad


# flags of other programs that an error message may quote (the corpus builder's pip hint; llama.cpp's tools in
# import-gguf's hints: `llama-gguf-split --merge`, `llama-quantize --pure`)
EXTERNAL_FLAGS = {"no-deps", "no-binary", "merge", "pure"}
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_-]*(?:\.[a-z0-9_]+)*)")
_CLI_FLAGS: set[str] = set()


def cli_flags() -> set[str]:
    """Every `--flag` of every `expertcache` command, from the parser the CLI builds (the one rule that imports
    the package: the flags exist only in the generated parser)."""
    if not _CLI_FLAGS:
        from expertcache.recipes.cli import build_parser

        parsers: dict = {}
        build_parser(parsers)
        for _, p in parsers.values():
            _CLI_FLAGS.update(o[2:] for a in p._actions for o in a.option_strings if o.startswith("--"))
    return _CLI_FLAGS


def flag_violations(trees: dict[str, ast.Module], flags: set[str] | None = None) -> list[str]:
    """An error message (a string in a `raise`, or in an `InputError`/`RecipeError` built to be raised later)
    naming a `--flag` no command has (`--recipe.KEY` overrides are the recipe's keys, checked by its loader).
    #24 found hints naming --num-experts, --device and --include-path; the flags use underscores, and engine
    options are --engine.*."""
    flags = cli_flags() if flags is None else flags
    bad = []
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                msg = node.exc
            elif isinstance(node, ast.Call) and _name(node.func) in ("InputError", "RecipeError"):
                msg = node
            else:
                continue
            for sub in ast.walk(msg):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    for m in _FLAG.finditer(sub.value):
                        name = m.group(1)
                        if name not in flags and name not in EXTERNAL_FLAGS and not name.startswith("recipe."):
                            bad.append(f"{rel}:{sub.lineno}: an error message names --{name}, which no command has")
    return sorted(set(bad))


def _name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


# --- the import graph, resolved through pyproject's package-dir mapping ---------------------------------------

def package_dirs() -> dict[str, str]:
    """pyproject's `[tool.setuptools.package-dir]`: import name -> folder (the one mapping pip also installs)."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def module_files() -> dict[str, str]:
    """Every module of the installed package: dotted name -> repository path, through the mapping (the longest
    mapped prefix wins, as setuptools resolves it)."""
    out = {}
    for pkg, folder in sorted(package_dirs().items(), key=lambda kv: -len(kv[0])):
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if rel in out.values():
                continue
            parts = list(p.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = rel
    return out


def module_name(rel: str) -> str:
    """The dotted name a repository file installs as (through the mapping), e.g. runtime/storage/loader.py ->
    expertcache.runtime.storage.loader."""
    for pkg, folder in sorted(package_dirs().items(), key=lambda kv: -len(kv[1])):
        if rel.startswith(folder.rstrip("/") + "/"):
            parts = list(Path(rel[len(folder) + 1:]).with_suffix("").parts)
            return ".".join([pkg, *(parts[:-1] if parts[-1] == "__init__" else parts)])
    return Path(rel).with_suffix("").as_posix().replace("/", ".")


def _imported(node, module: str, is_pkg: bool) -> list[str]:
    """The dotted names one import statement (or `importlib.import_module("...")` with a constant) asks for, in
    absolute form; `from X import a` gives both `X.a` and `X` (the caller keeps whichever is a module).
    `importlib.resources.files("expertcache.X")` counts as importing X: reading an area's files is depending on it."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")
            base = base[:len(base) - node.level + (1 if is_pkg else 0)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        return [f"{mod}.{a.name}" for a in node.names] + [mod]
    if isinstance(node, ast.Call) and _name(node.func) in ("import_module", "__import__", "files") and node.args and \
            isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return [node.args[0].value]
    return []


def import_graph(trees: dict[str, ast.Module] | None = None) -> dict[str, set[str]]:
    """module -> the package's modules it imports, at module level or inside functions alike."""
    files = module_files()
    trees = trees if trees is not None else {rel: ast.parse((ROOT / rel).read_text(), rel) for rel in files.values()}
    files.update({module_name(rel): rel for rel in trees})  # planted modules too
    by_file = {rel: mod for mod, rel in files.items()}
    graph: dict[str, set[str]] = {}
    for rel, tree in trees.items():
        mod = by_file.get(rel) or module_name(rel)
        is_pkg = rel.endswith("__init__.py")
        edges = graph.setdefault(mod, set())
        for node in ast.walk(tree):
            names = _imported(node, mod, is_pkg)
            if isinstance(node, ast.ImportFrom):  # X.a when a is a module, else X
                subs = [n for n in names[:-1] if n in files]
                names = subs if len(subs) == len(names) - 1 else subs + names[-1:]
            for name in names:
                while name and name not in files and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in files and name != mod:
                    edges.add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    import sys
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def cycle_violations(trees: dict[str, ast.Module]) -> list[str]:
    """An import cycle anywhere in the package, counting imports inside functions and relative imports."""
    return [" -> ".join(c) for c in cycles(import_graph(trees))]


# --- the tests -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trees():
    return sources()


@pytest.fixture(scope="module")
def script_trees():
    return sources(SCRIPTS)


@pytest.mark.parametrize("check", [write_violations, commit_violations, script_argparse_violations, pip_violations,
                                   import_violations, script_entry_violations, alternation_violations],
                         ids=lambda f: f.__name__)
def test_scripts_follow_the_rules(script_trees, check):
    """scripts/ (and experiments/) write files through atomic.py, look up the commit through provenance.py and
    import the package by its installed name; argparse is theirs, run from main()."""
    assert script_trees, "no scripts found"
    assert check(script_trees) == []


@pytest.mark.parametrize("check,snippet", [
    (write_violations, "Path(args.out).write_text(json.dumps(res))"),
    (write_violations, "open(a.out, 'w').write(x)"),
    (write_violations, "shutil.copytree(src, dst)"),
    (commit_violations, "c = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True).stdout"),
    (script_argparse_violations, "import argparse\nap = argparse.ArgumentParser()\na = ap.parse_args()"),
    (pip_violations, "cmd = ['pip', 'download', '--no-binary', ':all:', 'llama-cpp-python']"),
    (import_violations, "from runtime.engine import EngineConfig"),
    (alternation_violations, "def main():\n    for i in range(n):\n"
                             "        for s in (list(systems) if i % 2 == 0 else list(systems)[::-1]):\n"
                             "            run(s)\n"),  # load_test.py's own loop, before it used the harness
    (alternation_violations, "async def rounds():\n    for r in range(n):\n"
                             "        for s in (arms if not r & 1 else reversed(arms)):\n            await run(s)\n"),
    (script_entry_violations, "import sys\ndef main():\n    pass\nif __name__ == '__main__':\n    sys.exit(main())"),
    (script_entry_violations, "def main():\n    pass\n"),
], ids=lambda x: x.__name__ if callable(x) else "")
def test_script_rules_catch_a_violation(check, snippet):
    assert check({"scripts/stray.py": ast.parse(snippet)}) != []


def test_no_command_line_downloads_every_build_dependency_as_source():
    assert text_pip_violations(command_texts()) == []
    planted = {"Makefile": "sources:\n\t$(BIN)/python -m pip download -q --no-deps --no-binary :all: x==1 -d d\n"}
    assert text_pip_violations(planted) == ["Makefile:2: --no-binary :all: (name the package instead)"]
    assert pip_violations({"trainer/stray.py": ast.parse("hint = f'or pip download --no-binary :all: x -d {d}'")})


def test_a_script_may_parse_its_arguments_in_main():
    ok = ("import argparse\ndef main():\n    a = argparse.ArgumentParser().parse_args()\n"
          "if __name__ == '__main__':\n    ap = argparse.ArgumentParser()\n")
    assert script_argparse_violations({"scripts/ok.py": ast.parse(ok)}) == []
    assert argparse_violations({"scripts/ok.py": ast.parse(ok)}) != []  # the package's rule would refuse it


@pytest.mark.parametrize("check", [import_violations, cycle_violations, write_violations, from_pretrained_violations,
                                   argparse_violations, capacity_violations, name_list_violations,
                                   flag_violations, commit_violations, pip_violations, alternation_violations],
                         ids=lambda f: f.__name__)
def test_rule_holds(trees, check):
    assert check(trees) == []


@pytest.mark.parametrize("check,snippet", [
    (import_violations, "from expertcache.trainer.models import x"),
    (import_violations, "import expertcache.recipes.cli"),
    (import_violations, "from ..recipes import cli"),  # relative, resolved through the mapping
    (import_violations, "importlib.import_module('expertcache.recipes.cli')"),
    (import_violations, "importlib.resources.files('expertcache.recipes')"),
    (write_violations, "open(p, 'w').write('x')"),
    (write_violations, "Path(p).write_text('x')"),
    (write_violations, "torch.save(obj, p)"),
    (from_pretrained_violations, "AutoModelForCausalLM.from_pretrained(d)"),
    (argparse_violations, "import argparse"),
    (write_violations, "Path(p).open('w').write('x')"),  # a path's own open, mode first
    (write_violations, "out.open(mode='a')"),
    (write_violations, "gzip.open(p, 'wt')"),
    (write_violations, "shutil.copy(src, dst)"),
    (write_violations, "shutil.copy2(src, dst)"),
    (write_violations, "from shutil import copyfile\ncopyfile(src, dst)"),
    (write_violations, "shutil.copytree(src, dst)"),
    (write_violations, "shutil.move(src, dst)"),
    (capacity_violations, "c = round(capacity * num_experts)"),
    (capacity_violations, "ok = capacity < 1"),
    (capacity_violations, "slots = int(0.25 * model.config.num_experts)"),  # no capacity in any name
    (capacity_violations, "k = max(1, round(f * self.num_experts))"),
    (capacity_violations, "k = E * 0.5"),
    (capacity_violations, "cap = (budget - other) // (slot_bytes * layers) - k"),  # a second budget rule
    (capacity_violations, "cap = int(cfg.budget_gb * 2**30 // self.meta.block_bytes)"),
    (capacity_violations, "def capacity_count(c, e):\n    return round(c * e)"),  # its name, in another file
    (name_list_violations, "POLICIES = ('lru', 'lfu')"),
    (name_list_violations, "MISS_POLICIES: tuple = ['blocking', 'host']"),
    (name_list_violations, "REPLAY_PREDICTORS = ('none', 'oracle')"),
    (name_list_violations, "SYSTEMS = ('mmap', 'accelerate')"),
    (name_list_violations, "FORMATS = ['bf16', 'int4']"),
    (name_list_violations, "KERNELS = ('native', 'cpu')"),
    (name_list_violations, "ROUTINGS = {'trace', 'native'}"),
    (flag_violations, "raise InputError(f'{x}: pass --seq-len')"),
    (flag_violations, "raise InputError('set --engine.no_such_option')"),
    (flag_violations, "err = RecipeError('try --include-path')"),
], ids=lambda x: x.__name__ if callable(x) else "")
def test_rules_catch_a_violation(check, snippet):
    """A stray write (or import, load, parser, capacity rule) in a runtime module is reported."""
    assert check({"runtime/stray.py": ast.parse(snippet)}) != []


def test_reading_is_not_writing():
    reads = ("open(p).read(); open(p, 'rb').read(); Path(p).open().read(); Path(p).open('rb').read()\n"
             "tarfile.open(p); os.open(p, os.O_RDONLY); gzip.open(p, 'rt')\n"
             "with atomic_open(p) as f, tarfile.open(fileobj=f, mode='w:gz') as t: t.add(x)\n"
             "shutil.rmtree(d); shutil.copyfileobj(r, w)\n")
    assert write_violations({"runtime/stray.py": ast.parse(reads)}) == []


def test_the_capacity_rules_own_homes_and_other_arithmetic_are_not_violations():
    homes = ("def capacity_count(capacity, num_experts):\n    return max(1, round(capacity * num_experts))\n"
             "def budget_capacity(b, slot_bytes, layers, k, e):\n    return min((b // slot_bytes) // layers - k, e)\n")
    assert capacity_violations({"telemetry/cachesim.py": ast.parse(homes)}) == []
    other = ("n = e * k\nbytes_per_token = loads * expert_bytes\nrows = int(n_tokens * 0.5)\n"
             "layers = int(min(n, budget // (per_expert * e)))\n")
    assert capacity_violations({"runtime/stray.py": ast.parse(other)}) == []


def test_atomic_writes_are_not_violations():
    ok = ("from expertcache.telemetry.atomic import write_text, atomic_dir\n"
          "write_text(p, 'x')\n"
          "with atomic_dir(d) as tmp:\n    model.save_pretrained(tmp)\n")
    assert write_violations({"runtime/stray.py": ast.parse(ok)}) == []


def test_names_derived_from_a_registry_are_not_violations():
    ok = "POLICIES = POLICY_REGISTRY.view('sim').names()\nKERNELS = KERNEL_REGISTRY.names()\nDOMAINS = ('code',)\n"
    assert name_list_violations({"runtime/stray.py": ast.parse(ok)}) == []


def test_the_flags_are_read_from_the_cli():
    assert {"engine.capacity", "num_experts", "include_path", "resume", "rebless"} <= cli_flags()


def test_the_document_states_these_rules():
    """Each row of ARCHITECTURE.md's rules table names the checks that hold it, and every check here is in a row."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for phrase in ("test_architecture.py", "atomic.py", "capacity_count", "budget_capacity", "load_causal_lm",
                   "registry.py", "provenance.py", "claim_dir"):
        assert phrase in doc, phrase
    table = doc.split("## Rules the tests check", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith(("| rule", "| ---"))]
    named = {n for ln in rows for n in re.findall(r"`(\w+_violations)`", ln.rsplit("|", 2)[-2])}
    assert all(re.search(r"`\w+_violations`", ln.rsplit("|", 2)[-2]) for ln in rows), "a rule without its check"
    checks = {n for n, f in globals().items() if n.endswith("_violations") and not n.startswith("test_")}
    assert named == checks, (sorted(named - checks), sorted(checks - named))


_PATH = r"(?:telemetry|runtime|trainer|evals|recipes|scripts|experiments|tests|docs)/[\w/.-]+\.(?:py|md|sh|cpp)"


def _defined(rel: str) -> set[str]:
    tree = ast.parse((ROOT / rel).read_text())
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                out |= {e.id for e in ast.walk(t) if isinstance(e, ast.Name)}
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {a.asname or a.name.split(".")[0] for a in n.names}
    return out


def stale_places(doc: str) -> list[str]:
    """The files a document names that do not exist, and the names it gives in a file (`file.py: a, b`) that the
    file does not define."""
    wrong = [m for m in re.findall(rf"`({_PATH})", doc) if not (ROOT / m).exists()]
    for rel, rest in re.findall(rf"`({_PATH}): ([^`]+)`", doc):
        if not rel.endswith(".py") or not (ROOT / rel).exists():
            continue
        have = _defined(rel)
        wrong += [f"{rel}: {name}" for name in re.findall(r"[A-Za-z_][\w.]*", rest.split("(")[0])
                  if name.split(".")[0] not in have]
    return wrong


def test_every_place_the_document_names_exists():
    """The move into rooms left parquet_trace's `load_routing`, decode's `timed_greedy` and quant's
    `write_quantized` named where they no longer were; a stale line is caught."""
    assert stale_places((ROOT / "docs" / "ARCHITECTURE.md").read_text()) == []
    assert stale_places("| traces | `telemetry/parquet_trace.py: load_routing` |") == [
        "telemetry/parquet_trace.py: load_routing"]
    assert stale_places("see `runtime/loader.py`") == ["runtime/loader.py"]
    assert stale_places("moved: `experiments/no_such_study.py`") == ["experiments/no_such_study.py"]


def test_every_docs_page_that_is_referenced_exists():
    """docs/serving.md was referenced (by the package's docstring) and did not exist."""
    pages = set()
    for p in [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *(f for a in (*AREAS, "src", *SCRIPTS)
                                                                    for f in (ROOT / a).rglob("*.py"))]:
        pages |= set(re.findall(r"docs/[\w-]+\.md", p.read_text()))
    assert pages and not [d for d in sorted(pages) if not (ROOT / d).exists()]


def test_a_cycle_is_caught_through_function_imports_and_relative_imports():
    a = ast.parse("from expertcache.runtime.engine import b_stray\n")
    b = ast.parse("def f():\n    from . import a_stray\n")
    found = cycle_violations({"runtime/engine/a_stray.py": a, "runtime/engine/b_stray.py": b})
    assert found == ["expertcache.runtime.engine.a_stray -> expertcache.runtime.engine.b_stray"]


def test_the_mapping_is_what_pip_installs():
    """Every folder the mapping names is a package pyproject lists, and every package of the tree is listed."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {m for m, rel in module_files().items() if rel.endswith("__init__.py")}
    assert found == listed, (sorted(found - listed), sorted(listed - found))
