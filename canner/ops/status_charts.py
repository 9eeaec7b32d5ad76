"""The status page's trend charts: inline SVG, drawn on the server (the page has no script)."""

from __future__ import annotations

from attrs import frozen
from twisted.web.template import Tag, tags

from canner.ops.humane import human_bytes
from canner.ops.trends import WINDOW

CHART_W, CHART_H, CHART_PAD = 420, 110, 16


@frozen
class Line:
    """One series of a chart: label, colour and (time, value) points."""

    label: str
    colour: str
    points: tuple[tuple[float, float], ...]
    dashed: bool = False


def _svg(name: str, **attrs: str) -> Tag:
    return Tag(name)(**attrs)


def _scale_text(value: float, unit: str) -> str:
    if unit == "bytes":
        return human_bytes(int(value))
    return f"{value:,.0f}"


def trend_chart(
    chart_id: str, title: str, lines: list[Line], now: float, unit: str = "bytes"
) -> Tag:
    """A figure with an inline SVG of ``lines`` over the last 24 hours (pure).

    The SVG says how many points it draws (``data-points``), so a test can tell an empty chart
    from a drawn one; a chart without points says "no samples yet"."""
    start = now - WINDOW
    top = max((v for line in lines for _, v in line.points), default=0.0)
    top = top * 1.1 if top > 0 else 1.0
    inner_w, inner_h = CHART_W - 2 * CHART_PAD, CHART_H - 2 * CHART_PAD
    svg = _svg(
        "svg",
        xmlns="http://www.w3.org/2000/svg",
        width=str(CHART_W),
        height=str(CHART_H),
        viewBox=f"0 0 {CHART_W} {CHART_H}",
        role="img",
        **{"aria-label": title},
    )
    svg(
        _svg(
            "rect",
            x=str(CHART_PAD),
            y=str(CHART_PAD),
            width=str(inner_w),
            height=str(inner_h),
            fill="#fcfcfc",
            stroke="#ddd",
        )
    )
    drawn = 0
    for line in lines:
        coords = []
        for t, v in line.points:
            if t < start or t > now + 60:
                continue
            x = CHART_PAD + inner_w * (t - start) / WINDOW
            y = CHART_PAD + inner_h * (1 - v / top)
            coords.append(f"{x:.1f},{y:.1f}")
        drawn += len(coords)
        if not coords:
            continue
        if len(coords) == 1:
            cx, cy = coords[0].split(",")
            svg(
                _svg("circle", cx=cx, cy=cy, r="2", fill=line.colour, **{"data-series": line.label})
            )
            continue
        attrs = {
            "points": " ".join(coords),
            "fill": "none",
            "stroke": line.colour,
            "stroke-width": "1.5",
            "data-series": line.label,
        }
        if line.dashed:
            attrs["stroke-dasharray"] = "4 3"
        svg(_svg("polyline", **attrs))
    svg(_svg("text", x=str(CHART_PAD + 2), y=str(CHART_PAD - 4))(_scale_text(top, unit)))
    svg(_svg("text", x=str(CHART_PAD), y=str(CHART_H - 3))("24 h ago"))
    svg(_svg("text", x=str(CHART_W - CHART_PAD - 22), y=str(CHART_H - 3))("now"))
    if drawn == 0:
        svg(_svg("text", x=str(CHART_W // 2 - 40), y=str(CHART_H // 2))("no samples yet"))
    svg.attributes["data-points"] = str(drawn)
    keys: list[Tag | str] = []
    for line in lines:
        keys += [tags.span(class_="key", style=f"background:{line.colour}"), line.label]
    return tags.figure(svg, tags.figcaption(tags.b(title), *keys), id=chart_id)
