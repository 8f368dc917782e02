"""Reading the SVG charts the views save: the elements a test asserts on, parsed as XML."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import List

NS = "{http://www.w3.org/2000/svg}"


def charts(page: str) -> List[ET.Element]:
    """Every ``<svg class="nbs-chart ...">`` element of an HTML fragment, parsed."""
    return [ET.fromstring(m.group(0)) for m in re.finditer(r"<svg .*?</svg>", page, re.S) if "nbs-chart" in m.group(0)]


def marks(chart: ET.Element, tag: str, css_class: str = "") -> List[ET.Element]:
    """The chart's ``tag`` elements (``rect``, ``text``, ``polyline``...), of ``css_class`` if given."""
    return [e for e in chart.iter(f"{NS}{tag}") if not css_class or e.get("class") == css_class]


def hint(element: ET.Element) -> str:
    """A mark's tooltip (its ``<title>``)."""
    title = element.find(f"{NS}title")
    return title.text if title is not None else ""


def texts(chart: ET.Element) -> List[str]:
    return [e.text for e in marks(chart, "text")]
