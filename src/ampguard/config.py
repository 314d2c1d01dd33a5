"""The one typed configuration tree: defaults, loading (YAML, JSON, TOML), ``--set`` overrides.

Every field is documented where it is defined (the docstring under it). The tree is validated
once, at load; unknown keys, wrong types and impossible values raise :class:`ConfigError` with
one line that names the key, e.g. ``optimizer.lr: must be a finite number >= 0 (got nan)``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, ValidationError, ValidationInfo, field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

# (none of these imports torch: a config is loaded and validated without it, `train --print-config` too)
from .errors import (DEFAULT_MIN_STEPS, MAX_COUNT, MAX_WINDOW, ConfigError, InputError, brief, failed_because,
                     first_line, has_control, shortened)
from .fault_specs import parse_fault
from .precision_rules import (DEFAULT_MIN_SCALE, MAX_SCALE, PrecisionName, loss_scaler_runs, scaler_range_problem,
                              uses_loss_scaler)


MAX_FILE_BYTES = 1 << 20
"""A config file larger than this (1 MiB) is refused: configs are a page, not a data set."""
MAX_DEPTH = 32
"""How deeply a config may nest mappings and lists (the tree itself is 3 levels deep)."""
MAX_SEED = 2**32 - 1
"""Seeds go to torch, NumPy and ``random``; NumPy's global RNG takes at most 2**32 - 1."""
MAX_NAME = 100
"""The longest run-folder name (``log.name``); file systems stop at 255 bytes for the whole name."""


_INT_12 = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)\Z")
"""YAML 1.2's integers (core schema): decimal (``010`` is ten), ``0o17`` octal and ``0x1f`` hex."""
_FLOAT_12 = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))\Z")
"""YAML 1.2's floats (core schema): ``1e-3``, ``.5``, ``5.``, ``-1.5e+3``, ``.inf``, ``-.inf``, ``.nan``."""
_MERGE = "tag:yaml.org,2002:merge"
"""The tag PyYAML resolves a plain ``<<`` to (YAML 1.1's merge key, which a config does not take)."""
_NUMBER_RESOLVERS = (("tag:yaml.org,2002:int", _INT_12, list("-+0123456789")),  # (ints first: "10" fits both)
                     ("tag:yaml.org,2002:float", _FLOAT_12, list("-+.0123456789")))


def _yaml12_number(text: str, tag: str) -> int | float:
    """The number YAML 1.2 reads ``text`` as, for an int or float ``tag``; ValueError if it is none."""
    if tag.endswith(":int") and _INT_12.match(text):
        base = {"0o": 8, "0x": 16}.get(text[:2], 10)
        return int(text if base == 10 else text[2:], base)
    if tag.endswith(":float") and _FLOAT_12.match(text):
        bare = text.lstrip("+-").lower()  # (Python's float() reads inf and nan, not YAML's .inf and .nan)
        if bare == ".nan":
            return math.nan
        if bare == ".inf":
            return -math.inf if text.startswith("-") else math.inf
        return float(text)
    raise ValueError(f"{text!r} is not a YAML 1.2 {tag.rpartition(':')[2]}")


class _PlainLoader(yaml.SafeLoader):
    """YAML as plain data: no aliases (a few hundred bytes of nested aliases expand to gigabytes),
    only the JSON types (a date, ``!!binary`` or ``!!set`` is refused by :func:`_plain`), and
    YAML 1.2's scalars (the README's promise), not PyYAML's 1.1 ones: ``true`` and ``false`` are
    the only booleans, so ``log.name=off`` is the name "off", not False (a boolean setting still
    takes yes/no/on/off: the config's validation reads them); ``010`` is ten, not octal 8, and
    ``0o17`` is octal; ``1e-3`` is a float; ``1:30``, ``1_000`` and ``0b11`` are text, not 90,
    1000 and 3.

    Example::

        >>> yaml.load("[off, yes, true, False]", Loader=_PlainLoader)
        ['off', 'yes', True, False]
        >>> yaml.load("[010, 0o17, 0x1f, 1e-3, 5., .inf, 1:30, 1_000, 0b11]", Loader=_PlainLoader)
        [10, 15, 31, 0.001, 5.0, inf, '1:30', '1_000', '0b11']
        >>> yaml.load("optimizer:\\n  lr: 0.1\\nsteps: 3\\noptimizer:\\n  weight_decay: 0.0\\n", Loader=_PlainLoader)
        Traceback (most recent call last):
        ...
        yaml.error.YAMLError: key 'optimizer' appears twice (lines 1 and 4)
        >>> yaml.load("steps: 3\\noptimizer:\\n  <<: {lr: 1}\\n", Loader=_PlainLoader)
        Traceback (most recent call last):
        ...
        yaml.error.YAMLError: YAML merge keys (<<) are not supported (line 3): write the keys out
        >>> yaml.load("[<<, '<<']", Loader=_PlainLoader)  # (a value `<<` is text)
        ['<<', '<<']
        >>> yaml.load("%YAML 1.1\\n---\\nsteps: 010\\n", Loader=_PlainLoader)
        Traceback (most recent call last):
        ...
        yaml.error.YAMLError: the file declares %YAML 1.1; configs are read as YAML 1.2 (010 is ten, yes is text): drop the directive, or declare %YAML 1.2
    """

    yaml_implicit_resolvers = {  # (YAML 1.2's booleans and numbers are added below the class)
        first: [(tag, regexp) for tag, regexp in resolvers
                if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def process_directives(self) -> Any:
        # (a file that declares %YAML 1.1 was read as 1.2 all the same, unsaid: its 010 ten, not 8;
        # review 51f): refused, naming the directive
        found = super().process_directives()
        if self.yaml_version not in (None, (1, 2)):
            version = ".".join(map(str, self.yaml_version))
            raise yaml.YAMLError(f"the file declares %YAML {version}; configs are read as YAML 1.2 (010 is ten, "
                                 "yes is text): drop the directive, or declare %YAML 1.2")
        return found

    def compose_node(self, parent: Any, index: Any) -> Any:
        # (a mapping's value is composed with its key as `index`; the value of a merge key is refused
        # with the key, before its alias: `<<: *base`, the usual merge, was named an alias)
        if isinstance(index, yaml.Node) and index.tag == _MERGE:
            raise _merge_key(index)
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.YAMLError(f"aliases (*name) are not allowed in a config (line {mark.line + 1})")
        return super().compose_node(parent, index)

    def construct_number(self, node: Any) -> Any:
        # (PyYAML's own constructors read 010 as octal and 1:30 as 90, and fail on 0o17; an explicit
        # !!int or !!float takes YAML 1.2's forms only: !!int 1:30 is refused, not 90)
        try:
            return _yaml12_number(self.construct_scalar(node), node.tag)
        except ValueError as err:
            raise yaml.constructor.ConstructorError(None, None, str(err), node.start_mark) from None

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        # (PyYAML checks the node's kind in its own construct_mapping, after the loop below has
        # unpacked node.value: `!!map [1, 2]` or `!!set [1]` was a TypeError traceback)
        if not isinstance(node, yaml.MappingNode):
            raise _wrong(node, "a mapping", f"a {node.id}")
        # a key given twice: YAML 1.2 says keys are unique, and PyYAML's last-wins dropped the first
        # silently (a second `optimizer:` section reset the first one's lr to its default)
        # A number key is the same key as an equal number (`010:` and `10:`: one dict entry) and as
        # the text it becomes (`1:` and `'1':` were both "1", the first dropped; two `.nan:` keys
        # never equal as numbers)
        lines: dict[Any, tuple[int, str]] = {}  # each key -> the line and spelling it was first given with
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:  # (PyYAML's error named no constructor for its tag, not the `<<`)
                raise _merge_key(key_node)
            key = self.construct_object(key_node, deep=deep)
            line, spelled = key_node.start_mark.line + 1, str(getattr(key, "text", key))
            if isinstance(key, (str, int, float, bool)):
                names = (key, key.text) if isinstance(key, _Written) else (key,)
                seen = next((name for name in names if name in lines), None)
                if seen is not None:
                    first, as_first = lines[seen]
                    where = f"lines {first} and {line}" if first != line else f"line {line}"
                    also = f", first as {as_first!r}" if as_first != spelled else ""
                    raise yaml.YAMLError(f"key {spelled!r} appears twice{also} ({where})")
                lines.update(dict.fromkeys(names, (line, spelled)))
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_bool(self, node: Any) -> Any:
        # (PyYAML looks the word up in its dict of YAML 1.1's words: `!!bool maybe` was a KeyError;
        # those words, yes/no/on/off, still read as a boolean setting reads them)
        word = self.construct_scalar(node)
        if word.lower() not in self.bool_values:
            raise _wrong(node, "true or false", repr(word))
        return self.bool_values[word.lower()]

    def construct_yaml_timestamp(self, node: Any) -> Any:
        # (PyYAML uses its date pattern's match unchecked: `!!timestamp x` was an AttributeError;
        # a date is refused as a config value anyway, by _plain, naming its key)
        text = self.construct_scalar(node)
        if not self.timestamp_regexp.match(text):
            raise _wrong(node, "a date", repr(text))
        return super().construct_yaml_timestamp(node)


def _merge_key(key_node: Any) -> yaml.YAMLError:
    """The refusal of a YAML merge key (``<<``), naming its line.

    Example::

        >>> yaml.load("base: &b {lr: 1}\\noptimizer:\\n  <<: *b\\n", Loader=_PlainLoader)
        Traceback (most recent call last):
        ...
        yaml.error.YAMLError: YAML merge keys (<<) are not supported (line 3): write the keys out
    """
    return yaml.YAMLError(f"YAML merge keys (<<) are not supported (line {key_node.start_mark.line + 1}): "
                          "write the keys out")


def _wrong(node: Any, expected: str, got: str) -> yaml.constructor.ConstructorError:
    """The refusal of an explicitly tagged YAML value that its tag cannot take (``!!map [1, 2]``),
    its first line (what the error line shows) naming the tag and the line.

    Example::

        >>> yaml.load("a: 1\\nb: !!bool maybe\\n", Loader=_PlainLoader)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        yaml.constructor.ConstructorError: !!bool takes true or false, not 'maybe' (line 2)
        ...
        >>> yaml.load("!!set [1]", Loader=_PlainLoader)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        yaml.constructor.ConstructorError: !!set takes a mapping, not a sequence (line 1)
        ...
    """
    tag = node.tag.replace("tag:yaml.org,2002:", "!!")
    return yaml.constructor.ConstructorError(
        None, None, f"{tag} takes {expected}, not {got} (line {node.start_mark.line + 1})", node.start_mark)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (``json``'s last-wins would drop the first).

    Example::

        >>> json.loads('{"steps": 3, "steps": 4}', object_pairs_hook=_unique_keys)
        Traceback (most recent call last):
        ...
        ValueError: key 'steps' appears twice
    """
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"key {key!r} appears twice")
        data[key] = value
    return data


_PlainLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))
for _tag, _regexp, _first in _NUMBER_RESOLVERS:
    _PlainLoader.add_implicit_resolver(_tag, _regexp, _first)
    # (through the loader's own method, so a subclass's construct_number is the one called)
    _PlainLoader.add_constructor(_tag, lambda loader, node: loader.construct_number(node))
# (PyYAML registered its own functions for these tags: the methods above are not called unless registered)
_PlainLoader.add_constructor("tag:yaml.org,2002:bool", _PlainLoader.construct_yaml_bool)
_PlainLoader.add_constructor("tag:yaml.org,2002:timestamp", _PlainLoader.construct_yaml_timestamp)
# (YAML 1.2 has no merge keys: `<<` as a key is refused in construct_mapping, naming it; as a value it is text)
_PlainLoader.add_constructor(_MERGE, lambda loader, node: loader.construct_scalar(node))


class _Written:
    """A number read from YAML that remembers how it was written (``text``), so that a setting
    that is text (``log.name``) takes ``010`` as "010", not as ten ("10"): see :func:`_as_written`."""

    text: str


class _WrittenInt(_Written, int):
    pass


class _WrittenFloat(_Written, float):
    pass


class _TextKeepingLoader(_PlainLoader):
    """:class:`_PlainLoader` whose numbers are :class:`_Written`: what :func:`read_file` and
    ``--set`` use; :func:`_as_written` then turns each into a number or its text."""

    def construct_number(self, node: Any) -> Any:
        value = super().construct_number(node)
        written = (_WrittenInt if isinstance(value, int) else _WrittenFloat)(value)
        written.text = node.value
        return written


def _plain(value: Any, where: str = "", depth: int = 0) -> None:
    """Refuse anything but JSON's types (str, int, float, bool, None, lists, string-keyed
    mappings), nested at most :data:`MAX_DEPTH` deep, naming where."""
    if depth > MAX_DEPTH:
        raise ConfigError(f"config: {where or 'the top level'}: nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, _Written)):  # (a number YAML read as a key is its text: a name)
                raise ConfigError(f"config: {where or 'the top level'}: key {key!r} is not a string")
            _plain(item, f"{where}.{key}" if where else key, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _plain(item, f"{where}[{i}]", depth + 1)
    elif not (value is None or isinstance(value, (str, bool, int, float))):
        raise ConfigError(f"config: {where}: a {type(value).__name__} is not a config value (use a string or a number)")


def is_plain(value: Any) -> bool:
    """Whether ``value`` is plain config data (JSON's types, at most :data:`MAX_DEPTH` deep), as
    ``config.yaml`` and a checkpoint's embedded config must be.

    Example::

        >>> is_plain({"steps": 3, "inject": ["nan_loss@2"]}), is_plain({"seed": b"x"}), is_plain({1: 2})
        (True, False, False)
    """
    try:
        _plain(value)
    except ConfigError:
        return False
    return True


def _home(path: str | None) -> str | None:
    """A path setting's leading ``~`` as the home folder (``--set log.dir=~/runs`` is not expanded
    by the shell): it made a folder named ``~`` in the working folder, a trap for ``rm -rf ~``.

    Example::

        >>> _home("~/runs") == os.path.join(os.path.expanduser("~"), "runs"), _home("runs"), _home(None)
        (True, 'runs', None)
    """
    return None if path is None else os.path.expanduser(path)


def _path(path: str | None) -> str | None:
    """A path setting (``log.dir``, ``task.factory``...) as :func:`_home` gives it, refused if it
    holds a control character, as ``log.name`` is: a NUL reached the OS ("embedded null byte")
    and stderr as a raw byte, and a newline would break the one-line messages naming the path.

    Example::

        >>> _path("runs"), _path(None)
        ('runs', None)
        >>> _path("a\\0b")
        Traceback (most recent call last):
        ...
        ValueError: holds a control character (got 'a\\x00b')
    """
    if path is not None and has_control(path):
        raise ValueError(f"holds a control character (got {brief(path)})")
    return _home(path)


def _listed_once(values: list[str], why: str = "") -> list[str]:
    """``values``, or a ``ValueError`` naming those listed more than once (``why`` added).

    Example::

        >>> _listed_once(["fp16", "bf16"])
        ['fp16', 'bf16']
        >>> _listed_once(["b", "a", "b", "a"])
        Traceback (most recent call last):
        ...
        ValueError: a, b listed more than once
    """
    twice = sorted({value for value in values if values.count(value) > 1})
    if twice:  # (each cut short: a name of thousands of characters is no line)
        raise ValueError(f"{', '.join(shortened(str(value), 40) for value in twice)} listed more than once{why}")
    return values


def _number_check(value: Any) -> Any:
    """The check before an int or float setting: a number, not a boolean and not text.

    Text where a number belongs is a wrong type (DESIGN: an error that names the key): pydantic's
    lax mode read ``steps: "2"`` as 2, ``lr: "1e-3"`` as 0.001 and ``1_000`` (text in YAML 1.2) as
    1000 the way Python does; it read true/false as 1/0. A whole float where an int belongs
    (``steps: 1e4``, a float in YAML 1.2) stays a number: pydantic takes it when it is whole and
    refuses ``2.5``.

    Example::

        >>> validate({"steps": "2"})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: steps: expected a number, got the text '2'
        >>> validate({"steps": 1e4}).steps
        10000
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    if isinstance(value, str):
        raise ValueError(f"expected a number, got the text {brief(value)}")
    return value


_BOOL_WORDS = frozenset({"true", "false", "yes", "no", "on", "off"})
"""The text a boolean setting takes (YAML 1.2 reads yes/no/on/off as text: README)."""


def _bool_check(value: Any) -> Any:
    """The check before a boolean setting: true or false (or yes/no, on/off), not a number and
    not other text: pydantic's lax mode read ``compile: 1``, ``fast: 1.0`` and ``strict: "1"`` as
    true (review 51f), where a number setting refuses a boolean.

    Example::

        >>> validate({"compile": 1})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: compile: expected true or false, got 1
        >>> validate({"compile": "yes"}).compile, validate({"fast": None}).fast
        (True, None)
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
        return value
    raise ValueError(f"expected true or false, got {'the text ' if isinstance(value, str) else ''}{brief(value)}")


def _at_least(low: float, *, strict: bool = False, finite: bool = False) -> Any:
    """A bound as a reusable validator: ``>= low`` (``> low`` when strict), finite if asked."""
    relation = ">" if strict else ">="

    def check(value: float) -> float:
        below = not (value > low if strict else value >= low)  # also true for nan
        if below or (finite and not math.isfinite(value)):
            what = "a finite number " if finite else ""
            raise ValueError(f"must be {what}{relation} {low:g} (got {brief(value)})")
        return value

    return AfterValidator(check)


def _at_most(value: int, high: int) -> int:
    if value > high:
        raise ValueError(f"must be <= {high} (got {brief(value)})")  # (an int of 4,000 digits: cut short)
    return value


def _at_most_one(value: float) -> float:
    if value > 1.0:
        raise ValueError(f"must be in (0, 1] (got {value!r})")
    return value


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number (got {value!r})")
    return value


def _float32(value: float) -> float:
    """At most the largest float32: a setting the step applies to float32 tensors (a larger one
    failed at the first step, "value cannot be converted to type float without overflow")."""
    if value > MAX_SCALE:
        raise ValueError(f"must be <= {MAX_SCALE:.6g}, the largest float32 (got {brief(value)})")
    return value


def _rate(value: float) -> float:
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"must be in [0, 1] (got {value!r})")
    return value + 0.0  # (-0.0 is 0: the run card said "skip rate > -0")


HomePath = Annotated[str | None, AfterValidator(_path)]  # a path setting: ~ is the home folder, no control character
Int = Annotated[int, BeforeValidator(_number_check)]
Float = Annotated[float, BeforeValidator(_number_check)]
Bool = Annotated[bool, BeforeValidator(_bool_check)]
_COUNT_CAP = AfterValidator(lambda v: _at_most(v, MAX_COUNT))
Count = Annotated[Int, _at_least(1), _COUNT_CAP]  # a positive whole number
Count0 = Annotated[Int, _at_least(0), _COUNT_CAP]  # zero allowed
Window = Annotated[Int, _at_least(1), AfterValidator(lambda v: _at_most(v, MAX_WINDOW))]  # a rolling window's size
Amount = Annotated[Float, _at_least(0.0, finite=True)]  # a finite number >= 0
Positive = Annotated[Float, _at_least(0.0, strict=True, finite=True)]  # a finite number > 0
Float32 = AfterValidator(_float32)  # (and at most the largest float32: applied to float32 tensors)
Rate = Annotated[Float, AfterValidator(_rate)]  # in [0, 1]


class _Section(BaseModel):
    # (coerce_numbers_to_str: a name given as 2024 is the name "2024")
    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True,
                              coerce_numbers_to_str=True)


class OptimizerConfig(_Section):
    """``optimizer``: which optimizer and its hyper-parameters.

    Example::

        >>> OptimizerConfig(lr=0.01).betas
        (0.9, 0.95)
        >>> validate({"optimizer": {"betas": [0.9, 1.0]}})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: optimizer.betas: each beta must be in [0, 1) (got [0.9, 1.0])
    """

    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer: AdamW, or SGD with momentum."""
    lr: Annotated[Amount, Float32] = 3e-3
    """Peak learning rate (after warmup)."""
    weight_decay: Annotated[Amount, Float32] = 0.0
    """Decoupled weight decay (AdamW: ``lr x weight_decay`` below 1) or L2 penalty (SGD)."""
    betas: tuple[Float, Float] = (0.9, 0.95)
    """AdamW's moment decay rates, each in [0, 1)."""
    eps: Annotated[Positive, Float32] = 1e-8
    """AdamW's denominator epsilon."""
    momentum: Float = 0.9
    """SGD momentum in [0, 1)."""
    fused: Bool | None = None
    """Use the optimizer's fused kernel, AdamW's or SGD's (None: PyTorch's default; the fast path always does)."""

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(math.isfinite(b) and 0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1) (got {list(v)})")
        return v

    @field_validator("momentum")
    @classmethod
    def _momentum(cls, v: float) -> float:
        if not (math.isfinite(v) and 0.0 <= v < 1.0):
            raise ValueError(f"must be in [0, 1) (got {v!r})")
        return v


class ScheduleConfig(_Section):
    """``schedule``: the learning-rate schedule, counted in applied updates.

    Example::

        >>> ScheduleConfig(warmup=10).decay
        'cosine'
    """

    warmup: Count0 = 0
    """Linear warmup length in applied updates (0: none)."""
    decay: Literal["constant", "cosine", "linear"] = "cosine"
    """Shape of the decay after warmup, down to ``min_lr_ratio * lr`` at update ``steps - 1`` (the
    last step when none was skipped: a skip holds the schedule)."""
    min_lr_ratio: Rate = 0.1
    """Final learning rate as a fraction of ``optimizer.lr``, in [0, 1]."""



class ScalerConfig(_Section):
    """``scaler``: the dynamic loss scaler (fp16), including the floor ``min_scale``.

    Example::

        >>> s = ScalerConfig()
        >>> s.init_scale, s.growth_interval, s.min_scale
        (65536.0, 2000, 1.0)
        >>> validate({"scaler": {"min_scale": 0}})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: scaler.min_scale: must be a finite number > 0 (got 0.0)
    """

    enabled: Bool | None = None
    """Loss scaling: None means on for fp16, off otherwise. True with bf16/fp32 is an error."""
    init_scale: Annotated[Positive, Float32] = 2.0**16
    """Starting loss scale (at most the largest float32, about 3.4e38)."""
    growth_factor: Annotated[Float, Float32] = 2.0
    """Scale multiplier after ``growth_interval`` clean steps in a row (> 1)."""
    backoff_factor: Float = 0.5
    """Scale multiplier on a skipped step, in (0, 1)."""
    growth_interval: Annotated[Int, _COUNT_CAP] = 2000
    """Clean steps in a row before the scale grows (>= 1)."""
    min_scale: Positive = 1.0
    """The floor of the loss scale: after every update the scaler clamps its scale to at least
    this (like DeepSpeed's ``min_loss_scale``), so a long run of skips cannot drive it to 0,
    after which every step would be skipped for ever. A scale sitting here while steps are
    skipped is a collapse: the monitor raises a ``scale_alert`` at the floor and, with
    ``monitor.fail_on_scale_collapse``, stops the run. At least 2**-126 (the smallest normal
    float32) and at most ``init_scale``."""

    @field_validator("min_scale")
    @classmethod
    def _floor(cls, v: float) -> float:
        if v < DEFAULT_MIN_SCALE:
            raise ValueError(f"must be >= 2**-126, the smallest normal float32 (got {v!r})")
        return v

    @field_validator("growth_factor", "backoff_factor", "growth_interval")
    @classmethod
    def _in_range(cls, v: float, info: ValidationInfo) -> float:
        # (review 54b: the ranges' one place, which the library's scalers and a checkpoint's state are held to)
        if problem := scaler_range_problem(info.field_name, v):
            raise ValueError(f"{problem} (got {v!r})")
        return v


class HeadroomConfig(_Section):
    """``monitor.headroom``: per-layer headroom telemetry (``headroom.csv``, the report's heatmap,
    an ALERT before an overflow). Off by default; see :mod:`ampguard.headroom`.

    Example::

        >>> HeadroomConfig().every, HeadroomConfig().alert_bits, HeadroomConfig().format
        (None, 4.0, 'auto')
        >>> validate({"monitor": {"headroom": {"every": 0}}})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: monitor.headroom.every: must be >= 1 (got 0)
    """

    every: Count | None = None
    """Measure every this many steps (``step % every == 0``); None: off. A measured step hooks
    every module that holds parameters (forward output, the gradient flowing back into it, its
    parameters' gradient) and pays a few device reductions per module and one host read; other
    steps pay nothing.
    On the default ``ampguard train`` run at ``every: 100``: about +1% of a step (README, "Headroom")."""
    alert_bits: Amount = 4.0
    """ALERT (once per episode, per module) when a module's headroom, the doublings left before
    its output or its gradients (fp16: without the loss scale) overflow the format, falls below
    this; CLEAR once it is a bit above it again."""
    format: Literal["auto", "fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """The format headroom and underflow are measured against: ``auto`` is the run's precision
    (bf16 under fp8: its autocast computes in bf16, and the float8 casts are scaled to their
    range; fp16 under fp32: an FP32 run has no overflow near to warn of, and what a reference run
    asks is whether its values would fit the half format with the least range); name another to
    ask whether this run's values would fit it (fp8 e4m3: max 448, e5m2: 57344)."""

    def format_for(self, precision: str) -> str:
        """The format measured against in a run of ``precision``.

        Example::

            >>> [HeadroomConfig().format_for(p) for p in ("fp16", "bf16", "fp8", "fp32")]
            ['fp16', 'bf16', 'bf16', 'fp16']
            >>> HeadroomConfig(format="fp32").format_for("fp32")
            'fp32'
        """
        if self.format != "auto":
            return self.format
        return {"fp8": "bf16", "fp32": "fp16"}.get(precision, precision)


class MonitorConfig(_Section):
    """``monitor``: the rolling skip-rate ALERT and the fail-fast guards.

    Example::

        >>> m = MonitorConfig()
        >>> m.window, m.alert_rate, m.fail_rate, m.fail_after, m.min_steps
        (1000, 0.05, None, 100, 100)
    """

    window: Window = 1000
    """Steps in the rolling skip-rate window (at most ``MAX_WINDOW``, 10**7; about 130 B of memory
    and 36 B of each checkpoint a step of it)."""
    alert_rate: Rate = 0.05
    """Rolling skip rate above which an ALERT is raised, in [0, 1]."""
    clear_rate: Rate | None = None
    """Rolling skip rate at or below which the ALERT clears, in [0, ``alert_rate``] (None:
    ``CLEAR_FRACTION`` 0.8 of ``alert_rate``, so a rate that hovers at the threshold pages once)."""
    fail_rate: Rate | None = None
    """Rolling skip rate that fails the run after ``fail_after`` steps above it (None: never)."""
    fail_after: Count = 100
    """Consecutive steps above ``fail_rate`` (or skipped at the scale's floor, see
    ``fail_on_scale_collapse``) before the run stops with exit code 3. Counted from step 1."""
    fail_on_scale_collapse: Bool = False
    """Also stop (exit 3, cause ``scale_collapse``) when ``fail_after`` consecutive steps are
    skipped with the loss scale at its floor ``scaler.min_scale``."""
    min_steps: Count0 = DEFAULT_MIN_STEPS
    """Steps seen before the skip-rate ALERT is armed (default 100; a smaller ``window`` arms it
    once full, after ``window`` steps). While the window fills,
    the rolling skip rate is over the steps seen so far, so the fp16 scaler's normal opening
    (its search down from ``init_scale`` skips a handful of early steps) would otherwise read
    as a rate near 100% and raise an ALERT in every fp16 run: k opening skips are k/n of the
    first n steps, and 100 steps dilute up to 5 of them to the default ``alert_rate`` 0.05.
    Fail-fast is not delayed by it (``fail_after`` already asks for consecutive steps)."""
    headroom: HeadroomConfig = HeadroomConfig()
    """Per-layer headroom telemetry, off by default (``monitor.headroom.every``)."""


class WandbConfig(_Section):
    """``log.wandb``: log every step to Weights & Biases (``WandbSink``; ``pip install 'ampguard[wandb]'``).

    Off (null) by default; ``--set log.wandb=true`` turns it on with these defaults. The W&B run's
    id is the run folder's ``run-id``, so a resumed run continues the same W&B run.

    Example::

        >>> validate({"log": {"wandb": True}}).log.wandb.project, Config().log.wandb is None
        ('ampguard', True)
        >>> validate({"log": {"wandb": {"mode": "cloud"}}})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: log.wandb.mode: Input should be 'online', 'offline' or 'disabled' ...
    """

    project: str = "ampguard"
    """The W&B project."""
    entity: str | None = None
    """The W&B entity (user or team); None: your default entity."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """``online``, ``offline`` (a local run folder, uploaded later by ``wandb sync``) or
    ``disabled``; None: W&B's own choice (``WANDB_MODE``, ``wandb offline``)."""
    name: str | None = None
    """The W&B run's display name; None: the run folder's name."""
    group: str | None = None
    """W&B run group (e.g. one sweep's runs)."""
    tags: list[str] = []
    """W&B run tags."""
    dir: HomePath = None
    """Where W&B keeps its local files (``<dir>/wandb/``); None: the run folder."""

    @field_validator("tags")
    @classmethod
    def _tags_once(cls, v: list[str]) -> list[str]:
        return _listed_once(v)  # (as fp32_modules and fp8.exclude: a name given twice is a typo for another)


class MLflowConfig(_Section):
    """``log.mlflow``: log every step to MLflow (``MLflowSink``; ``pip install 'ampguard[mlflow]'``).

    Off (null) by default; ``--set log.mlflow=true`` turns it on with these defaults. A resumed
    run continues the MLflow run tagged with its run folder's ``run-id``.

    Example::

        >>> validate({"log": {"mlflow": {"tracking_uri": "file:./mlruns"}}}).log.mlflow.experiment
        'ampguard'
        >>> validate({"log": {"mlflow": False}}).log.mlflow is None
        True
    """

    tracking_uri: str | None = None
    """Where runs are stored: a server (``http://...``), ``sqlite:///mlflow.db`` (needs
    SQLAlchemy) or a local folder (``file:./mlruns``; MLflow 3 refuses its file store unless
    ``MLFLOW_ALLOW_FILE_STORE=true``, which ampguard sets for a ``file:`` URI unless you set it
    yourself); None: ``MLFLOW_TRACKING_URI`` or MLflow's default."""
    experiment: str = "ampguard"
    """The MLflow experiment (created if it does not exist)."""
    run_name: str | None = None
    """The MLflow run's name; None: the run folder's name."""
    tags: dict[str, str] = {}
    """Extra MLflow run tags."""


_ON, _OFF = {"true", "yes", "on", "y", "t", "1"}, {"false", "no", "off", "n", "f", "0"}
"""The words a boolean setting takes (pydantic's), for the switches that are also sections."""


def _section_switch(value: Any) -> Any:
    """``log.wandb: true`` turns a tracker on with its defaults, ``false`` turns it off; the
    words a boolean setting takes (yes/no, on/off: YAML 1.2 reads them as text) do the same.

    Example::

        >>> [_section_switch(v) for v in (True, "on", "Yes", False, "off", {"project": "p"})]
        [{}, {}, {}, None, None, {'project': 'p'}]
    """
    word = value.strip().lower() if isinstance(value, str) else None
    if value is True or word in _ON:
        return {}
    if value is False or word in _OFF:
        return None
    return value


class LogConfig(_Section):
    """``log``: where run folders go and what the console shows.

    Example::

        >>> LogConfig().every
        50
        >>> validate({"log": {"name": "a/b"}})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: log.name: must be a plain folder name (got 'a/b')
    """

    dir: str = "runs"
    """Folder that holds run folders."""
    name: str | None = None
    """Run folder name under ``dir`` (None: a timestamp). An existing run folder is never reused."""
    every: Count = 50
    """Console line every this many steps (skips are always printed; the CSV has every step)."""
    plot: Bool = True
    """Draw ``report.png`` at the run's end. false: no plot (a headless cluster's job, or a
    run of millions of steps whose plot would take its own minutes); ``ampguard report RUN_DIR``
    draws it whenever wanted."""
    jsonl: Bool = False
    """Also write every step record as JSON lines (``steps.jsonl``)."""
    tensorboard: Bool = False
    """Also write TensorBoard scalars (``tensorboard/``); needs the ``tensorboard`` package."""
    wandb: Annotated[WandbConfig | None, BeforeValidator(_section_switch)] = None
    """Also log every step to Weights & Biases (see ``WandbConfig``); null: off."""
    mlflow: Annotated[MLflowConfig | None, BeforeValidator(_section_switch)] = None
    """Also log every step to MLflow (see ``MLflowConfig``); null: off."""
    peak_tflops: Positive | None = None
    """The accelerator's dense peak (TFLOP/s at the run's precision) for the MFU on the STATS
    lines and the run card; None: the known GPUs' bf16 peak (H100/H200 989, A100 312; a task
    that knows its FLOPs per token), no MFU elsewhere."""

    @field_validator("dir")
    @classmethod
    def _dir(cls, v: str) -> str:
        if not v.strip():  # (it would put the run folder in the working folder)
            raise ValueError("must be a folder, not an empty string")
        return _path(v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and (not v or "/" in v or v in (".", "..") or has_control(v)):
            raise ValueError(f"must be a plain folder name (got {brief(v)})")  # (a newline broke every line naming it)
        if v is not None and len(v.encode("utf-8", "surrogateescape")) > MAX_NAME:  # (a file name's limit is bytes)
            raise ValueError(f"at most {MAX_NAME} bytes in UTF-8 (got {len(v.encode('utf-8', 'surrogateescape'))})")
        return v


class EvalConfig(_Section):
    """``eval``: held-out evaluation during training.

    Example::

        >>> EvalConfig().every, EvalConfig().batches
        (100, 8)
    """

    enabled: Bool = True
    """Evaluate the task's held-out metrics (extra CSV columns)."""
    every: Count0 = 100
    """Evaluate on held-out data every this many steps and at the end (0: only at the end)."""
    batches: Count = 8
    """charlm: held-out batches of 32 windows (charlm.EVAL_WINDOWS, whatever task.batch_size) per evaluation."""


class CheckpointConfig(_Section):
    """``checkpoint``: when to save and how many to keep.

    Example::

        >>> CheckpointConfig().every, CheckpointConfig().keep
        (0, 3)
    """

    enabled: Bool = True
    """Write checkpoints to ``<run>/checkpoints/`` (and at the end, on fail-fast and on Ctrl-C)."""
    every: Count0 = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    keep: Count = 3
    """How many recent checkpoints to keep (>= 1). With ``rollback.triggers`` that look back
    (``skip_guard``: ``monitor.fail_after`` steps; ``val_regression``: to the evaluation before)
    every checkpoint such a rollback may return to is kept too (up to look-back / ``every`` + 1)."""


VALIDATION_PRECISIONS: tuple[str, ...] = ("fp16", "bf16", "fp8")
"""The AMP precisions ``validation.precisions`` may name (one line per precision)."""


class OutputTolerance(_Section):
    """``validation.outputs.<name>``: the score tolerance of one named model output (a key of a
    dict output, or the index of a tuple output as a string, ``"0"``); an unset part keeps
    ``validation.abs_tol`` / ``validation.rel_tol``.

    Example::

        >>> validate({"validation": {"outputs": {"logits": {"abs_tol": 0.1}}}}).validation.outputs["logits"].rel_tol is None
        True
    """

    abs_tol: Amount | None = None
    """|amp - fp32| <= abs_tol + rel_tol * |fp32|, per element of this output (null: validation.abs_tol)."""
    rel_tol: Amount | None = None
    """The relative part for this output (null: validation.rel_tol)."""


class ValidateConfig(_Section):
    """``ampguard validate``: every rule is declared here, before the run.

    Example::

        >>> ValidateConfig().precisions, ValidateConfig().max_flips
        (['fp16', 'bf16'], 0)
        >>> validate({"validation": {"precisions": []}})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: validation.precisions: name at least one AMP precision to compare (fp16, bf16, fp8)
    """

    precisions: list[Literal[VALIDATION_PRECISIONS]] = ["fp16", "bf16"]  # type: ignore[valid-type]
    """AMP precisions to compare with the FP32 reference (at least one, each once); ``fp8``
    compares a copy of the model converted as the ``fp8`` section says (needs torchao)."""
    checkpoint: HomePath = None
    """Model weights from an ampguard checkpoint (default: the task's freshly initialised model)."""
    typical: Count0 = 32
    """Probe set: the first this many held-out examples."""
    boundary: Count0 = 16
    """Probe set: the held-out examples with the smallest FP32 top-2 margin (classifiers)."""
    edge_cases: Bool = True
    """Probe set: the task's edge-case inputs (blank, saturated, extreme values...)."""
    abs_tol: Amount = 0.05
    """Score tolerance: |amp - fp32| <= abs_tol + rel_tol * |fp32| for every score of every probe."""
    rel_tol: Amount = 0.05
    """Score tolerance, relative part."""
    tie_margin: Amount = 0.0
    """Tie rule: a probe whose FP32 top-2 gap is <= this (the reference barely decides) is a tie
    where AMP names another class or keeps FP32's by an exact tie FP32 did not have, and the same
    decision where AMP keeps FP32's otherwise (a tie the reference has is not AMP's doing:
    listed, not counted); a probe FP32 decides by more than this is a tie where AMP keeps its
    class by a gap <= this, a flip where AMP changes it."""
    ties: Literal["count_as_flip", "accept", "reject"] = "count_as_flip"
    """Tie rule: a tie counts toward ``max_flips`` (``count_as_flip``), is accepted (``accept``),
    or rejects the run by itself (``reject``)."""
    max_flips: Count0 = 0
    """Decision changes (argmax flips, and ties when they count) allowed on the probe set."""
    min_accuracy: Rate | None = None
    """Classifiers: minimum accuracy on the held-out set, for the reference and for AMP."""
    max_mse: Amount | None = None
    """Regression: maximum mean squared error on the held-out set, for the reference and for AMP."""
    max_quality_drop: Amount | None = 0.01
    """Quality relative to the reference, on the held-out set: AMP accuracy >= FP32 accuracy - this
    (classifiers; 0.01 = one point), AMP MSE <= FP32 MSE * (1 + this) (regression; 0.01 = 1%);
    null: no relative rule (``min_accuracy`` / ``max_mse`` stay absolute floors)."""
    outputs: dict[str, OutputTolerance] = {}
    """Score tolerances per named output (a dict output's keys, a tuple output's indices ``"0"``,
    ``"1"``...; a lone tensor is ``output``); outputs not named here use abs_tol / rel_tol."""
    top_k: Count = 5
    """Classifiers: how many of the best scores (FP32 and AMP) each probe's record keeps."""
    train_steps: Count0 = 0
    """Also train this many steps from the same state in FP32 and in each AMP precision and
    compare loss curves, gradient norms and applied updates (the updates judged by
    ``min_applied``; the curves informational)."""
    min_applied: Rate = 0.9
    """With ``train_steps``: each AMP precision applies at least this fraction of the updates FP32
    applied, its loss scaler's opening search (the skips before its first applied update) set
    aside; none applied at all fails (the seed's check for a scaler: updates actually made)."""

    @field_validator("precisions")
    @classmethod
    def _some_precisions(cls, value: list[str]) -> list[str]:
        # nothing compared would read ACCEPTED; a precision named twice would be compared twice
        if not value:
            raise ValueError(f"name at least one AMP precision to compare ({', '.join(VALIDATION_PRECISIONS)})")
        return _listed_once(value)


class Fp8Config(_Section):
    """``fp8``: torchao float8 training, used when ``precision: fp8`` (needs the ``fp8`` extra).

    Example::

        >>> Fp8Config().recipe, Fp8Config().keep_first_last, Fp8Config().exclude
        ('tensorwise', True, [])
        >>> validate({"fp8": {"recipe": "blockwise"}})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: fp8.recipe: Input should be 'tensorwise' or 'rowwise' (got 'blockwise')
    """

    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao's scaling recipe: ``tensorwise`` (one dynamic scale per tensor, the fastest) or
    ``rowwise`` (one per row, scales rounded down to powers of two: one outlier costs only its row)."""
    keep_first_last: Bool = True
    """Keep the model's first and last ``nn.Linear`` (input layer, output head) in bf16: they are
    the most sensitive to float8 rounding. Linear layers whose dimensions are not multiples of 16
    always stay in bf16 (``torch._scaled_mm`` needs them)."""
    exclude: list[str] = []
    """Module names (``fnmatch`` patterns, e.g. ``"blocks.*.attn.*"``) that stay in bf16."""

    @field_validator("exclude")
    @classmethod
    def _exclude_once(cls, v: list[str]) -> list[str]:
        return _listed_once(v)  # (as fp32_modules: a name given twice is a typo for another)


class DistributedConfig(_Section):
    """``distributed``: the multi-process strategy under torchrun.

    Example::

        >>> DistributedConfig().strategy
        'ddp'
    """

    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """Under torchrun: DistributedDataParallel, or FSDP2 (``fully_shard``). ``task.batch_size``
    is per rank; every rank reads the same stream and takes its slice of each global batch."""


class DiagnoseConfig(_Section):
    """``diagnose``: automatic diagnosis of non-finite values.

    Example::

        >>> DiagnoseConfig().first_skip, DiagnoseConfig().strict
        (False, False)
    """

    first_skip: Bool = False
    """After the first skipped step, find where its non-finite value was born (``ampguard locate``
    on that step's micro-batches) and write the finding to the event log and the run card."""
    strict: Bool = False
    """Debugging: the first non-finite loss or gradient stops the run (exit 3) with a message
    naming which and where, instead of skipping it and going on."""
    grad_norms: Bool = True
    """At every skipped step, write each parameter's gradient norm (finite or not, in backward
    order) to ``events.jsonl`` (a ``grad_norms`` event). Applied steps pay nothing (the order is
    learned at the first step; the norms are taken only at a skip)."""


class RollbackConfig(_Section):
    """``rollback``: returning to the last good checkpoint on a loss spike or a tripped guard.

    Example::

        >>> RollbackConfig().triggers, RollbackConfig().max
        ([], 3)
        >>> validate({"rollback": {"triggers": ["skip_guard"]}, "checkpoint": {"every": 5}})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: rollback.triggers: skip_guard needs the guard itself (set monitor.fail_rate)
    """

    triggers: list[Literal["skip_guard", "loss_spike", "val_regression"]] = []
    """What triggers a rollback: ``skip_guard`` (the fail-fast skip-rate guard trips), ``loss_spike``
    (loss above mean + z * std of the last ``window`` applied steps) and/or ``val_regression`` (a
    held-out evaluation worse than the best so far by more than ``val_regression``). Empty: off."""
    z: Positive = 6.0
    """Loss-spike threshold in standard deviations."""
    window: Annotated[Window, _at_least(2)] = 50
    """Applied steps in the loss-spike window (it must be full before spikes are judged; at most 10**7)."""
    skip_batches: Count0 = 20
    """Micro-batches of data skipped past the checkpoint's data position after a rollback; never
    fewer than it takes to get past the triggering step's own micro-batches (when the checkpoint
    is further back than ``skip_batches``, the stream goes on right after the trigger)."""
    max: Count0 = 3
    """Rollbacks allowed; the next trigger fails the run (exit 3)."""
    lr_factor: Annotated[Positive, AfterValidator(_at_most_one)] = 1.0
    """The learning rate after a rollback: the schedule's base ``optimizer.lr`` times
    ``lr_factor ** n`` after the n-th rollback (the checkpoint's own LR is not kept), in (0, 1];
    1: unchanged."""
    val_regression: Positive = 0.1
    """The ``val_regression`` trigger's threshold, relative to the best held-out value so far:
    a loss-like metric above ``best + val_regression * |best|`` (an accuracy below ``best -
    val_regression * |best|``), or a non-finite one, rolls back to the newest checkpoint at or
    before the previous evaluation. Judged at each evaluation (``eval.every``)."""
    val_metric: str | None = None
    """The held-out metric the ``val_regression`` trigger watches (None: the task's first, e.g.
    ``val_loss``); one of the task's metrics."""
    val_mode: Literal["auto", "max", "min"] = "auto"
    """Whether ``val_metric`` is better higher (``max``) or lower (``min``); ``auto``: as its name
    says (``acc``, ``f1``, ``auc``, ``bleu``, ... higher; ``loss``, ``err``, ``mse``, ``ppl``, ...
    lower), and a name that does not say is refused (a wrong guess rolls back on every gain)."""

    @field_validator("triggers")
    @classmethod
    def _triggers_once(cls, v: list[str]) -> list[str]:
        return _listed_once(v)  # (a trigger named twice is a typo for another, or nothing)


TASK_SIZES = ("block_size", "n_layer", "n_head", "n_embd")
"""The ``task`` settings that size a built-in model (charlm reads all four)."""
PRESETS: dict[str, dict[str, int]] = {"gpt2-small": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}}
"""``task.preset``: named charlm sizes."""


class TaskConfig(_Section):
    """``task``: the workload, a built-in one or your own factory.

    Example::

        >>> TaskConfig().name
        'charlm'
        >>> validate({"task": {"n_embd": 10, "n_head": 4}})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: task: n_head (4) must divide n_embd (10)
    """

    name: Literal["charlm", "digits", "linear"] = "charlm"
    """Built-in workload: ``charlm`` (a character-level transformer on Python's own sources),
    ``digits`` (an MLP on scikit-learn's handwritten digits) or ``linear`` (the demo's regression)."""
    preset: Literal["gpt2-small"] | None = None
    """charlm: a named model size. ``gpt2-small``: GPT-2 small's shape, 12 layers x 768 wide, 12
    heads, a context of 1024 (byte vocabulary; attention through SDPA, so flash kernels apply on
    a GPU); it sets ``n_layer``, ``n_head``, ``n_embd`` and ``block_size``, which are then not
    set apart from it. For a GPU: ``precision: bf16``, ``compile: true``."""
    factory: str | None = None
    """Your own workload instead: ``"package.module:build"`` or ``"path/to/file.py:build"``
    (see the README); ``build(config)`` returns the model, the data and the loss function. A
    relative file path is read from the folder the command runs in; a resume elsewhere gives the
    file's path there (``--resume`` compares the file's name and the function, not the folder)."""
    options: dict[str, Any] = {}
    """Free-form settings for your factory (``config.task.options``)."""

    @field_validator("factory")
    @classmethod
    def _factory(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():  # (it would read as "no factory": the built-in task)
            raise ValueError("must be module:function or path/to/file.py:function, not an empty string")
        return _path(v)
    batch_size: Count = 32
    """Examples per micro-batch."""
    block_size: Count = 64
    """charlm: context length in characters."""
    n_layer: Count = 2
    """charlm: transformer blocks."""
    n_head: Count = 4
    """charlm: attention heads (must divide ``n_embd``)."""
    n_embd: Count = 64
    """charlm: embedding width; digits: half the MLP's hidden width."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TaskConfig:
        if self.preset is not None:
            if self.name != "charlm" or self.factory:
                raise ValueError(f"preset {self.preset} sizes the charlm task (task.name: charlm, no factory)")
            shape = PRESETS[self.preset]
            clash = [f"{k}={getattr(self, k)}" for k, v in shape.items() if k in self.model_fields_set
                     and getattr(self, k) != v]
            if clash:
                raise ValueError(f"preset {self.preset} sets {', '.join(f'{k}={v}' for k, v in shape.items())}; "
                                 f"drop {', '.join(clash)} or the preset")
            for k, v in shape.items():
                object.__setattr__(self, k, v)
        if self.name == "charlm" and not self.factory and self.n_embd % self.n_head:  # (digits has no heads)
            raise ValueError(f"n_head ({self.n_head}) must divide n_embd ({self.n_embd})")
        return self

    @staticmethod
    def reads(name: str | None, factory: str | None = None) -> tuple[str, ...]:
        """The ``task`` settings the workload (built-in ``name``, or ``factory``) builds its model
        and data from: what a checkpoint must have been trained with to be that model (review 53i:
        validate, locate and ``--resume`` compared settings the task never reads, and refused the
        same model). A factory gets the whole config: all of them. A built-in task reads its
        ``name``, ``batch_size`` and its sizes (charlm all four, digits ``n_embd``, linear none);
        never ``options`` (a factory's). ``preset`` is read by none: it only names sizes, which
        the validator sets, so its sizes are what counts. The one table :meth:`unread` also says
        from.

        Example::

            >>> TaskConfig.reads("digits"), TaskConfig.reads("linear")
            (('name', 'factory', 'batch_size', 'n_embd'), ('name', 'factory', 'batch_size'))
            >>> "options" in TaskConfig.reads("charlm", "f.py:build"), "preset" in TaskConfig.reads("charlm")
            (True, False)
        """
        if factory:
            return tuple(key for key in TaskConfig.model_fields if key != "preset")
        sizes = {"charlm": TASK_SIZES, "digits": ("n_embd",)}.get(name or "", ())
        return ("name", "factory", "batch_size", *sizes)

    def unread(self) -> list[str]:
        """The settings given (not at their defaults) that the task does not read (:meth:`reads`):
        a built-in task reads no ``options`` (a factory's), digits no ``block_size``, ``n_layer``,
        ``n_head``, linear none of the model's shape.

        Example::

            >>> TaskConfig(name="digits", n_layer=3, options={"w": 1}).unread()
            ['options', 'n_layer']
            >>> TaskConfig(name="charlm", n_layer=3).unread(), TaskConfig(factory="f.py:build", n_layer=3).unread()
            ([], [])
        """
        read = self.reads(self.name, self.factory)
        default = TaskConfig()
        return [key for key in ("options", *TASK_SIZES)
                if key not in read and getattr(self, key) != getattr(default, key)]


class Config(_Section):
    """The whole configuration tree, validated once at load.

    Example::

        >>> c = Config()
        >>> c.precision, c.scaler.min_scale, c.monitor.min_steps
        ('bf16', 1.0, 100)
        >>> validate({"scaler": {"init_scale": 0.5}})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: scaler.min_scale: the floor (1) must be <= scaler.init_scale (0.5)
    """

    precision: PrecisionName = "bf16"
    """Compute precision under autocast; fp16 adds a dynamic loss scaler; fp8 is bf16 autocast
    with torchao float8 training for the Linear layers the ``fp8`` section selects."""
    max_norm: Annotated[Float, AfterValidator(_finite)] | None = 1.0
    """Global L2 gradient clip threshold; 0, a negative number or null disables clipping (post = pre)."""
    accumulation_steps: Count = 1
    """Micro-batches per optimizer update."""
    steps: Count = 1000
    """Optimizer steps (attempts, skipped ones included)."""
    seed: Annotated[Int, _at_least(0), AfterValidator(lambda v: _at_most(v, MAX_SEED))] = 0
    """Seed for the model, the data order, seeded fault injection, and Python's ``random`` and
    NumPy's global RNG (so a factory that draws from them is reproducible); 0 to 2**32 - 1."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: ``auto`` takes CUDA when available, the CPU otherwise."""
    scheduler_on_skip: Literal["hold", "step"] = "hold"
    """On a skipped step the LR schedule holds (default) or steps anyway."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """The optimizer and its hyper-parameters."""
    schedule: ScheduleConfig = ScheduleConfig()
    """The learning-rate schedule (counted in applied updates)."""
    scaler: ScalerConfig = ScalerConfig()
    """The dynamic loss scaler (fp16)."""
    monitor: MonitorConfig = MonitorConfig()
    """The skip-rate alarm and the fail-fast guard."""
    log: LogConfig = LogConfig()
    """Where run folders go and what the console shows."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation (extra CSV columns)."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoints for resume and rollback."""
    validation: ValidateConfig = ValidateConfig()
    """The AMP-vs-FP32 acceptance test (``ampguard validate``)."""
    diagnose: DiagnoseConfig = DiagnoseConfig()
    """Automatic diagnosis of non-finite values."""
    distributed: DistributedConfig = DistributedConfig()
    """Multi-process training when launched by torchrun."""
    fp8: Fp8Config = Fp8Config()
    """Float8 training (``precision: fp8``): recipe and which Linear layers convert."""
    rollback: RollbackConfig = RollbackConfig()
    """Rolling back to the last good checkpoint on a loss spike or a tripped guard."""
    task: TaskConfig = TaskConfig()
    """The workload: a built-in one or your own factory."""
    compile: Bool = False
    """Compile the model's forward with ``torch.compile`` (in place, ``nn.Module.compile``, so
    checkpoints keep their keys). The first steps take longer while it compiles (tens of seconds
    on a CPU); on a GPU it is what makes a transformer fast. Inductor may fuse operations: not bit
    for bit the eager run."""
    fast: Bool | None = None
    """The fast path (``docs/design.md`` §5): fused AdamW/SGD, the sync-free step with the LR
    schedule on the device (no host read decides a step), and records read back as their copies
    land, at most :data:`~ampguard.records.LAG` steps behind the step being trained; the monitors
    still name each record's own step. ``None``: on for CUDA in one process unless a setting
    needs the exact step at the host (``diagnose.first_skip``/``strict``, ``monitor.headroom``,
    ``rollback.triggers``, ``scheduler_on_skip: step``); ``true``: on (any device; such a
    setting is then an error); ``false``: the exact path, bit for bit the canonical loop."""
    inject: list[str] = []
    """Faults to inject, ``KIND@WHEN`` (see ``ampguard demo --help``); for testing the guard rails."""
    fp32_modules: list[str] = []
    """Submodules kept in FP32 under autocast (fp16, bf16), by qualified name (``blocks.3.mlp``):
    each runs with autocast off and its floating inputs cast to float32, the fix ``ampguard locate``
    names when a layer's range does not fit ("keeping blocks.3.mlp in FP32 ... fixes this batch").
    Parameters and checkpoints are unchanged; the run card's "float32 under autocast" shows them.
    Under fp8, keep layers out of float8 with ``fp8.exclude`` instead."""

    @field_validator("fp32_modules")
    @classmethod
    def _fp32_modules(cls, v: list[str]) -> list[str]:
        if any(not name.strip() for name in v):
            raise ValueError("name each submodule (an empty name is the whole model: that is precision: fp32)")
        return _listed_once(v)

    @field_validator("inject")
    @classmethod
    def _inject(cls, v: list[str]) -> list[str]:
        for spec in v:
            parse_fault(spec)
        # (each listing fires: spike@5 twice is x 1e16, not the fault asked for)
        return _listed_once(v, " (each listing fires: list it once)")

    @property
    def scaler_on(self) -> bool:
        """Whether the run goes through a loss scaler: ``scaler.enabled`` where given (``true`` only
        under a precision that has one: refused otherwise), else the precision's rule
        (:func:`~ampguard.precision.uses_loss_scaler`, fp16). The one answer the trainer, report,
        compare and locate read (review 53h: it was written out in each).

        Example::

            >>> Config(precision="fp16").scaler_on, Config(precision="bf16").scaler_on
            (True, False)
            >>> validate({"precision": "fp16", "scaler": {"enabled": False}}).scaler_on
            False
        """
        return loss_scaler_runs(self.precision, self.scaler.enabled)

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Config:
        if self.fp32_modules and self.precision == "fp8":
            raise ValueError("fp32_modules: under fp8 keep layers out of float8 with fp8.exclude (fp32_modules is for "
                             "fp16 and bf16)")
        opt = self.optimizer
        if opt.name == "adamw" and opt.lr / (1 - opt.betas[0]) > MAX_SCALE:  # (1e38 with beta1 0.9: a traceback)
            raise ValueError(f"optimizer.lr: AdamW's first step scales it by 1 / (1 - betas[0]) ({opt.lr:g} / "
                             f"{1 - opt.betas[0]:g}), past the largest float32 ({MAX_SCALE:.6g}): make it smaller")
        if opt.name == "adamw" and opt.lr * opt.weight_decay >= 1:  # (1e300 applied step 1, then every loss NaN)
            raise ValueError(f"optimizer.weight_decay: AdamW multiplies every weight by 1 - lr x weight_decay each "
                             f"step (1 - {opt.lr:g} x {opt.weight_decay:g}), which at 1 or above zeroes or flips them; "
                             "make lr x weight_decay < 1")
        if self.scaler.enabled and not uses_loss_scaler(self.precision):
            raise ValueError(f"scaler.enabled: {self.precision} does not use a loss scaler (set it false or null)")
        if self.rollback.triggers and not (self.checkpoint.enabled and self.checkpoint.every > 0):
            raise ValueError("rollback.triggers: rolling back needs checkpoints to return to (set checkpoint.every > 0)")
        if "val_regression" in self.rollback.triggers and not (self.eval.enabled and self.eval.every > 0):
            raise ValueError("rollback.triggers: val_regression needs the held-out evaluation (set eval.every > 0)")
        if "skip_guard" in self.rollback.triggers and self.monitor.fail_rate is None:
            raise ValueError("rollback.triggers: skip_guard needs the guard itself (set monitor.fail_rate)")
        if self.scaler.min_scale > self.scaler.init_scale:
            raise ValueError(f"scaler.min_scale: the floor ({self.scaler.min_scale:g}) must be <= "
                             f"scaler.init_scale ({self.scaler.init_scale:g})")
        m = self.monitor
        if m.clear_rate is not None and m.clear_rate > m.alert_rate:
            raise ValueError(f"monitor.clear_rate: the ALERT's clear level ({m.clear_rate:g}) must be <= "
                             f"monitor.alert_rate ({m.alert_rate:g})")
        return self


# ---------------------------------------------------------------------------- loading


def _section_at(path: Sequence[str | int]) -> type[BaseModel] | None:
    """The section class at ``path`` in the tree (a key of a mapping of sections, such as
    ``validation.outputs.<name>``, is one part of it), or None where there is no section.

    Example::

        >>> [getattr(_section_at(p), "__name__", None) for p in ((), ("log", "wandb"), ("validation", "outputs", "x"),
        ...                                                       ("task", "options"), ("nope",))]
        ['Config', 'WandbConfig', 'OutputTolerance', None, None]
    """
    section: type[BaseModel] | None = Config
    parts = list(path)
    while parts and section is not None:
        field = section.model_fields.get(str(parts.pop(0)))
        if field is None:
            return None
        annotation = field.annotation
        if get_origin(annotation) is dict and parts:  # (a mapping of sections: the next part is its key)
            parts.pop(0)
            annotation = get_args(annotation)[1]
        section = next((t for t in (annotation, *get_args(annotation)) if isinstance(t, type) and
                        issubclass(t, BaseModel)), None)
    return section


def _field_at(path: Sequence[str | int]) -> FieldInfo | None:
    """The field at ``path`` (``("log", "wandb")``), or None (a list's item, a free-form mapping's key)."""
    section = _section_at(path[:-1]) if path else None
    return section.model_fields.get(str(path[-1])) if section is not None else None


def _takes_text(path: Sequence[str | int]) -> bool:
    """Whether the setting at ``path`` is text (``log.name``, an item of ``inject`` or of
    ``log.wandb.tags``), where a number is taken as it was written.

    Example::

        >>> [_takes_text(p) for p in (("log", "name"), ("inject", 0), ("log", "mlflow", "tags", "t"), ("seed",),
        ...                           ("task", "options", "lr"), ("optimizer", "betas", 0), ("nope",))]
        [True, True, True, False, False, False, False]
    """
    field = _field_at(path)
    if field is not None:
        annotation = field.annotation
    else:  # an item of a list or a value of a mapping
        parent = _field_at(path[:-1]) if len(path) > 1 else None
        if parent is None:
            return False
        origin, args = get_origin(parent.annotation), get_args(parent.annotation)
        if origin is list and len(args) == 1:
            annotation = args[0]
        elif origin is dict and len(args) == 2:
            annotation = args[1]
        else:
            return False
    return annotation is str or str in get_args(annotation)


def _as_written(value: Any, path: tuple[str | int, ...] = ()) -> Any:
    """``value`` (read by :class:`_TextKeepingLoader` at ``path`` in the tree) with each number
    plain again: as the text it was written as where the setting is text, so that
    ``log.name=010`` is the name "010", ``1e3`` is "1e3" and ``0x10`` is "0x10" (YAML reads them as
    10, 1000.0 and 16, which a name would have taken as "10", "1000.0" and "16").

    Example::

        >>> data = yaml.load("{log: {name: 010}, seed: 010, task: {options: {lr: 1e-3}}}", Loader=_TextKeepingLoader)
        >>> _as_written(data)
        {'log': {'name': '010'}, 'seed': 10, 'task': {'options': {'lr': 0.001}}}
    """
    if isinstance(value, dict):  # (a key read as a number is its text: keys are names; `{010: x}` names "010")
        return {key.text if isinstance(key, _Written) else key: _as_written(item, (*path, key))
                for key, item in value.items()}
    if isinstance(value, list):
        return [_as_written(item, (*path, i)) for i, item in enumerate(value)]
    if isinstance(value, _Written):
        if _takes_text(path):
            return value.text
        return int(value) if isinstance(value, int) else float(value)
    return value


def _did_you_mean(path: Sequence[str | int]) -> str:
    """`` (did you mean KEY?)`` for an unknown key close to a known one of its section, else ``""``.

    Example::

        >>> _did_you_mean(("optimzer",)), _did_you_mean(("task", "nmae")), _did_you_mean(("task", "zzz"))
        (' (did you mean optimizer?)', ' (did you mean name?)', '')
    """
    section = _section_at(path[:-1])
    close = difflib.get_close_matches(str(path[-1]), list(section.model_fields), n=1) if section else []
    return f" (did you mean {close[0]}?)" if close else ""


_NULL_WORDS = {"none", "nil"}
"""What a ``null`` is written as in other languages (YAML reads them as text): the error of a
key that takes null says how YAML writes it (``Null`` and ``NULL`` are YAML's null already)."""


def yaml_spelled(value: Any) -> str:
    """A setting's value as a config file spells it, for a line read beside one: ``null``,
    ``true``/``false`` (YAML's, not Python's ``None``/``True``), text quoted (``'bf16'``, one word
    apart from the line's), a list or mapping in flow style with its items spelled so.

    Example::

        >>> yaml_spelled(None), yaml_spelled(True), yaml_spelled("bf16"), yaml_spelled(1e-3)
        ('null', 'true', "'bf16'", '0.001')
        >>> yaml_spelled(["head", None]), yaml_spelled({"project": "p", "enabled": False})
        ("['head', null]", "{'project': 'p', 'enabled': false}")
    """
    if isinstance(value, bool) or value is None:
        return "null" if value is None else str(value).lower()
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(yaml_spelled, value))}]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{yaml_spelled(k)}: {yaml_spelled(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _shown(value: Any) -> str:
    """A value the config was given, for an error line: as YAML writes a boolean or null
    (:func:`yaml_spelled`), else :func:`~ampguard.errors.brief` (cut short: ``--set
    precision=<5,000 characters>`` was echoed whole).

    Example::

        >>> _shown(True), _shown(None), _shown("fp4"), _shown([1, 2]), len(_shown("x" * 5000))
        ('true', 'null', "'fp4'", 'a list of 2', 40)
    """
    if isinstance(value, bool) or value is None:
        return yaml_spelled(value)
    return brief(value)


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    path = first["loc"]
    loc = shortened(".".join(str(part) for part in path), 120)  # (a key of thousands of characters: cut short)
    if first["type"] == "extra_forbidden":
        key = str(path[-1]) if path else ""
        if key == "":  # ("config: : unknown key")
            return f"{loc.removesuffix('.')}: an empty key ('')" if loc.removesuffix(".") else "an empty key ('')"
        parts = [*map(str, path[:-1]), *key.split(".")]
        if "." in key and _field_at(parts) is not None:  # (--set's spelling in a file, of a setting there is:
            # "optimizer.lr: unknown key" named a real setting unknown; one there is not stays unknown, 51k)
            nested = ": {".join(key.split(".")) + ": ..." + "}" * key.count(".")
            return (f"{loc}: a key with a dot in it: nest it ({nested}) in a file; dotted keys are "
                    "--set's spelling")
        return f"{loc}: unknown key{_did_you_mean(path)}"
    msg = first["msg"].removeprefix("Value error, ")
    field, given = _field_at(path), first.get("input")
    if first["type"] == "model_type" and field is not None and any(
            getattr(check, "func", None) is _section_switch for check in field.metadata):  # log.wandb, log.mlflow
        msg = "expected true, false, null or a mapping of its settings"
    if first["type"] not in ("value_error", "assertion_error"):
        msg = f"{msg} (got {_shown(given)})"
    if (isinstance(given, str) and given.strip().lower() in _NULL_WORDS and field is not None
            and type(None) in get_args(field.annotation)):
        msg += " (null is written null)"
    return f"{loc}: {msg}" if loc else msg  # (Config's cross-field rules: no loc, each names its own key)


def validate(data: dict[str, Any]) -> Config:
    """Build a :class:`Config` from a plain mapping, or raise :class:`ConfigError` (one line).

    Example::

        >>> validate({"steps": 5, "monitor": {"min_steps": 0}}).monitor.min_steps
        0
        >>> validate({"monitor": {"bogus": 1}})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: monitor.bogus: unknown key
        >>> validate({"monitor": {"windw": 100}})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: monitor.windw: unknown key (did you mean window?)
        >>> validate({"monitor": {"fail_rate": "None"}})
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: monitor.fail_rate: expected a number, got the text 'None' (null is written null)
    """
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"config: {_format_error(err)}") from None


def read_file(path: str | Path) -> dict[str, Any]:
    """Parse a YAML, JSON or TOML config file into a mapping (by its extension).

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = Path(d) / "c.toml"
        ...     _ = path.write_text("steps = 3\\n[scaler]\\nmin_scale = 2.0\\n", encoding="utf-8")
        ...     read_file(path)
        {'steps': 3, 'scaler': {'min_scale': 2.0}}
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; name the config file")
    if not path.is_file():  # (a FIFO or a device exists: "not found" would send one looking for a missing file)
        raise ConfigError(f"config file {path} is not a regular file; name the config file" if path.exists()
                          else f"config file not found: {path}")
    suffix = path.suffix.lower()
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ConfigError(f"config file {path}: larger than {MAX_FILE_BYTES // 1024} KiB; is it a config?")
        text = path.read_text(encoding="utf-8-sig")  # (a byte-order mark, as Windows editors write: gone)
        if suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_TextKeepingLoader)  # noqa: S506 - a SafeLoader without aliases
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_keys)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"config file {path}: unknown format {suffix!r} (use .yaml, .yml, .json or .toml)")
    except ConfigError:
        raise
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError, ValueError) as err:
        first = first_line(err)
        mark = getattr(err, "problem_mark", None)  # (PyYAML's first line names neither the problem nor the line)
        if isinstance(err, yaml.MarkedYAMLError) and mark is not None and "(line " not in first:  # (ours say it)
            first = f"{err.problem or first} (line {mark.line + 1}, column {mark.column + 1})"
        raise ConfigError(f"config file {path}: cannot parse: {first}") from None
    except RecursionError:
        raise ConfigError(f"config file {path}: nested more than {MAX_DEPTH} levels deep") from None
    except OSError as err:
        raise ConfigError(f"config file {path}: cannot read it ({failed_because(err)})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        kind = type(data) if not isinstance(data, _Written) else int if isinstance(data, int) else float
        # (a number's kind as YAML read it, not the loader's _WrittenInt, an internal name)
        raise ConfigError(f"config file {path}: the top level must be a mapping, got {kind.__name__}")
    _plain(data)
    return _as_written(data)


def as_it_ran(data: dict[str, Any]) -> dict[str, Any]:
    """A run's saved config (its ``config.yaml``, a checkpoint's) as this version reads it: a
    setting added since an older ampguard wrote it takes the value that run ran with, not the new
    default. ``monitor.clear_rate``: an ALERT cleared at ``alert_rate`` before it had a level of
    its own (the default now is 0.8 x ``alert_rate``). ``fp8.exclude``, ``log.wandb.tags``,
    ``fp32_modules`` and ``rollback.triggers`` listed a name twice before that was refused: the
    run ran as if once (a pattern matches or not; W&B keeps a tag once; a module is kept in
    float32, a trigger armed, once), so it reads once (review 54q: a resume checks a checkpoint's
    config against the schema, and refused such an older run's).

    Example::

        >>> as_it_ran({"monitor": {"alert_rate": 0.1}})
        {'monitor': {'alert_rate': 0.1, 'clear_rate': 0.1}}
        >>> as_it_ran({"monitor": {"alert_rate": 0.1, "clear_rate": None}})  # written by this version
        {'monitor': {'alert_rate': 0.1, 'clear_rate': None}}
        >>> as_it_ran({"fp8": {"exclude": ["a", "b", "a"]}, "log": {"wandb": {"tags": ["t", "t"]}}})
        {'fp8': {'exclude': ['a', 'b']}, 'log': {'wandb': {'tags': ['t']}}}
        >>> as_it_ran({"fp32_modules": ["head", "head"], "rollback": {"triggers": ["spike", "spike"]}})
        {'fp32_modules': ['head'], 'rollback': {'triggers': ['spike']}}
    """
    monitor = data.get("monitor")
    if isinstance(monitor, dict) and "clear_rate" not in monitor:  # (written before the ALERT had a clear level)
        data = {**data, "monitor": {**monitor, "clear_rate": monitor.get("alert_rate", MonitorConfig().alert_rate)}}
    for section, key in ((("fp8",), "exclude"), (("log", "wandb"), "tags"), ((), "fp32_modules"),
                         (("rollback",), "triggers")):  # (listed twice before it was refused)
        data = _listed_once_as_it_ran(data, section, key)
    return data


def _listed_once_as_it_ran(data: dict[str, Any], section: tuple[str, ...], key: str) -> dict[str, Any]:
    """``data`` with the list of names at ``section.key`` holding each once (in order), where it
    is a list of names that holds one twice; anything else as it is, for :func:`validate` to judge."""
    parents = [data]
    for part in section:
        child = parents[-1].get(part)
        if not isinstance(child, dict):
            return data
        parents.append(child)
    names = parents[-1].get(key)
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)) or len(set(names)) == len(names):
        return data
    node: Any = {**parents[-1], key: list(dict.fromkeys(names))}
    for parent, part in zip(reversed(parents[:-1]), reversed(section)):  # (copies: the caller's data is not changed)
        node = {**parent, part: node}
    return node


def read_run_config(path: str | Path) -> Config:
    """A run folder's ``config.yaml``, validated. A run writes every setting there
    (:func:`dump_config`): an empty file is refused, not read as the defaults (an fp16 run's
    would read as bf16 without a scaler). One written before ``monitor.clear_rate`` existed
    (no such key) ran with its ALERT clearing at ``alert_rate``: it reads so, and ``report``
    judges the run as it ran.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = Path(d) / "config.yaml"
        ...     _ = path.write_text(dump_config(validate({"precision": "fp16"})))
        ...     precision = read_run_config(path).precision
        ...     _ = path.write_text("")
        ...     try:
        ...         read_run_config(path)
        ...     except ConfigError as err:
        ...         refused = str(err).replace(d, "RUN")
        >>> precision, refused
        ('fp16', "config file RUN/config.yaml: empty; a run's config.yaml holds every setting")
    """
    data = read_file(path)
    if not data:
        raise ConfigError(f"config file {path}: empty; a run's config.yaml holds every setting")
    try:
        return validate(as_it_ran(data))
    except ConfigError as err:  # (which file's settings they are)
        raise ConfigError(f"config file {path}: {err}") from None


def given_keys(section: BaseModel, prefix: str = "") -> dict[str, Any]:
    """The settings a config was given (each section's ``model_fields_set``, a file's keys and
    ``--set``'s, not the defaults filled in) that are not at their defaults, dotted, to their values.

    Example::

        >>> given_keys(validate({"steps": 5, "scaler": {"min_scale": 1.0, "init_scale": 8}, "log": {"wandb": True}}))
        {'steps': 5, 'scaler.init_scale': 8.0}
    """
    given: dict[str, Any] = {}
    for name in sorted(section.model_fields_set, key=list(type(section).model_fields).index):
        value, field = getattr(section, name), type(section).model_fields[name]
        if isinstance(value, BaseModel):
            given.update(given_keys(value, f"{prefix}{name}."))
        elif value != field.get_default(call_default_factory=True):
            given[f"{prefix}{name}"] = value
    return given


def ignored_settings(config: Config, verb: str = "train", only: Sequence[str] | None = None) -> list[str]:
    """One line per group of settings given (:func:`given_keys`) that a ``verb`` run does not
    read, for a warning (as ``task linear does not read task.n_layer: ignored``): the loss
    scaler's without one, ``fp8`` outside ``precision: fp8``, ``fp32_modules`` under ``precision:
    fp32``, ``checkpoint`` with checkpoints off, the other optimizer's, a constant schedule's floor,
    ``rollback`` with no trigger (and a trigger's own settings without it: ``z``/``window``
    without ``loss_spike``, ``val_*`` without ``val_regression``),
    ``eval.every`` with evaluation off, ``monitor.headroom`` without its ``every`` (telemetry off),
    ``monitor.fail_after`` with nothing to fail fast,
    ``monitor.fail_on_scale_collapse`` with no loss scaler, and a ``fail_rate`` of 1 (no skip
    rate is above it: given, it never trips); ``validate`` names its own report folder and injects no faults. ``only``: just the
    settings under these keys (a resume's ``--set``: its ``config.yaml`` gives every key, and what
    it held was said when the run began).

    Example::

        >>> for line in ignored_settings(validate({"precision": "fp32", "scaler": {"min_scale": 2},
        ...                                        "fp8": {"recipe": "rowwise"}, "checkpoint": {"enabled": False, "every": 1}})):
        ...     print(line)
        precision fp32 uses no loss scaler: scaler.min_scale ignored
        the fp8 section is read under precision: fp8 only (this run is fp32): fp8.recipe ignored
        checkpoint.enabled is false: checkpoint.every ignored
        >>> for line in ignored_settings(validate({"optimizer": {"momentum": 0.5}, "monitor": {"fail_after": 5},
        ...                                        "schedule": {"decay": "constant", "min_lr_ratio": 0.5}})):
        ...     print(line)
        optimizer adamw has no momentum setting (SGD's): optimizer.momentum ignored
        schedule.decay is constant (no decay to a floor): schedule.min_lr_ratio ignored
        monitor.fail_rate is not set and no scale-collapse guard runs (monitor.fail_on_scale_collapse with a loss scaler): nothing fails fast: monitor.fail_after ignored
        >>> ignored_settings(validate({"monitor": {"fail_rate": 1.0}}))
        ['monitor.fail_rate 1: no skip rate is above 1, so the fail-fast never trips (a rate below 1 arms it, even when every step skips; null turns it off)']
        >>> ignored_settings(validate({"precision": "bf16", "monitor": {"fail_on_scale_collapse": True}}))
        ['precision bf16 uses no loss scaler (no scale to collapse): monitor.fail_on_scale_collapse ignored']
        >>> ignored_settings(validate({"precision": "fp16", "scaler": {"min_scale": 2}}))  # (read: nothing to say)
        []
        >>> for line in ignored_settings(validate({"precision": "fp32", "fp32_modules": ["head"], "checkpoint": {"every": 5},
        ...                                        "rollback": {"triggers": ["loss_spike"], "window": 20, "val_mode": "min"}})):
        ...     print(line)
        precision fp32 runs no autocast (every module computes in FP32 already): fp32_modules ignored
        rollback.triggers has no val_regression (no held-out rollback): rollback.val_mode ignored
        >>> for line in ignored_settings(validate({"log": {"name": "v"}, "inject": ["nan_loss@2"], "steps": 3}), "validate"):
        ...     print(line)
        validate names its report folder itself (log.dir/validate-<time>, or --out): log.name ignored
        validate injects no faults: inject ignored
        >>> ignored_settings(validate({"compile": True, "fast": True}), "validate")
        ["validate runs the model eagerly, on the exact step (compile and the fast path are train's): compile, fast ignored"]
        >>> ignored_settings(validate({"compile": False, "fast": False}), "validate")  # (what validate does)
        []
        >>> fp32 = validate({"precision": "fp32", "scaler": {"min_scale": 2, "init_scale": 4}})
        >>> ignored_settings(fp32, only=["scaler.init_scale"])  # (a resume's --set gave this one)
        ['precision fp32 uses no loss scaler: scaler.init_scale ignored']
    """
    given = [key for key in given_keys(config)
             if only is None or any(key == o or key.startswith(f"{o}.") for o in only)]

    def under(prefix: str | tuple[str, ...], why: str, switch: str = "enabled") -> list[str]:
        # (a section's own switch, `enabled` or `rollback.triggers`, is read: it says why)
        switches = {f"{p}{switch}" for p in ((prefix,) if isinstance(prefix, str) else prefix)}
        keys = [key for key in given if key.startswith(prefix) and key not in switches]
        return [f"{why}: {', '.join(keys)} ignored"] if keys else []

    if verb == "validate":
        # (review 53k: unsaid; validate judges the model as it computes eagerly, AMP against FP32; review
        # 53m: fast: false, a run's ask for exact steps, is what validate does: nothing ignored)
        speed = [key for key, on in (("compile", config.compile), ("fast", config.fast)) if on and key in given]
        return (under("log.name", "validate names its report folder itself (log.dir/validate-<time>, or --out)")
                + under("inject", "validate injects no faults")
                + ([f"validate runs the model eagerly, on the exact step (compile and the fast path are train's): "
                    f"{', '.join(speed)} ignored"] if speed else []))
    lines = []
    if not config.scaler_on:
        why = "scaler.enabled is false" if config.scaler.enabled is False else \
            f"precision {config.precision} uses no loss scaler"
        lines += under("scaler.", why)
        lines += under("monitor.fail_on_scale_collapse", f"{why} (no scale to collapse)")
    if config.precision != "fp8":
        lines += under("fp8.", f"the fp8 section is read under precision: fp8 only (this run is {config.precision})")
    if not config.checkpoint.enabled:
        lines += under("checkpoint.", "checkpoint.enabled is false")
    opt = config.optimizer
    if opt.name == "adamw":
        lines += under("optimizer.momentum", "optimizer adamw has no momentum setting (SGD's)")
    else:
        lines += under(("optimizer.betas", "optimizer.eps"), "optimizer sgd has no betas or eps (AdamW's)")
    if config.schedule.decay == "constant":
        lines += under("schedule.min_lr_ratio", "schedule.decay is constant (no decay to a floor)")
    if config.precision == "fp32":  # (review 58a: the names were checked and nothing more, unsaid; fp8 refuses them)
        lines += under("fp32_modules", "precision fp32 runs no autocast (every module computes in FP32 already)")
    triggers = config.rollback.triggers
    if not triggers:
        lines += under("rollback.", "rollback.triggers is empty (no rollback)", switch="triggers")
    else:  # (review 58a: a trigger's own settings without it)
        if "loss_spike" not in triggers:
            lines += under(("rollback.z", "rollback.window"), "rollback.triggers has no loss_spike (no loss-spike detector)")
        if "val_regression" not in triggers:
            lines += under(("rollback.val_regression", "rollback.val_metric", "rollback.val_mode"),
                           "rollback.triggers has no val_regression (no held-out rollback)")
    if not config.eval.enabled:
        lines += under(("eval.every", "eval.batches"), "eval.enabled is false")
    mon = config.monitor
    if mon.headroom.every is None:  # review 53a: alert_bits / format without the monitor were silent
        lines += under("monitor.headroom.", "monitor.headroom.every is not set (headroom telemetry off)",
                       switch="every")
    collapse = mon.fail_on_scale_collapse and config.scaler_on
    if mon.fail_rate is None and not collapse:  # (the CLI's --fail-after is refused so)
        lines += under("monitor.fail_after", "monitor.fail_rate is not set and no scale-collapse guard runs "
                                             "(monitor.fail_on_scale_collapse with a loss scaler): nothing fails fast")
    if mon.fail_rate == 1 and "monitor.fail_rate" in given:  # (an alert_rate of 1 is how the ALERT is turned off)
        lines.append("monitor.fail_rate 1: no skip rate is above 1, so the fail-fast never trips (a rate below 1 "
                     "arms it, even when every step skips; null turns it off)")
    return lines


def flat_keys(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaves (lists are leaves): a config's settings one by one.

    Example::

        >>> flat_keys({"a": 1, "b": {"c": [1, 2], "d": {}}})
        {'a': 1, 'b.c': [1, 2]}
    """
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flat_keys(value, f"{prefix}.{key}" if prefix else key))
    return out


def _switch(path: Sequence[str | int]) -> bool:
    """Whether the setting at ``path`` is a switch that is also a section (``log.wandb``, ``log.mlflow``).

    Example::

        >>> _switch(("log", "wandb")), _switch(("log", "mlflow")), _switch(("log", "name")), _switch(("task",))
        (True, True, False, False)
    """
    field = _field_at(path)
    return field is not None and any(getattr(check, "func", None) is _section_switch for check in field.metadata)


def _comment_at(raw: str) -> int | None:
    """Where the YAML comment in a ``--set`` value begins (``exp #3``: at its ``#``), a comment YAML
    drops without a word (``log.name=exp #3`` was the folder ``exp``; ``log.name=#3`` no name at
    all), or None. A ``#`` inside a word (``a#b``) or in quotes is the value's own.

    Example::

        >>> _comment_at("exp #3"), _comment_at("#3"), _comment_at("[a, b] # c"), _comment_at("'a #b' #c")
        (4, 0, 7, 7)
        >>> _comment_at("a#b"), _comment_at("'exp #3'"), _comment_at('"#3"'), _comment_at("3")
        (None, None, None, None)
    """
    if "#" not in raw:
        return None
    spans = [(token.start_mark.index, token.end_mark.index) for token in yaml.scan(raw, Loader=_PlainLoader)]
    return next((i for i, char in enumerate(raw) if char == "#" and not any(a <= i < b for a, b in spans)), None)


def _takes_plain_text(path: Sequence[str]) -> bool:
    """Whether the setting at ``path`` is one text value (``log.name``, ``log.wandb.name``, a tag of
    ``log.mlflow.tags``), where a quoted value is the text itself: not a number, a choice of
    words (``precision``), a list or a section.

    Example::

        >>> [_takes_plain_text(p) for p in (("log", "name"), ("log", "dir"), ("log", "mlflow", "tags", "t"),
        ...                                 ("optimizer", "lr"), ("precision",), ("inject",), ("log", "wandb", "tags"))]
        [True, True, True, False, False, False, False]
    """
    field = _field_at(path)
    if field is not None:
        annotation = field.annotation
    else:  # a value of a mapping (log.mlflow.tags.<name>)
        parent = _field_at(path[:-1]) if len(path) > 1 else None
        if parent is None or get_origin(parent.annotation) is not dict:
            return False
        annotation = get_args(parent.annotation)[1]
    if annotation is str:
        return True
    return get_origin(annotation) in (Union, UnionType) and str in get_args(annotation) and \
        all(arg in (str, type(None)) for arg in get_args(annotation))


def _comment_advice(key: str, raw: str, at: int) -> str:
    """What to do about the YAML comment at ``raw[at:]`` of ``--set key=raw``: quote the value where
    quoting keeps the ``#`` as the setting's own text (a text setting, or a value of the free-form
    ``task.options``, not quoted already), else leave the comment out: quoted, a number setting's
    value would be text, which it refuses (``optimizer.lr="1e-3 # from the paper"``), and quotes
    around quotes are no one's meaning.

    Example::

        >>> _comment_advice("log.name", "exp #3", 4)
        'quote the value to keep it (log.name="exp #3")'
        >>> _comment_advice("optimizer.lr", "1e-3 # from the paper", 5)
        'optimizer.lr is not text, so leave the comment out (optimizer.lr=1e-3)'
        >>> _comment_advice("task.options.s", "'a' #b", 4)
        "the value is quoted already, so leave the comment out (task.options.s='a')"
        >>> _comment_advice("inject", "nan_loss@5 #x", 11)
        'inject is not text, so leave the comment out (inject=[nan_loss@5])'
        >>> _comment_advice("task.options.n", "3 # three", 2)
        'quote the value to keep it as text (task.options.n="3 # three"), or leave the comment out (task.options.n=3)'
    """
    parts = key.split(".")
    kept = raw[:at].strip()
    free_form = len(parts) > 2 and parts[:2] == ["task", "options"]  # (a factory's own settings: any value)
    plain = not kept or kept[0] not in "'\"[{!&*|>"  # (a plain scalar, not quoted, a list, a tag or an anchor)
    field = _field_at(parts)
    if kept and plain and field is not None and get_origin(field.annotation) is list:
        kept = f"[{kept}]"  # (a list setting's one item: inject=nan_loss@5 is no list)
    without = shortened(f"{key}={kept}", 80) if kept and not has_control(kept) else None
    if plain and (free_form or _takes_plain_text(parts)):
        quoted = shortened(f"{key}={json.dumps(raw.strip(), ensure_ascii=False)}", 80)
        if free_form and without is not None:
            return f"quote the value to keep it as text ({quoted}), or leave the comment out ({without})"
        return f"quote the value to keep it ({quoted})"
    if without is None:  # (nothing but the comment: a setting that is not text needs a value)
        return f"give {shortened(key, 80)} a value without a comment"
    if kept[0] in "'\"":
        return f"the value is quoted already, so leave the comment out ({without})"
    if field is not None or _takes_plain_text(parts):  # (a known setting: why quoting would not do)
        return f"{shortened(key, 80)} is not text, so leave the comment out ({without})"
    return f"leave the comment out ({without})"


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (values parsed as YAML scalars) to a copy of ``data``.

    A tracker's switch and its settings combine (``log.wandb``, ``log.mlflow``): a switch that is
    on (``true``, ``on``...) or null, given a setting, is the section of that setting; ``true``
    given after settings keeps them (``false`` turns the tracker off, settings and all).

    Example::

        >>> apply_overrides({"steps": 5}, ["monitor.min_steps=0", "scaler.min_scale=0.5", "steps=7"])
        {'steps': 7, 'monitor': {'min_steps': 0}, 'scaler': {'min_scale': 0.5}}
        >>> apply_overrides({"task": None}, ["task.name=linear"])  # (the section the file left empty)
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: --set task.name: task is null in the config, not a section
        >>> apply_overrides({}, ["log.mlflow=true", "log.mlflow.experiment=e", "log.wandb.project=p", "log.wandb=on"])
        {'log': {'mlflow': {'experiment': 'e'}, 'wandb': {'project': 'p'}}}
        >>> apply_overrides({"log": {"wandb": False}}, ["log.wandb.project=p"])
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: --set log.wandb.project: log.wandb is false (off) in the config: turn it on to set its settings (--set log.wandb=true)
        >>> apply_overrides({}, ["log.name=exp #3"])
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: --set log.name: '#3' is a YAML comment there, which would be dropped: quote the value to keep it (log.name="exp #3")
    """
    data = json.loads(json.dumps(data))  # a deep copy of plain data
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {brief(item)}: expected key.sub=value")
        try:
            value = yaml.load(raw, Loader=_TextKeepingLoader) if raw.strip() else None  # noqa: S506
            at = _comment_at(raw)
        except (yaml.YAMLError, ValueError, RecursionError) as err:
            # ours (a key given twice, an alias), or a number past int()'s digits, say why; the value is cut short
            why = f" ({first_line(err)})" if type(err) is yaml.YAMLError or "digits" in str(err) else ""
            raise ConfigError(f"--set {key}: cannot parse value {brief(raw)}{why}") from None
        if at is not None:  # (README: a text setting takes the text as written; YAML would cut it here)
            comment = raw[at:].splitlines()[0].strip()
            raise ConfigError(f"--set {key}: {brief(comment)} is a YAML comment there, which would be dropped: "
                              f"{_comment_advice(key, raw, at)}")
        _plain(value, key)
        parts = key.split(".")
        value = _as_written(value, tuple(parts))
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            where = ".".join(parts[: i + 1])
            if not isinstance(child, dict) and _switch(parts[: i + 1]):  # a tracker's switch, given a setting
                if _section_switch(child) is None and child is not None:  # (false, off: said so, not turned on)
                    raise ConfigError(f"--set {key}: {where} is {_shown(child)} (off) in the config: turn it on to "
                                      f"set its settings (--set {where}=true)")
                if child is None or _section_switch(child) == {}:  # null or on: the section of its settings
                    child = node[part] = {}
            if not isinstance(child, dict):  # (`task:` with nothing under it is null)
                raise ConfigError(f"--set {key}: {where} is {_shown(child)} in the config, not a section")
            node = child
        if _switch(parts) and isinstance(node.get(parts[-1]), dict) and (
                value is True or isinstance(value, str) and value.strip().lower() in _ON):
            continue  # a switch turned on after its settings were given: they stay (on, as they were)
        node[parts[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *,
                base: dict[str, Any] | None = None, inject: list[str] | None = None, no_inject: bool = False,
                sections: dict[str, dict[str, Any]] | None = None) -> Config:
    """The effective config: the file at ``path`` (or ``base``, or the defaults), then ``--set``
    overrides, then ``inject`` specs added to the file's (``no_inject``: in place of them, as
    ``--inject none`` asks), then ``sections`` merged into their sections (flags such as
    ``--fail-skip-rate`` -> ``monitor.fail_rate``). What every verb reads.

    Example::

        >>> load_config(None, ["precision=fp16", "scaler.min_scale=4"]).scaler.min_scale
        4.0
        >>> c = load_config(base={"inject": ["nan_loss@3"]}, inject=["spike@5"], sections={"monitor": {"fail_rate": 0.5}})
        >>> c.inject, c.monitor.fail_rate
        (['nan_loss@3', 'spike@5'], 0.5)
        >>> load_config(base={"inject": ["nan_loss@3"]}, no_inject=True).inject
        []
        >>> load_config(base={"inject": ["nan_loss@3"]}, inject=["nan_loss@3"]).inject  # a resume's own: once
        ['nan_loss@3']
        >>> load_config(base={"diagnose": False}, sections={"diagnose": {"strict": True}})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: diagnose: Input should be a valid dictionary...
    """
    data = read_file(path) if path is not None else dict(base or {})
    data = apply_overrides(data, overrides or [])
    _plain(data)  # (a --set key path nests too: deeper than MAX_DEPTH, no reader takes the run's config.yaml)
    if no_inject:
        data["inject"] = []
    # the flags add to what the file holds where it holds the right shape; anything else is left as
    # it is for validate() to refuse in its words (a flag never hides a file's bad value)
    if inject and isinstance(data.get("inject", []), list):  # (a fault the file holds already is its own: once)
        held = list(data.get("inject", []))
        data["inject"] = held + [spec for spec in inject if spec not in held]  # (one given twice: refused, as demo)
    for section, values in (sections or {}).items():
        if values and isinstance(data.get(section, {}), dict):
            data[section] = {**data.get(section, {}), **values}
    return validate(data)


class _PlainDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, which quotes a string that YAML 1.1 reads as something else (``"010"``,
    ``"1:30"``, ``"off"``), and also one that YAML 1.2 reads as a number (``"1e3"``, ``"0o7"``):
    what it writes reads back the same in both, here and with ``yaml.safe_load``."""


for _tag, _regexp, _first in _NUMBER_RESOLVERS:
    _PlainDumper.add_implicit_resolver(_tag, _regexp, _first)


def _non_finite_kept(dumped: Any, value: Any) -> Any:
    """``dumped`` (a value as ``model_dump(mode="json")`` gives it) with each infinity and NaN of
    ``value`` (the same, in Python's mode) put back where JSON's mode made it null."""
    if isinstance(value, float) and not math.isfinite(value):
        return value
    if isinstance(dumped, dict) and isinstance(value, dict):
        return {key: _non_finite_kept(item, value.get(key)) for key, item in dumped.items()}
    if isinstance(dumped, list) and isinstance(value, (list, tuple)) and len(dumped) == len(value):
        return [_non_finite_kept(item, original) for item, original in zip(dumped, value)]
    return dumped


def plain_data(config: Config) -> dict[str, Any]:
    """The config as plain data (``model_dump(mode="json")``) with each infinity and NaN of
    ``task.options`` kept a float (JSON's mode makes them null): what a checkpoint saves and a
    resume compares, as :func:`dump_config` writes them.

    Example::

        >>> plain_data(validate({"task": {"options": {"cap": math.inf}}}))["task"]["options"]
        {'cap': inf}
    """
    return _non_finite_kept(config.model_dump(mode="json"), config.model_dump())


def dump_config(config: Config) -> str:
    """The config as YAML, every field shown (what ``--print-config`` prints and a run's
    ``config.yaml`` holds). An infinity or NaN (``task.options`` takes them: a factory's own
    settings) is YAML's ``.inf``, ``-.inf``, ``.nan``, read back as the same float (JSON has
    none: ``model_dump(mode="json")`` made them null, and a resume handed the factory None).

    Example::

        >>> text = dump_config(Config())
        >>> "min_steps: 100" in text, validate(yaml.safe_load(text)) == Config()
        (True, True)
        >>> text = dump_config(load_config(None, ["log.name=1e3"]))  # (YAML 1.1 reads 1e3 as text, 1.2 as 1000.0)
        >>> "name: '1e3'" in text, yaml.load(text, Loader=_PlainLoader)["log"]["name"]
        (True, '1e3')
        >>> config = validate({"task": {"options": {"cap": math.inf, "low": [-math.inf, 1.5], "x": math.nan}}})
        >>> text = dump_config(config)
        >>> text[text.index("options:"):text.index("batch_size")].split()
        ['options:', 'cap:', '.inf', 'low:', '-', '-.inf', '-', '1.5', 'x:', '.nan']
        >>> options = yaml.load(text, Loader=_PlainLoader)["task"]["options"]
        >>> options["cap"], options["low"], math.isnan(options["x"]), dump_config(validate(yaml.load(text, Loader=_PlainLoader))) == text
        (inf, [-inf, 1.5], True, True)
    """
    return yaml.dump(plain_data(config), Dumper=_PlainDumper, sort_keys=False)


EXACT_ONLY: tuple[tuple[str, Callable[[Config], bool]], ...] = (
    ("diagnose.first_skip", lambda c: c.diagnose.first_skip),
    ("diagnose.strict", lambda c: c.diagnose.strict),
    ("monitor.headroom", lambda c: c.monitor.headroom.every is not None),
    ("rollback.triggers", lambda c: bool(c.rollback.triggers)),
    ("scheduler_on_skip: step", lambda c: c.scheduler_on_skip == "step"),
)
"""The settings that need each step decided at the host (the exact path): they act on a
skipped step's own batch or gradients, or on the state right after the trigger step."""


def check_fast(config: Config, world_size: int = 1) -> None:
    """``fast: true`` beside what the fast path cannot serve, one :class:`InputError` line: an
    :data:`EXACT_ONLY` setting, ``optimizer.fused: false``, a world of several processes. From
    the config and the world alone: ``--print-config`` refuses what ``train`` would.

    Example::

        >>> from ampguard.config import validate
        >>> check_fast(validate({"fast": True, "optimizer": {"fused": False}}))
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: fast: true runs the fused optimizer (the sync-free step hands it the skip flag), and optimizer.fused is false: set one of them otherwise
    """
    if not config.fast:
        return
    blocking = next((name for name, on in EXACT_ONLY if on(config)), None)
    if blocking is not None:
        raise InputError(f"fast: true cannot serve {blocking}, which needs each step decided at the host "
                         "(set fast: false)")
    if config.optimizer.fused is False:
        raise InputError("fast: true runs the fused optimizer (the sync-free step hands it the skip flag), and "
                         "optimizer.fused is false: set one of them otherwise")
    if world_size > 1:
        raise InputError("fast: true runs in one process; under torchrun the step agrees with the other "
                         "ranks at the host every step (set fast: false)")
