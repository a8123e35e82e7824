"""`expertcache` command line, generated from the typed command functions of each area (jsonargparse).

Every command is a plain function with typed arguments and a docstring in the area that owns it:
telemetry (trace, analyze, fit-policy), runtime (bench, simulate, fit-predictor, generate, serve), evals (eval,
gate), recipes (data, pretrain, train-cache-aware, quickstart). This module only maps command names to them,
parses, prints what they return as JSON on stdout (tables and progress go to stderr), writes the resolved
configuration beside the command's output, and turns bad input into one line and exit status 2.

Every command takes `--config FILE.yaml` and `--print_config`; engine options are `--engine.FIELD VALUE` (the
runtime's `EngineConfig`) wherever a model is served; recipes are `--recipe NAME|FILE.yaml` plus
`--recipe.KEY VALUE` or the short form `KEY=VALUE`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

RECIPE_DIR = Path(__file__).resolve().parent
# commands whose `recipe` argument is a shipped recipe name or a YAML file, and the folder of shipped names
RECIPE_COMMANDS = {"pretrain": (RECIPE_DIR, "smoke"), "train-cache-aware": (RECIPE_DIR / "cache-aware", "locality")}
_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


COMMANDS = {
    "data": {"build": "expertcache.recipes.commands:data_build"},
    "pretrain": "expertcache.recipes.commands:pretrain",
    "quickstart": "expertcache.recipes.commands:quickstart",
    "train-cache-aware": "expertcache.recipes.commands:train_cache_aware",
    "trace": {"record": "expertcache.runtime.serve.record:trace_record",
              "import": "expertcache.telemetry.commands:trace_import"},
    "trace-info": "expertcache.telemetry.commands:trace_info",
    "analyze": "expertcache.telemetry.commands:analyze",
    "fit-policy": "expertcache.telemetry.commands:fit_policy",
    "bench": {"decode": "expertcache.runtime.commands:bench_decode",
              "big": "expertcache.runtime.commands:bench_big",
              "checksum": "expertcache.runtime.bench.checks:bench_checksum",
              "integrity": "expertcache.runtime.bench.checks:bench_integrity",
              "cachesim": "expertcache.runtime.bench.cachesim:bench_cachesim",
              "attention": "expertcache.runtime.bench.attention:bench_attention",
              "kernels": "expertcache.runtime.bench.kernels:bench_kernels",
              "prompt-cache": "expertcache.runtime.bench.prompt_cache:bench_prompt_cache",
              "serve": "expertcache.runtime.bench.serve_load:bench_serve",
              "train": "expertcache.recipes.bench:bench_train",
              "telemetry": "expertcache.recipes.bench:bench_telemetry",
              "train-big": "expertcache.recipes.bench:bench_train_big"},
    "simulate": "expertcache.runtime.commands:simulate",
    "fit-predictor": "expertcache.runtime.commands:fit_predictor",
    "generate": "expertcache.runtime.commands:generate",
    "serve": "expertcache.runtime.commands:serve",
    "verify": "expertcache.runtime.commands:verify",
    "quantize": "expertcache.runtime.commands:quantize",
    "import-gguf": "expertcache.runtime.commands:import_gguf",
    "eval": "expertcache.evals.commands:eval",
    "gate": "expertcache.evals.commands:gate",
}


def _load(ref: str):
    import importlib

    module, fn = ref.split(":")
    return getattr(importlib.import_module(module), fn)


def commands(only: str | None = None) -> dict:
    """Command name -> function, or -> {action: function}; `only` imports just that command's area (a command's
    start-up does not pay for every area's imports; `--help` of the whole tool does)."""
    out = {}
    for name, ref in COMMANDS.items():
        if only is not None and name != only:
            continue
        out[name] = _load(ref) if isinstance(ref, str) else {a: _load(r) for a, r in ref.items()}
    return out


def _docstring(ref: str) -> str:
    """A command function's docstring read from its source with `ast`: the whole tool's `--help` lists every
    command without importing the areas (torch, transformers, lightning and lm-eval cost seconds; #46)."""
    import ast
    import importlib.util

    module, fn = ref.split(":")
    parts = module.split(".")
    try:  # the area's folder, found without running its __init__ (runtime's imports torch)
        area = importlib.util.find_spec(".".join(parts[:2]))
        path = Path(area.submodule_search_locations[0]).joinpath(*parts[2:]).with_suffix(".py")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        return next(ast.get_docstring(n) or "" for n in tree.body
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == fn)
    except (AttributeError, OSError, StopIteration, SyntaxError, TypeError):  # a layout the lookup does not know
        return _load(ref).__doc__ or ""


def summary_parser():
    """The whole tool's parser for `expertcache --help` and a missing or unknown command: every command named with
    its docstring's first paragraph, none of their options (a command's own `--help` builds its real parser)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="expertcache", description=__doc__.splitlines()[0], exit_on_error=False)
    sub = parser.add_subcommands(dest="command", required=True)
    for name, ref in COMMANDS.items():
        if isinstance(ref, str):
            sub.add_subcommand(name, ArgumentParser(exit_on_error=False), help=_first_line(_docstring(ref)))
        else:
            sub.add_subcommand(name, ArgumentParser(exit_on_error=False), help=", ".join(ref))
    return parser


def resolve_recipe(name_or_path: str, folder: Path = RECIPE_DIR) -> Path:
    """A recipe is a YAML path, or the name of one shipped in `folder` of this package: pretraining recipes
    (`smoke`, `base-tiny`) in recipes/, cache-aware ones (`locality`, `smoke`, ...) in recipes/cache-aware/."""
    from expertcache.trainer.config import RecipeError

    p = Path(name_or_path)
    if p.is_file():
        return p
    shipped = folder / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if shipped.is_file():
        return shipped
    names = sorted(f.stem for f in folder.glob("*.yaml"))
    raise RecipeError(f"recipe {name_or_path!r} is neither a file nor a shipped recipe ({', '.join(names)})")


def _document(cls, seen=None) -> None:
    """Give a recipe dataclass (and its nested ones) a Google-style docstring from its fields' `opt` help, which
    is what the generated --help shows."""
    import dataclasses
    import typing

    seen = set() if seen is None else seen
    if cls in seen:
        return
    seen.add(cls)
    hints = typing.get_type_hints(cls)
    lines = [(cls.__doc__ or cls.__name__).split("\n\nArgs:")[0].strip(), "", "Args:"]
    for f in dataclasses.fields(cls):
        lines.append(f"    {f.name}: {f.metadata.get('help', '')}")
        if dataclasses.is_dataclass(hints[f.name]):
            _document(hints[f.name], seen)
    cls.__doc__ = "\n".join(lines)


def _rewrite(argv: list[str]) -> list[str]:
    """Recipe commands: `--recipe NAME` becomes the shipped YAML's path (the default recipe when none is given),
    and a bare `KEY=VALUE` becomes `--recipe.KEY=VALUE`."""
    if not argv or argv[0] not in RECIPE_COMMANDS:
        return argv
    folder, default = RECIPE_COMMANDS[argv[0]]
    out, recipe, overrides, rest = [argv[0]], None, [], argv[1:]
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "--recipe" and i + 1 < len(rest):
            recipe, i = resolve_recipe(rest[i + 1], folder), i + 2
            out += ["--recipe", str(recipe)]
            continue
        if a == "--table":  # `--table runs/ca-*`: the shell's list of folders -> one list argument
            j = i + 1
            while j < len(rest) and not rest[j].startswith("-") and not _OVERRIDE.match(rest[j]):
                j += 1
            folders = rest[i + 1:j]
            if len(folders) == 1 and folders[0].startswith("[") and folders[0].endswith("]"):
                folders = [f.strip().strip("'\"") for f in folders[0][1:-1].split(",") if f.strip()]  # [a,b]
            out.append("--table=" + json.dumps(folders))
            i = j
            continue
        if a.startswith("--recipe="):
            recipe = resolve_recipe(a.split("=", 1)[1], folder)
            out.append(f"--recipe={recipe}")
        elif _OVERRIDE.match(a):
            overrides.append(a)
            out.append(f"--recipe.{a}")
        else:
            out.append(a)
        i += 1
    if recipe is None and not any(a in ("-h", "--help") for a in rest):
        recipe = folder / f"{default}.yaml"
        out[1:1] = ["--recipe", str(recipe)]
    if recipe is not None:  # our own loader first: an unknown key or a bad value is named as the recipe names it
        from expertcache.trainer.config import load_recipe
        from expertcache.trainer.specs import CacheAwareRecipe, PretrainRecipe

        load_recipe(PretrainRecipe if argv[0] == "pretrain" else CacheAwareRecipe, recipe, overrides)
    return out


def build_parser(parsers: dict | None = None, only: str | None = None):
    """The command line (`only`: with just that command); `parsers` (if given) receives
    `(command, action) -> (function, its parser)`."""
    from jsonargparse import ArgumentParser

    if only in (None, "pretrain", "train-cache-aware"):
        from expertcache.trainer.specs import CacheAwareRecipe, PretrainRecipe  # torch-free (#46)

        _document(PretrainRecipe)
        _document(CacheAwareRecipe)
    parser = ArgumentParser(prog="expertcache", description=__doc__.splitlines()[0], exit_on_error=False,
                            env_prefix="EXPERTCACHE", default_env=False)
    sub = parser.add_subcommands(dest="command", required=True)
    parsers = {} if parsers is None else parsers
    for name, fn in commands(only).items():
        if callable(fn):
            parsers[name, None] = fn, _fn_parser(fn)
            sub.add_subcommand(name, parsers[name, None][1], help=_first_line(fn))
            continue
        p = ArgumentParser(exit_on_error=False)
        sub.add_subcommand(name, p, help=", ".join(fn))
        actions = p.add_subcommands(dest="action", required=True)
        for act, f in fn.items():
            parsers[name, act] = f, _fn_parser(f)
            actions.add_subcommand(act, parsers[name, act][1], help=_first_line(f))
    return parser


def _first_line(fn) -> str:
    doc = fn if isinstance(fn, str) else fn.__doc__ or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def _fn_parser(fn):
    from jsonargparse import ActionConfigFile, ArgumentParser

    p = ArgumentParser(description=(fn.__doc__ or "").split("\n\n")[0], exit_on_error=False)
    p.add_argument("--config", action=ActionConfigFile, help="a YAML file of this command's arguments")
    p.add_function_arguments(fn, as_group=False, fail_untyped=True)
    return p


def _write_config(parser, cfg) -> None:
    """The resolved configuration beside the command's output: OUT_DIR/config.yaml for a folder output, or
    OUT.config.yaml beside a file output. Recipe runs write their recipe.yaml themselves."""
    out = cfg.get("out")
    if not out:
        return
    from expertcache.telemetry.atomic import write_text

    p = Path(out)
    target = p / "config.yaml" if p.is_dir() else p.with_name(p.stem + ".config.yaml")
    if target.parent.is_dir():
        text = parser.dump(cfg)
        from expertcache.runtime.bench.results import ROOT

        if target.parent.resolve() == ROOT / "results":  # a committed result's: no machine's paths
            text = _portable_config(text)
        write_text(target, text)


DROPPED_WHEN_MACHINE = ("out_dir", "work", "runs")  # output folders: a re-run uses its own


def _portable_config(text: str) -> str:
    """A configuration for the repository's results/: an output folder (`DROPPED_WHEN_MACHINE`) that names a
    machine's path is left out (a re-run writes into its own default); every other value naming one, at any depth
    (an input, an engine field), is made portable as results are (`results.portable_payload`: `.../<last name>`),
    so the file says what ran without the machine."""
    import yaml

    from expertcache.runtime.bench.results import machine_paths, portable_payload

    d = yaml.safe_load(text)
    if not isinstance(d, dict):
        return text
    out = {k: v for k, v in d.items() if not (k in DROPPED_WHEN_MACHINE and machine_paths(v))}
    return yaml.safe_dump(portable_payload(out), sort_keys=False)


def _call(fn, sub_cfg, parser):
    import inspect

    if fn.__module__.startswith("expertcache.runtime"):  # the trainer's aux routers, for the runtime's commands
        from expertcache.runtime.engine.predictors import set_aux_routers_loader
        from expertcache.trainer.aux_routers import load_aux_routers

        set_aux_routers_loader(load_aux_routers)

    init = parser.instantiate(sub_cfg)
    kwargs = {k: init[k] for k in inspect.signature(fn).parameters if k in init}
    return fn(**kwargs)


def main(argv: list[str] | None = None) -> int:
    from jsonargparse import ArgumentError

    from expertcache.telemetry.errors import BAD_INPUT

    argv = list(sys.argv[1:] if argv is None else argv)
    words = [a for a in argv if not a.startswith("-")][:2]  # the command (and its action: `bench checksum`)
    name = " ".join(words) if len(words) == 2 and isinstance(COMMANDS.get(words[0]), dict) and \
        words[1] in COMMANDS[words[0]] else (words[0] if words else "expertcache")
    try:
        argv = _rewrite(argv)
        parsers: dict = {}
        # `--help`, or no command (`summary_parser` never parses one): nothing to run, so nothing is imported
        parser = build_parser(parsers, only=argv[0]) if argv and argv[0] in COMMANDS else summary_parser()
        cfg = parser.parse_args(argv)
        sub, action = cfg[cfg.command], None
        if "action" in sub:
            action, sub = sub.action, sub[sub.action]
        name = cfg.command + (f" {action}" if action else "")
        fn, sub_parser = parsers[cfg.command, action]
        result = _call(fn, sub, sub_parser)
        _write_config(sub_parser, sub)
    except ArgumentError as e:
        msg = " ".join(str(e).split())
        key = re.search(r'Parser key "([^"]+)"', msg)
        given = re.search(r"(?:Given|Got) value: (.*)$", msg)
        kinds = re.findall(r"Expected a <class '(\w+)'>", msg)
        missing = re.search(r"arguments are required: (\S+)", msg)
        if key and "list" in kinds:  # `--tasks ec_cloze_code`: jsonargparse's Union wording
            msg = (f"--{key.group(1)} takes a list, written [a,b] (one item: [a])"
                   + (f"; got {given.group(1)}" if given else ""))
        elif key and kinds:  # `--threads abc`: one line in the CLI's own spelling of the option
            want = " or ".join({"int": "an integer", "float": "a number", "bool": "true or false", "str": "text",
                                "NoneType": "nothing"}.get(k, k) for k in dict.fromkeys(kinds))
            msg = f"--{key.group(1)}: expected {want}" + (f"; got {given.group(1)}" if given else "")
        elif key and (lit := re.search(r"Expected a typing\.Literal\[(.*?)\]", msg)):  # `--phase middle`
            msg = (f"--{key.group(1)}: expected one of {lit.group(1).replace(chr(39), '')}"
                   + (f"; got {given.group(1)}" if given else ""))
        elif missing:  # `bench.checksum.model` -> --model
            msg = f"--{missing.group(1).rsplit('.', 1)[-1].rstrip(',')} is required"
        print(f"expertcache {name}: error: {msg}", file=sys.stderr)
        return 2
    except BAD_INPUT as e:
        print(f"expertcache {name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"expertcache {name}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # the machine, not the input: a full disk, a quota, read-only storage
        import errno

        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG) and \
                "No space left on device" not in str(e):  # pyarrow's IO errors carry the text, not errno
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"expertcache {name}: error: {e.strerror or e}{where} (outputs are written to a temporary name "
              f"first: nothing complete was replaced)", file=sys.stderr)
        return 2
    if isinstance(result, bool):
        return 0
    if isinstance(result, int):
        return result
    if result is not None:
        print(json.dumps(result, indent=2, default=str))
    if isinstance(result, dict) and result.get("nothing_to_do"):
        return 0  # a finished run asked again: its verdict was already given when it ran
    if isinstance(result, dict) and result.get("gate") == "INCONCLUSIVE":
        return 3  # a gate whose intervals straddle a threshold: more blocks or documents would decide it
    if isinstance(result, dict) and (result.get("pass") is False or result.get("ok") is False):
        return 1  # a gate FAIL, a verify that found damage: a result, not bad input
    return 0


def train_cache_aware_main(argv: list[str] | None = None) -> int:
    """The `train-cache-aware` console script: `expertcache train-cache-aware` under its own name."""
    return main(["train-cache-aware", *(sys.argv[1:] if argv is None else argv)])


def exit_now(code: int) -> None:
    """Leave the process with `code` once the command is done, the way it would leave, but without the
    interpreter's teardown of every module: with torch, transformers and Lightning imported, that teardown took
    1.6-1.9 s after the last line was printed (`import lightning` and exit: 2.06 s; with os._exit: 0.19 s), on every
    command and on every process of a data-parallel run. What the normal exit does that matters still runs, in
    its order: other (non-daemon) threads are waited for, the atexit handlers run (wandb's, logging's flush), and
    the standard streams are flushed. Files are never left half-written by skipping the rest: outputs are written
    whole and closed before a command returns (`telemetry/atomic.py`). Under a profiler or a tracer (`python -m
    cProfile`, `-m trace`, a debugger), in interactive mode, or with EXPERTCACHE_FAST_EXIT=0, it leaves the normal
    way, so that what runs after the program still runs."""
    import atexit
    import os
    import threading

    if sys.getprofile() is not None or sys.gettrace() is not None or sys.flags.interactive \
            or os.environ.get("EXPERTCACHE_FAST_EXIT", "1") == "0":
        sys.exit(code)
    # what the interpreter's own exit does first: waits for the non-daemon threads, and before that tells idle
    # thread pools (concurrent.futures registers it there) to stop, whose workers would otherwise wait forever
    threading._shutdown()
    atexit._run_exitfuncs()
    lost = False
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a full disk, a closed pipe: the output did not all arrive
            lost = lost or stream is sys.stdout
    if lost and code == 0:  # as the interpreter reports an unflushable stdout: not a success
        try:
            os.write(2, b"expertcache: error: the output could not be written in full (stdout)\n")
        except OSError:
            pass
        code = 120
    os._exit(code)


def entry() -> None:
    """The `expertcache` console script: `main`'s exit status, left through `exit_now` (a bug's traceback, raised
    out of `main`, takes the normal way out)."""
    exit_now(main())


def train_cache_aware_entry() -> None:
    """The `train-cache-aware` console script (see `entry`)."""
    exit_now(train_cache_aware_main())


if __name__ == "__main__":
    entry()
