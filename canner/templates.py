"""``{name}`` templates (pure): the one reading of every template a config holds.

A template is literal text and ``{name}`` fields; ``{{`` and ``}}`` are literal braces.  A
field is a bare name: no format spec, no conversion.  :func:`fields` reads a template,
:func:`check` also refuses fields its setting does not offer, :func:`expand` fills it in.
Each raises :class:`TemplateError` (a ``ValueError``) saying what is wrong; the config turns it
into an error naming the key (:func:`canner.config.check_template`).
"""

from __future__ import annotations

import string
from collections.abc import Collection, Mapping


class TemplateError(ValueError):
    """A template that cannot be read or filled in; ``str()`` says why."""


def _parts(template: str) -> list[tuple[str, str | None]]:
    """The template as (literal, field) pairs, in order (the field None after the last)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:  # unbalanced braces
        raise TemplateError(str(e)) from None
    for _, name, spec, conversion in parsed:
        if name is not None and (spec or conversion):
            raise TemplateError(f"placeholder {{{name}}} takes no format spec or conversion")
    return [(literal, name) for literal, name, _, _ in parsed]


def fields(template: str) -> frozenset[str]:
    """The field names ``template`` uses; :class:`TemplateError` if it is malformed."""
    return frozenset(name for _, name in _parts(template) if name is not None)


def check(template: str, allowed: Collection[str]) -> frozenset[str]:
    """The fields of ``template``, all of which ``allowed`` must hold (its order is the order
    the error lists them in); :class:`TemplateError` for a malformed template or another field."""
    used = fields(template)
    unknown = sorted(used - set(allowed))
    if unknown:
        known = " ".join(f"{{{name}}}" for name in allowed)
        raise TemplateError(f"unknown placeholder {{{unknown[0]}}} (known: {known})")
    return used


def expand(template: str, values: Mapping[str, str]) -> str:
    """``template`` with each field replaced by its value; :class:`TemplateError` for a
    malformed template or a field ``values`` has no value for."""
    check(template, values.keys())
    return "".join(
        literal + (values[name] if name is not None else "") for literal, name in _parts(template)
    )
