"""The one registry of names a user gives: cache policies (`telemetry/cache.py`), miss policies
(`runtime/engine/plan.py`), predictors (`runtime/engine/predictors.py`) and tiers (`runtime/storage/tiers.py`) are each one `Registry`
defined next to their implementations, modelled on lm-eval's registry. Each name is registered once; a check, a
listing and a construction all read it, and an unknown name gets the one error that lists what exists:

    unknown tier 'floppy'; expected one of: auto, disk, host, cuda, throttled:<GB/s>

A name may take an argument after a colon (`probe:2`, `estimator:FILE`, `throttled:16`), required or (with a
default) optional; the registry splits it, converts it and refuses one that is missing, extra or malformed.
Tags mark where a name is accepted, and `view(tag)` is the registry as one place sees it (the simulator's
policies, the live predictors): a filter over the same entries, never a second list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from .errors import InputError


@dataclass
class Entry:
    name: str
    obj: Any = None
    arg: str | None = None  # the argument's placeholder (`FILE`, `D`); None: the name takes no argument
    default: str | None = None  # the argument when none is given (then it is optional)
    convert: Callable[[str], Any] = str  # the argument's value; ValueError (or TypeError) when it is malformed
    arg_help: str = ""  # what a well-formed argument is, for the error when it is not
    tags: frozenset = field(default_factory=frozenset)
    aliases: tuple = ()  # other spellings, accepted but not listed

    def usage(self) -> str:
        if self.arg is None:
            return self.name
        return f"{self.name}[:<{self.arg}>]" if self.default is not None else f"{self.name}:<{self.arg}>"


class Spec(NamedTuple):
    """A parsed name: the registered name, its converted argument (None when it takes none), its object."""
    name: str
    arg: Any
    obj: Any


class Registry:
    def __init__(self, kind: str, *, _parent: "Registry | None" = None, _tags: frozenset = frozenset()):
        self.kind = kind  # how an error names what was given: "tier", "cache policy", ...
        self._entries: dict[str, Entry] = {} if _parent is None else _parent._entries
        self._parent, self._tags = _parent, _tags

    # --- registering -----------------------------------------------------------------------------------------

    def register(self, name: str, obj: Any = None, *, takes_arg: str | None = None, default: str | None = None,
                 convert: Callable[[str], Any] = str, arg_help: str = "", tags=(), aliases=()):
        """Register `name` now (with `obj`, or with None until the returned decorator is applied to one).
        `takes_arg`: the argument's placeholder (`"FILE"`), and `default` its value when the name is given bare.
        A name (or alias) registered twice is a programming error: ValueError."""
        if self._parent is not None:
            raise TypeError(f"a view of the {self.kind} registry is read-only; register on the registry")
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r}: expected a non-empty name without ':'")
        if default is not None and takes_arg is None:
            raise ValueError(f"{self.kind} {name!r}: a default argument needs takes_arg")
        for n in (name, *aliases):
            if self._lookup(n, everywhere=True) is not None:
                raise ValueError(f"{self.kind} {n!r} is already registered")
        e = Entry(name, obj, takes_arg, default, convert, arg_help, frozenset(tags), tuple(aliases))
        self._entries[name] = e
        if obj is not None:
            return obj

        def decorate(f):
            e.obj = f
            return f
        return decorate

    def view(self, *tags: str, kind: str | None = None) -> "Registry":
        """The entries carrying any of `tags` (live: a name registered later shows up too), read-only."""
        return Registry(kind or self.kind, _parent=self._parent or self, _tags=frozenset(tags))

    # --- reading ---------------------------------------------------------------------------------------------

    def _visible(self, e: Entry) -> bool:
        return not self._tags or bool(self._tags & e.tags)

    def _lookup(self, name: str, everywhere: bool = False) -> Entry | None:
        for e in self._entries.values():
            if (name == e.name or name in e.aliases) and (everywhere or self._visible(e)):
                return e
        return None

    def entries(self) -> list[Entry]:
        return [e for e in self._entries.values() if self._visible(e)]

    def names(self) -> tuple[str, ...]:
        """The registered names, in the order they were registered (no aliases, no arguments)."""
        return tuple(e.name for e in self.entries())

    def listing(self) -> str:
        """`a, b, c:<arg>, d[:<arg>]`: what the error for an unknown name lists."""
        return ", ".join(e.usage() for e in self.entries())

    def parse(self, spec: Any) -> Spec:
        """`name` or `name:arg` -> Spec(name, converted arg, obj), or one InputError line."""
        name, sep, arg = spec.partition(":") if isinstance(spec, str) else (None, "", "")
        e = self._lookup(name) if name is not None else None
        if e is None:
            raise InputError(f"unknown {self.kind} {spec!r}; expected one of: {self.listing()}")
        if e.arg is None:
            if sep:
                raise InputError(f"{self.kind} {spec!r}: {e.name} takes no argument")
            return Spec(e.name, None, e.obj)
        if not sep and e.default is not None:
            arg = e.default
        elif not arg:  # `estimator`, `estimator:`
            raise InputError(f"{self.kind} {spec!r}: expected {e.name}:<{e.arg}>"
                             + (f" ({e.arg_help})" if e.arg_help else ""))
        try:
            value = e.convert(arg)
        except InputError:  # a converter's own line (InputError is a ValueError)
            raise
        except (ValueError, TypeError):
            raise InputError(f"{self.kind} {spec!r}: expected {e.name}:<{e.arg}>"
                             + (f" ({e.arg_help})" if e.arg_help else "")) from None
        return Spec(e.name, value, e.obj)

    def get(self, spec: Any) -> Any:
        """The object registered under `spec`'s name (the spec checked whole, its argument included)."""
        return self.parse(spec).obj

    def __contains__(self, spec: Any) -> bool:
        try:
            self.parse(spec)
        except InputError:
            return False
        return True

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {self.listing()})"
