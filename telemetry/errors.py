"""The one exception type for bad input, shared by every area (telemetry is the root of the import graph)."""


class InputError(ValueError):
    """Input that does not fit what it is given to (a file, a trace, a recipe key, a size).

    Raised where the input enters, with the value and what was expected. The CLI prints its message as one
    line and exits with status 2; any other exception is a bug and keeps its traceback.
    """


# what a command or a script reports as bad input (one line, exit 2): the package's own refusal, and a path given
# that is not there, not a file or folder as asked, in the way, or not ours to read or write
BAD_INPUT = (InputError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)


def run_script(main, *args) -> int:
    """A script's entry, `sys.exit(run_script(main))`: what `main(*args)` returns as an exit status (None: 0); bad
    input the package refuses (an InputError, a file or folder that is not there, not one, or in the way) is one
    line, the script's name and the message, and exit 2, as the CLI does; anything else is a bug and keeps its
    traceback."""
    import sys
    from pathlib import Path

    prog = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "script"
    try:
        rc = main(*args)
    except BAD_INPUT as e:
        print(f"{prog}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return rc if isinstance(rc, int) else 0


def _typed(name: str, kind, ok):
    """An argparse `type=` that parses with `kind` and refuses what `ok` refuses; argparse then says `argument
    --X: invalid <name> value: '...'` (a usage line and that one line, exit 2) before any work."""
    def parse(text: str):
        v = kind(text)
        if not ok(v):
            raise ValueError(text)
        return v
    parse.__name__ = name
    return parse


count = _typed("integer >= 1", int, lambda v: v >= 1)  # rounds, tokens, steps, layers, clients ...
nonnegative = _typed("integer >= 0", int, lambda v: v >= 0)  # warm-up steps, a seed
positive = _typed("number > 0", float, lambda v: v > 0 and v != float("inf"))  # seconds, GB
fraction = _typed("fraction in (0, 1]", float, lambda v: 0 < v <= 1)  # a cache capacity as a fraction of E


def check_counts(zero_ok: tuple[str, ...] = (), **counts) -> None:
    """The bench subcommands' counts (rounds, tokens, steps, ...): each an integer >= 1, those named in `zero_ok`
    (a warm-up, a seed, a depth) >= 0; the ones given wrong refused in one line before any work, e.g.
    `--rounds 0, --tokens -1: counts must be >= 1 (--warmup >= 0)`."""
    bad = [f"--{k} {v}" for k, v in counts.items() if not _is_count(v, 0 if k in zero_ok else 1)]
    if bad:
        also = [k for k in zero_ok if k in counts]
        raise InputError(f"{', '.join(bad)}: counts must be >= 1"
                         + (f" ({', '.join('--' + k for k in also)} >= 0)" if also else ""))


def check_count_list(name: str, values, what: str, example: str) -> None:
    """A bench option that is a non-empty list of counts >= 1 (thread counts, client counts), refused in one line,
    e.g. `--levels [0, 8]: expected client counts >= 1 (e.g. [1,8,16])`."""
    if not values or not all(_is_count(v, 1) for v in values):
        raise InputError(f"--{name} {values}: expected {what} counts >= 1 (e.g. {example})")


def _is_count(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least
