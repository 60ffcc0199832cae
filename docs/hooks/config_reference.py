"""MkDocs hook: write the configuration reference from scalify/config.py at build time.

The page `configuration.md` holds the marker line below; the hook replaces it with one table per
experiment section (key, accepted values, default), read from the section's dataclass, the
checkers in `_SCHEMAS` and the module's constants, so the reference cannot drift from what
`load_experiment` accepts. The module is imported from the checkout being built, not from an
installed Scalify (it needs only PyYAML, which MkDocs brings).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from mkdocs.exceptions import PluginError

MARKER = "<!-- generated: configuration reference -->"
PAGE = "configuration.md"

# What each named checker of scalify/config.py accepts, as a user writes it in YAML.
CHECKER_TEXT = {
    "_positive_int": "positive integer",
    "_positive_number": "positive number",
    "_boolean": "`true` or `false`",
    "_text": "non-empty string",
    "_optional_text": "string or `null`",
    "_function_path": "`module.path:function`",
}
# A section's keys' types, where no checker says more (lambdas, sections outside _SCHEMAS).
ANNOTATION_WORDS = {"str": "string", "int": "integer", "bool": "`true` or `false`",
                    "dict": "mapping", "None": "`null`"}

_config: ModuleType | None = None


def on_config(config: Any) -> Any:
    """Import scalify.config from the repository that holds mkdocs.yml."""
    global _config
    root = Path(config.config_file_path).resolve().parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    for name in [name for name in sys.modules if name == "scalify" or name.startswith("scalify.")]:
        del sys.modules[name]  # `mkdocs serve` rebuilds: read the source as it is now
    _config = importlib.import_module("scalify.config")
    if not Path(_config.__file__).resolve().is_relative_to(root):
        raise PluginError(f"scalify.config came from {_config.__file__}, not from {root}")
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Put the generated reference where configuration.md has the marker."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"{PAGE} lost its marker line {MARKER!r}")
    return markdown.replace(MARKER, reference(_config))


def reference(config: ModuleType) -> str:
    """The whole reference: top-level keys, one section per dataclass, the cross-field checks."""
    # The model and hlo sections are checked by functions of their own, not through _SCHEMAS,
    # and a hardware file's name defaults to the file's: those cells are stated here.
    model = section("model", config.ModelSpec, config, allowed={
        "family": one_of(config.FAMILIES), "preset": one_of(sorted(config.PRESETS)),
        "config": "mapping of HuggingFace config fields (the preset's keys)"}, defaults={
        "family": "the preset's family; required without a preset", "preset": "`null`",
        "config": "the preset's fields"})
    hardware = section("hardware", config.HardwareSpec, config, defaults={
        "name": "the file name without `.yaml`; required inline"})
    hlo = section("hlo", config.HloSpec, config, allowed={
        "outputs": "list of placements: " + first_sentence(config.parse_placement.__doc__ or "")})
    plain = [section(name, cls, config) for name, cls in (
        ("inputs", config.InputSpec), ("verify", config.VerifyOptions),
        ("tracking", config.TrackingSpec), ("engine", config.EngineSpec))]
    sections = [top_level(config), model, section("plan", config.PlanSpec, config), hardware,
                *plain, hlo, cross_checks(config)]
    return "\n\n".join(sections) + "\n"


def top_level(config: ModuleType) -> str:
    """The experiment file's own keys, and where a named model, plan or hardware is looked up."""
    rows = []
    for key in config._TOP_KEYS:
        if key == "name":
            text = "string; default: the file name without `.yaml`"
        elif key == "overrides":
            text = ("mapping of `section.field` to a value, `section` one of "
                    + ", ".join(f"`{name}`" for name in config._SECTIONS))
        elif key in config._REFERENCE_DIRS:
            text = (f"a name under `configs/{config._REFERENCE_DIRS[key]}/`, a path relative to "
                    f"the experiment file, or a mapping ([`{key}`](#{key}))")
        else:
            text = f"mapping ([`{key}`](#{key}))"
        rows.append((f"`{key}`", text))
    table = markdown_table(("key", "value"), rows)
    return f"## Experiment file\n\nThe keys of an experiment file:\n\n{table}"


def section(name: str, cls: type, config: ModuleType, allowed: dict[str, str] | None = None,
            defaults: dict[str, str] | None = None) -> str:
    """One section's docstring and its table of keys (`allowed`, `defaults`: cells given)."""
    schema = config._SCHEMAS.get(cls, {})
    allowed, defaults = allowed or {}, defaults or {}
    rows = []
    for field in dataclasses.fields(cls):
        if field.name in allowed:
            accepted = allowed[field.name]
        elif field.name in schema:
            accepted = describe_checker(schema[field.name], field.type)
        else:
            accepted = describe_annotation(field.type)
        default = defaults.get(field.name) or default_text(field)
        rows.append((f"`{field.name}`", accepted, default))
    parts = [f"## `{name}`", doc(cls), markdown_table(("key", "accepted values", "default"), rows)]
    folder = config._REFERENCE_DIRS.get(name)
    if folder is not None:
        shipped = sorted(path.stem for path in (config.REPO_CONFIGS / folder).glob("*.yaml"))
        parts.append(f"Shipped in `configs/{folder}/`: " + ", ".join(f"`{s}`" for s in shipped) + ".")
    if name == "plan":
        styles = " and ".join(f"`{style}`" for style in config.FRAMEWORK_STYLES)
        parts.append(f"Not used with styles {styles} (give the framework's own fields under the "
                     "key of the style's name): "
                     + ", ".join(f"`{key}`" for key in config._FRAMEWORK_ELSEWHERE) + ".")
    return "\n\n".join(parts)


def cross_checks(config: ModuleType) -> str:
    """The checks that read several fields at once: each `_check_*` function's docstring."""
    lines = []
    for name, fn in vars(config).items():
        if name.startswith("_check_") and name != "_check_keys" and inspect.isfunction(fn):
            text = " ".join(inspect.cleandoc(fn.__doc__ or "").split())
            for parameter in inspect.signature(fn).parameters:  # asides about the arguments
                text = re.sub(rf" \([^()]*`{parameter}`[^()]*\)", "", text)
            lines.append(f"- {text} (`{name}`)")
    intro = ("Besides each key's own check, `load_experiment` checks fields against each other; "
             "among those checks:")
    return f"## Checks across fields\n\n{intro}\n\n" + "\n".join(lines)


def describe_checker(checker: Callable[..., Any], annotation: str) -> str:
    """What a checker accepts: its name's entry, a choice's options, a parser's docstring."""
    if checker.__name__ in CHECKER_TEXT:
        return CHECKER_TEXT[checker.__name__]
    closure = inspect.getclosurevars(checker)
    if "options" in closure.nonlocals:
        return one_of(closure.nonlocals["options"])
    if "parse" in closure.nonlocals:
        return first_sentence(closure.nonlocals["parse"].__doc__ or "") or "mapping"
    named = [CHECKER_TEXT[name] for name in closure.globals if name in CHECKER_TEXT]
    if len(named) == 1 and "None" in annotation:
        return f"{named[0]} or `null`"
    return describe_annotation(annotation)


def describe_annotation(annotation: str) -> str:
    """A field's annotation in YAML words: `str | None` is "string or `null`"."""
    words = []
    for part in (part.strip() for part in annotation.split("|")):
        listed = re.fullmatch(r"tuple\[(\w+), \.\.\.\]", part)
        if listed:
            item = listed.group(1)
            words.append(f"list of {ANNOTATION_WORDS.get(item, item)}s")
        else:
            words.append(ANNOTATION_WORDS.get(part, f"`{part}`"))
    return " or ".join(words)


def default_text(field: dataclasses.Field) -> str:
    """A field's default as YAML spells it; required fields say so."""
    if field.default is dataclasses.MISSING:
        return "required"
    value = field.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return f"`{list(value)}`"
    return f"`{value}`"


def one_of(options: Any) -> str:
    return "one of " + ", ".join(f"`{option}`" for option in options)


def first_sentence(text: str) -> str:
    return " ".join(inspect.cleandoc(text).split("\n\n")[0].split())


def doc(cls: type) -> str:
    """A dataclass's docstring, its paragraphs joined into lines."""
    paragraphs = inspect.cleandoc(cls.__doc__ or "").split("\n\n")
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
