"""``Recipe``: which scheme each group of modules gets, as data.

A recipe is a list of groups, each a list of targets and one scheme, plus an optional default
scheme (every quantizable linear no group claims) and ``ignore`` entries. A target is

- an exact module name (``model.layers.0.mlp.down_proj``),
- ``re:<regex>``, matched with ``re.match`` against the module name (as compressed-tensors and
  llm-compressor match their targets: anchored at the start, not at the end), or
- ``Linear``: every linear (the class target; explicit names and regexes win over it).

Written as a mapping (Python dict, JSON or YAML file), a recipe is either flat::

    {"re:.*mlp\\.down_proj": "w8a8-fp8", "default": "nvfp4", "ignore": ["re:.*layers\\.0\\."]}

(each key other than ``default`` / ``ignore`` one target, its value a scheme) or grouped, as
llm-compressor's recipes are::

    {"config_groups": {"attn": {"targets": ["re:.*self_attn"], "scheme": "w8a8-int8"}, ...},
     "default": "w4a16", "ignore": ["lm_head"]}

A scheme is a preset's name or a full scheme mapping (``Scheme.to_dict()``). ``Recipe.to_dict()``
writes the grouped form, which ``Recipe.of`` reads back to the same recipe.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from lowbit.errors import LowbitError
from lowbit.formats.base import matches_ignore_entry
from lowbit.schemes import Scheme, get_scheme

CLASS_TARGET = "Linear"
_RESERVED = ("default", "ignore", "config_groups")


class RecipeError(LowbitError, ValueError):
    """A recipe is malformed or does not fit the model (the message names the entry)."""


@dataclass(frozen=True)
class RecipeGroup:
    """One group: its targets (names, ``re:`` regexes, ``Linear``) and their scheme."""

    targets: tuple[str, ...]
    scheme: Scheme
    name: str = ""

    def __post_init__(self) -> None:
        if not self.targets:
            raise RecipeError(f"recipe group {self.name or self.scheme.name!r} has no targets")
        for t in self.targets:
            check_target(t, f"recipe group {self.name or self.scheme.name!r}")


@dataclass(frozen=True)
class Recipe:
    """Groups of targets with their schemes, a default scheme (None: modules no group claims stay
    in float) and ignored modules (exact names or ``re:`` regexes; an ignored module stays in
    float whatever claims it)."""

    groups: tuple[RecipeGroup, ...] = ()
    default: Scheme | None = None
    ignore: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.groups and self.default is None:
            raise RecipeError("a recipe needs at least one group or a 'default' scheme")
        for t in self.ignore:
            check_target(t, "recipe 'ignore'")

    # ------------------------------------------------------------------ construction
    @classmethod
    def uniform(cls, scheme: Scheme | str) -> "Recipe":
        """One scheme for every quantizable linear."""
        return cls(default=_scheme(scheme, "scheme"))

    @classmethod
    def of(cls, value: "Recipe | Scheme | str | Mapping[str, Any] | os.PathLike") -> "Recipe":
        """A recipe from a Recipe, a Scheme or preset name (uniform), a mapping (flat or grouped,
        see the module's docstring) or the path of a ``.json`` / ``.yaml`` / ``.yml`` file."""
        if isinstance(value, Recipe):
            return value
        if isinstance(value, Scheme):
            return cls.uniform(value)
        if isinstance(value, os.PathLike):
            return cls.from_file(value)
        if isinstance(value, str):
            if Path(value).suffix.lower() in (".json", ".yaml", ".yml"):
                return cls.from_file(value)
            return cls.uniform(value)
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise RecipeError(f"a recipe is a scheme name, a mapping or a recipe file, got {type(value).__name__}")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Recipe":
        """Read a recipe file (JSON, or YAML by its suffix); a RecipeError names the file."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise RecipeError(f"recipe file {str(p)!r} cannot be read: {e.strerror or e}") from None
        try:
            if p.suffix.lower() in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except (ValueError, ImportError) as e:  # json.JSONDecodeError is a ValueError
            raise RecipeError(f"recipe file {str(p)!r} is not valid {'YAML' if p.suffix.lower() != '.json' else 'JSON'}: "
                              f"{_one_line(e)}") from None
        except Exception as e:  # yaml.YAMLError and its subclasses
            raise RecipeError(f"recipe file {str(p)!r} is not valid YAML: {_one_line(e)}") from None
        if not isinstance(data, Mapping):
            raise RecipeError(f"recipe file {str(p)!r} must hold a mapping, got {type(data).__name__}")
        try:
            return cls.from_dict(data)
        except RecipeError as e:
            raise RecipeError(f"recipe file {str(p)!r}: {e}") from None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Recipe":
        groups: list[RecipeGroup] = []
        if "config_groups" in d:
            cg = d["config_groups"]
            if not isinstance(cg, Mapping) or not cg:
                raise RecipeError("recipe 'config_groups' must be a non-empty mapping of groups")
            for gname, g in cg.items():
                if not isinstance(g, Mapping) or set(g) != {"targets", "scheme"}:
                    raise RecipeError(f"recipe group {gname!r} must have exactly 'targets' and 'scheme'")
                targets = g["targets"]
                if isinstance(targets, str):
                    targets = [targets]
                if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
                    raise RecipeError(f"recipe group {gname!r}: 'targets' must be a list of names")
                groups.append(RecipeGroup(tuple(targets), _scheme(g["scheme"], f"group {gname!r}"), str(gname)))
        for key, value in d.items():
            if key in _RESERVED:
                continue
            if not isinstance(key, str):
                raise RecipeError(f"recipe entry {key!r}: a target must be a string")
            groups.append(RecipeGroup((key,), _scheme(value, f"entry {key!r}"), key))
        default = d.get("default")
        ignore = d.get("ignore", ())
        if isinstance(ignore, str):
            ignore = [ignore]
        if not isinstance(ignore, (list, tuple)) or not all(isinstance(t, str) for t in ignore):
            raise RecipeError("recipe 'ignore' must be a list of module names or 're:' patterns")
        return cls(tuple(groups), None if default is None else _scheme(default, "'default'"), tuple(ignore))

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict[str, Any]:
        """The grouped mapping (JSON- and YAML-serialisable) that ``Recipe.of`` reads back; preset
        schemes by name, others in full."""
        out: dict[str, Any] = {"config_groups": {
            (g.name or f"group_{i}"): {"targets": list(g.targets), "scheme": _scheme_out(g.scheme)}
            for i, g in enumerate(self.groups)}} if self.groups else {}
        if self.default is not None:
            out["default"] = _scheme_out(self.default)
        if self.ignore:
            out["ignore"] = list(self.ignore)
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``to_dict()`` as JSON, or YAML for a ``.yaml`` / ``.yml`` path (to a temporary
        name, then renamed)."""
        from lowbit.files.atomic import write_text_atomic

        p = Path(path)
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        else:
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        write_text_atomic(p, text)
        return p

    @property
    def schemes(self) -> list[Scheme]:
        """The distinct schemes, groups first, then the default."""
        out: list[Scheme] = []
        for s in [g.scheme for g in self.groups] + ([self.default] if self.default is not None else []):
            if s not in out:
                out.append(s)
        return out

    @property
    def label(self) -> str:
        """A short name: the scheme of a uniform recipe, else the schemes joined by '+'."""
        return "+".join(s.name for s in self.schemes)


def check_target(t: str, where: str) -> None:
    if not isinstance(t, str) or not t:
        raise RecipeError(f"{where}: a target must be a non-empty string, got {t!r}")
    if t.startswith("re:"):
        try:
            re.compile(t[3:])
        except re.error as e:
            raise RecipeError(f"{where}: {t!r} is not a valid regular expression ({e})") from None


def matches(name: str, target: str) -> bool:
    """Whether module ``name`` is claimed by an explicit target (exact name or ``re:`` regex,
    ``re.match``: compressed-tensors' matching, the one definition in ``lowbit.formats.base``);
    the class target ``Linear`` is handled by the caller."""
    return matches_ignore_entry(name, target)


def _scheme(value: Any, where: str) -> Scheme:
    from lowbit.errors import SchemeError

    try:
        if isinstance(value, Mapping):
            return Scheme.from_dict(dict(value))
        if isinstance(value, (str, Scheme)):
            return get_scheme(value)
    except SchemeError as e:
        raise RecipeError(f"recipe {where}: {e}") from None
    raise RecipeError(f"recipe {where}: a scheme is a preset name or a scheme mapping, got {value!r}")


def _scheme_out(s: Scheme) -> str | dict:
    from lowbit.schemes import PRESETS

    return s.name if PRESETS.get(s.name) == s else s.to_dict()


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
