"""canner.templates: the one reading of ``{name}`` templates, and its config errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from canner import templates
from canner.config import ConfigError, check_template
from canner.templates import TemplateError

NAMES = ("project", "object_id", "filename", "date")
# Literal text, braces included: expand must give them back as they are.
LITERAL = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
PIECE = st.one_of(
    LITERAL.map(lambda text: ("literal", text)), st.sampled_from(NAMES).map(lambda n: ("field", n))
)
VALUE = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)


def _template(pieces: list[tuple[str, str]]) -> str:
    """The template of ``pieces``: literal braces doubled, fields as ``{name}``."""
    return "".join(
        text.replace("{", "{{").replace("}", "}}") if kind == "literal" else "{" + text + "}"
        for kind, text in pieces
    )


@given(st.lists(PIECE, max_size=8), st.fixed_dictionaries({n: VALUE for n in NAMES}))
def test_expand_puts_each_value_in_its_field(
    pieces: list[tuple[str, str]], values: dict[str, str]
) -> None:
    """A template built from literal text and fields expands to the text and the values, in
    order; its fields are those it names, which check accepts."""
    template = _template(pieces)
    expected = "".join(text if kind == "literal" else values[text] for kind, text in pieces)
    assert templates.expand(template, values) == expected
    used = {text for kind, text in pieces if kind == "field"}
    assert templates.fields(template) == used
    assert templates.check(template, NAMES) == used


def test_expand_rejects_format_specs_and_unknown_names() -> None:
    """Templates are plain {name} placeholders; {{ and }} are literal braces."""
    values = {"project": "p", "object_id": "o", "filename": "f", "date": "d"}
    assert templates.expand("{{x}}-{project}", values) == "{x}-p"
    for bad in ("{object_id:>40}", "{object_id!r}", "{nope}", "{object_id", "{0}", "{}"):
        with pytest.raises(ValueError):
            templates.expand(bad, values)


@given(st.lists(PIECE, max_size=6), st.sampled_from(["{", "}", "a{b", "}x", "{project", "x}y"]))
def test_unbalanced_braces_are_refused(pieces: list[tuple[str, str]], broken: str) -> None:
    """A single brace anywhere makes the template unreadable: fields, check and expand refuse it."""
    template = _template(pieces) + broken
    values = dict.fromkeys(NAMES, "v")
    for read in (
        lambda: templates.fields(template),
        lambda: templates.check(template, NAMES),
        lambda: templates.expand(template, values),
    ):
        with pytest.raises(TemplateError):
            read()


@given(st.lists(PIECE, max_size=6), st.text("abcdefghij_", min_size=1, max_size=8))
def test_check_refuses_a_field_the_setting_lacks(pieces: list[tuple[str, str]], name: str) -> None:
    """An unknown field is refused, named, with the fields the setting offers."""
    template = _template(pieces) + "{" + name + "}"
    if name in NAMES:
        assert name in templates.check(template, NAMES)
        return
    with pytest.raises(TemplateError) as refused:
        templates.check(template, NAMES)
    assert str(refused.value) == (
        f"unknown placeholder {{{name}}} (known: {{project}} {{object_id}} {{filename}} {{date}})"
    )


def test_a_spec_or_conversion_is_refused() -> None:
    for template in ("{date:%Y}", "{date!s}", "x-{date!r:>9}"):
        with pytest.raises(TemplateError) as refused:
            templates.fields(template)
        assert str(refused.value) == "placeholder {date} takes no format spec or conversion"


def test_the_config_names_the_key() -> None:
    """check_template is check with a ConfigError naming the setting."""
    assert check_template("canner-{node}-{period}", ("node", "period"), "ledger.identifier") == {
        "node",
        "period",
    }
    for template in ("{object_id}", "{period", "{period:x}"):
        with pytest.raises(ConfigError) as refused:
            check_template(template, ("node", "period"), "ledger.identifier")
        assert refused.value.key == "ledger.identifier"
    assert str(refused.value) == (
        "config key 'ledger.identifier': placeholder {period} takes no format spec or conversion"
    )
