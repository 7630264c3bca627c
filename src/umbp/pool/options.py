"""One strict options layer for every umbp configuration surface (connector, DRAM, SSD, remote).

An option set is a frozen dataclass whose fields carry their rules and their one help string:

    @option_set
    class DramOptions(Options):
        where: ClassVar[str] = "DRAM pool option"
        capacity_bytes: int = option(help="arena size in bytes", above=0, gib_alias="dram_gb")
        prefault: bool = option(True, help="touch every arena page at start-up")

`DramOptions.from_options(mapping)` rejects unknown keys with a "did you mean", resolves unit aliases
(`dram_gb` -> `capacity_bytes`), and constructing the dataclass (from a mapping or directly, with keyword
arguments) checks every field against its annotation and rules. Every error is an `OptionValueError` or
`UnknownOptionError` (or the subclasses an option set names) whose message names the key. `table()`
renders the option set as the markdown table the README and docs embed (`python -m umbp.tools.options_doc`).

The rules are strict on purpose, because these values come from free-form JSON an operator typed:
* bool: true/false (JSON booleans) or the strings "true"/"false"; never 1/0, "yes", "on" (one spelling
  everywhere, and a number where a flag was meant is a typo).
* numbers: never a bool (True is an int in Python, but `dram_gb: true` is a mistake), never NaN or
  infinity (they pass every `<`/`>` range check and break arithmetic later); ints accept a float only
  when it is integral (JSON may write 1e9), so `dram_bytes: 1.5` is an error, not a silent 1.
* strings are not numbers: `"8"` for a size is rejected rather than guessed at.
* a secret never appears in a message or repr: a field's `show` renders it, with the secret hidden, and
  any other value a message quotes is shown through umbp.redact (secret-named keys hidden, URL credentials
  masked), since a wrongly typed value may be a dict or list holding one.

Why a small dataclass-metadata layer and not pydantic: umbp's core (pool, SSD tier, tools) must work
without vLLM, and pydantic would be a new hard dependency there; pydantic's default (lax) mode coerces
"1" and 1 to True and its strict mode rejects an int where a float is meant, so either way we would
wrap its messages to name keys our way; and the docs tables need per-option rules (GiB aliases, ranges,
secrets) that would live in pydantic metadata anyway. This module needs only the standard library. It
lives in `umbp.pool` beside the error classes it raises (`umbp.pool.errors`): a top-level module
importing them would import `umbp.pool`, whose tiers import this layer, in a cycle.

Option sets on it: the connector's (`umbp.vllm.config.UMBPConfig`), the DRAM pool's
(`umbp.pool.dram.tier.DramOptions`), the SSD tier's (`umbp.pool.ssd.options.SsdOptions`) and the shared
tier's (`umbp.pool.remote.config.RemoteConfig`, whose keys that only say where a value comes from, such
as `password_env`, are resolved in its `check`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar, Literal, Self, Union, get_args, get_origin, get_type_hints

from umbp.pool.errors import OptionValueError, UnknownOptionError, human_bytes
from umbp.redact import shown_value

GiB = 1 << 30
_META = "umbp.option"
_SHOWN_CHARS = 120  # a value longer than this is cut in messages (a pasted blob must not flood a log)


class Invalid(Exception):
    """Raised by a field's `convert`: `want` says what the value must be ("a Redis URL or ...")."""

    def __init__(self, want: str, *, reason: str | None = None) -> None:
        super().__init__(want)
        self.want = want
        self.reason = reason  # a full sentence instead of "must be <want>, got <value>"


@dataclass(frozen=True)
class Spec:
    """The rules and documentation of one option (kept in its dataclass field's metadata)."""

    help: str
    minimum: float | None = None  # inclusive lower bound
    above: float | None = None  # exclusive lower bound
    maximum: float | None = None  # inclusive upper bound
    choices: tuple[Any, ...] = ()  # allowed values (compared with their type: 1 is not True)
    nonempty: bool = False  # strings (and each string of a list) must not be empty
    gib_alias: str | None = None  # a second key that gives this byte count in GiB (2**30)
    convert: Callable[[Any], Any] | None = None  # own rule: the normalized value, or raise Invalid
    show: Callable[[Any], str] | None = None  # how a value appears in messages and repr
    default_doc: str | None = None  # the default as the docs table shows it
    type_doc: str | None = None  # the type as the docs table shows it
    error: type[Exception] | None = None  # a narrower error class for this option (a subclass of value_error)


def option(default: Any = MISSING, *, help: str, **rules: Any) -> Any:
    """A dataclass field with rules (see Spec); no default makes the option required."""
    return field(default=default, metadata={_META: Spec(help, **rules)})


def option_set(cls: type) -> type:
    """Decorator: a frozen dataclass keeping the secret-aware repr of `Options`."""
    return dataclass(frozen=True, repr=False)(cls)


def auto_or_bool(value: Any) -> bool | str:
    """A `convert` for tri-state options ("auto", true, false), e.g. page-locked memory or O_DIRECT."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "true", "false"):
        return {"auto": "auto", "true": True, "false": False}[value.strip().lower()]
    if isinstance(value, bool):
        return value
    raise Invalid("'auto', true or false")


def hide_secret(value: Any) -> str:
    return "<hidden>" if value else repr(value)


class Options:
    """Base of an option set; subclasses are `@option_set` dataclasses whose fields use `option()`."""

    where: ClassVar[str] = "option"  # how messages introduce a key: "umbp: DRAM pool option 'x' ..."
    unknown_error: ClassVar[type[Exception]] = UnknownOptionError
    value_error: ClassVar[type[Exception]] = OptionValueError

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            spec = f.metadata.get(_META)
            if spec is not None:
                object.__setattr__(
                    self, f.name, self._coerce(f.name, hints[f.name], spec, getattr(self, f.name))
                )
        self.check()

    def check(self) -> None:
        """Rules between options; override and raise `self.fail(...)`."""

    # ---- building from a mapping ---------------------------------------------------------------------

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> Self:
        """Build from a config mapping: unknown keys are named (with a "did you mean"), aliases resolved."""
        options = dict(options or {})
        bad_names = [k for k in options if not isinstance(k, str)]
        if bad_names:
            raise cls.unknown_error(
                f"umbp: {cls.where} names must be strings, got {shown_value(bad_names[0])}"
            )
        cls._reject_unknown(options)
        values: dict[str, Any] = {}
        for f in _option_fields(cls):
            spec: Spec = f.metadata[_META]
            if spec.gib_alias and spec.gib_alias in options:
                if f.name in options:
                    raise cls.value_error(
                        f"umbp: give {cls.where} '{spec.gib_alias}' or '{f.name}', not both"
                    )
                values[f.name] = cls._from_gib(spec.gib_alias, spec, options[spec.gib_alias])
            elif f.name in options:
                values[f.name] = options[f.name]
            elif f.default is MISSING:
                alias = f" (or '{spec.gib_alias}' in GiB)" if spec.gib_alias else ""
                raise cls.value_error(f"umbp: {cls.where} '{f.name}'{alias} is required")
        return cls(**values)

    @classmethod
    def _reject_unknown(cls, options: Mapping[str, Any]) -> None:
        names = cls.option_names()
        unknown = sorted(set(options) - set(names))
        if not unknown:
            return
        hints = [m for k in unknown for m in difflib.get_close_matches(k, names, n=1)]
        hint = f" (did you mean {', '.join(repr(h) for h in hints)}?)" if hints else ""
        raise cls.unknown_error(
            f"umbp: unknown {cls.where}(s) {', '.join(repr(k) for k in unknown)}{hint}; "
            f"valid options: {', '.join(names)}"
        )

    @classmethod
    def _from_gib(cls, alias: str, spec: Spec, value: Any) -> int:
        hi = None if spec.maximum is None else spec.maximum / GiB
        gib = cls._coerce(alias, float, Spec(spec.help, above=0, maximum=hi, error=spec.error), value)
        nbytes = int(gib * GiB)
        try:
            _check_range(spec, nbytes)
        except Invalid:
            raise cls.error(
                alias, value, f"a number of GiB giving {_range_doc(spec, True)} bytes", spec
            ) from None
        return nbytes

    # ---- one value -----------------------------------------------------------------------------------

    @classmethod
    def _coerce(cls, name: str, hint: Any, spec: Spec, value: Any) -> Any:
        try:
            out = spec.convert(value) if spec.convert else _by_type(hint, spec, value)
            _check_range(spec, out)
            if spec.choices and not any(type(out) is type(c) and out == c for c in spec.choices):
                raise Invalid("one of " + ", ".join(_json(c) for c in spec.choices))
        except Invalid as bad:
            if bad.reason:
                raise cls.value_error(f"umbp: {cls.where} '{name}': {bad.reason}") from None
            raise cls.error(name, value, bad.want, spec) from None
        return out

    @classmethod
    def error(cls, name: str, value: Any, want: str, spec: Spec | None = None) -> Exception:
        """'umbp: <where> '<name>' must be <want>, got <value>' as this option set's error class."""
        kind = spec.error if spec is not None and spec.error else cls.value_error
        return kind(f"umbp: {cls.where} '{name}' must be {want}, got {_shown(spec, value, name)}")

    @classmethod
    def fail(cls, message: str) -> Exception:
        return cls.value_error(f"umbp: {message}")

    # ---- documentation ---------------------------------------------------------------------------------

    @classmethod
    def option_names(cls) -> list[str]:
        """Every key a mapping may hold, in table order (a GiB alias right after its byte option)."""
        names: list[str] = []
        for f in _option_fields(cls):
            names.append(f.name)
            alias = f.metadata[_META].gib_alias
            if alias:
                names.append(alias)
        return names

    @classmethod
    def option_help(cls) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in _option_fields(cls):
            spec: Spec = f.metadata[_META]
            out[f.name] = spec.help
            if spec.gib_alias:
                out[spec.gib_alias] = f"`{f.name}` in GiB (2**30 bytes), a number; give one of the two"
        return out

    @classmethod
    def table(cls) -> str:
        """The markdown table of this option set (key, type, default, meaning)."""
        hints = _hints(cls)
        rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in _option_fields(cls):
            spec: Spec = f.metadata[_META]
            rows.append(
                f"| `{f.name}` | {_type_doc(hints[f.name], spec)} | {_default_doc(f, spec)} | {spec.help} |"
            )
            if spec.gib_alias:
                hi = "" if spec.maximum is None else f" and <= {_num(spec.maximum / GiB, False)}"
                rows.append(
                    f"| `{spec.gib_alias}` | number > 0{hi} | — | "
                    f"`{f.name}` in GiB (2**30 bytes); give one of the two |"
                )
        return "\n".join(rows) + "\n"

    def __repr__(self) -> str:
        parts = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            spec = f.metadata.get(_META)
            value = getattr(self, f.name)
            parts.append(f"{f.name}={spec.show(value) if spec and spec.show else repr(value)}")
        return f"{type(self).__name__}({', '.join(parts)})"

    __str__ = __repr__


# ---- helpers ---------------------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _option_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if _META in f.metadata]  # type: ignore[arg-type]


def _shown(spec: Spec | None, value: Any, name: str = "") -> str:
    """How an error shows a value: through the option's `show`, else redacted (umbp.redact.shown_value: a
    wrongly typed value may be a dict or list holding a password, a token or a URL with credentials)."""
    try:
        text = spec.show(value) if spec is not None and spec.show else shown_value(value, name)
    except Exception:  # a show() must never turn an error message into a different error
        text = f"a {type(value).__name__}"
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def _json(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def _union_args(hint: Any) -> tuple[Any, ...] | None:
    if get_origin(hint) in (Union, types.UnionType):
        return get_args(hint)
    return None


def _by_type(hint: Any, spec: Spec, value: Any) -> Any:
    args = _union_args(hint)
    if args is not None:
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _by_type(rest[0], spec, value)
        if value is None:
            raise Invalid(_want(hint, spec))
        for arg in rest:  # the first member that accepts the value wins
            try:
                return _by_type(arg, spec, value)
            except Invalid:
                continue
        raise Invalid(_want(hint, spec))
    if get_origin(hint) is Literal:
        if not any(type(value) is type(c) and value == c for c in get_args(hint)):
            raise Invalid("one of " + ", ".join(_json(c) for c in get_args(hint)))
        return value
    if hint is bool:
        return _as_bool(value)
    if hint is int:
        return _as_int(value, spec)
    if hint is float:
        return _as_float(value, spec)
    if hint is str:
        if not isinstance(value, str) or (spec.nonempty and not value):
            raise Invalid(_want(hint, spec))
        return value
    if get_origin(hint) is tuple and get_args(hint)[1:] == (Ellipsis,) and get_args(hint)[0] is str:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(
            isinstance(s, str) and (s or not spec.nonempty) for s in items
        ):
            raise Invalid(_want(hint, spec))
        return tuple(items)
    raise TypeError(f"umbp.pool.options: no rule for the annotation {hint!r}; give the option a convert=")


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise Invalid("true or false")


def _as_int(value: Any, spec: Spec) -> int:
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(_want(int, spec))
    return value


def _as_float(value: Any, spec: Spec) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Invalid(_want(float, spec))
    return float(value)


def _check_range(spec: Spec, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if (
        (spec.minimum is not None and value < spec.minimum)
        or (spec.above is not None and value <= spec.above)
        or (spec.maximum is not None and value > spec.maximum)
    ):
        raise Invalid(_want(int if isinstance(value, int) else float, spec))


def _num(x: float, integer: bool) -> str:
    """A bound as people read it: 2**50 rather than 1125899906842624."""
    if x >= 1 << 20 and x == int(x) and int(x) & (int(x) - 1) == 0:
        return f"2**{int(x).bit_length() - 1}"
    return str(int(x)) if integer or x == int(x) else f"{x:g}"


def _range_doc(spec: Spec, integer: bool) -> str:
    def num(x: float) -> str:
        return _num(x, integer)

    parts = []
    if spec.above is not None:
        parts.append(f"> {num(spec.above)}")
    if spec.minimum is not None:
        parts.append(f">= {num(spec.minimum)}")
    if spec.maximum is not None:
        parts.append(f"<= {num(spec.maximum)}")
    return " and ".join(parts)


def _want(hint: Any, spec: Spec) -> str:
    if spec.type_doc:
        return spec.type_doc
    args = _union_args(hint)
    if args is not None:
        return " or ".join("null" if a is type(None) else _want(a, spec) for a in args)
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(_json(c) for c in get_args(hint))
    if hint is bool:
        return "true or false"
    if hint in (int, float):
        kind = "an integer" if hint is int else "a finite number"
        rng = _range_doc(spec, hint is int)
        return f"{kind} {rng}" if rng else kind
    if hint is str:
        return "a non-empty string" if spec.nonempty else "a string"
    if get_origin(hint) is tuple:
        return "a string or a list of non-empty strings" if spec.nonempty else "a string or a list of strings"
    return str(hint)


def _doc_value(value: Any) -> str:
    return f"`{value}`" if isinstance(value, str) else f"`{_json(value)}`"


def _type_doc(hint: Any, spec: Spec) -> str:
    if spec.type_doc:
        return spec.type_doc
    if spec.choices:
        return "one of " + ", ".join(_doc_value(c) for c in spec.choices)
    args = _union_args(hint)
    if args is not None:
        return " or ".join("null" if a is type(None) else _type_doc(a, spec) for a in args)
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(_doc_value(c) for c in get_args(hint))
    if hint in (int, float):
        rng = _range_doc(spec, hint is int)
        return ("int" if hint is int else "number") + (f" {rng}" if rng else "")
    if hint is bool:
        return "bool"
    if hint is str:
        return "string"
    if get_origin(hint) is tuple:
        return "string or list of strings"
    return str(hint)


def _default_doc(f: dataclasses.Field, spec: Spec) -> str:
    if spec.default_doc is not None:
        return spec.default_doc
    if f.default is MISSING:
        return "required"
    value = f.default
    if value is None or value == ():
        return "none"
    if isinstance(value, int) and not isinstance(value, bool) and f.name.endswith("_bytes") and value >= 1024:
        return human_bytes(value)
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return (
        f"`{_json(value)}`"
        if isinstance(value, bool)
        else f"{value:g}"
        if isinstance(value, float)
        else str(value)
    )
