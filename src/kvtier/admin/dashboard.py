"""The dashboard page: static/dashboard.html with its CSS and JS inlined.

Everything the page needs is in one response, so the browser fetches nothing else (no CDN,
no second request that would need the bearer token); its script then polls the JSON API.
"""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def dashboard_html() -> bytes:
    static = resources.files("kvtier.admin") / "static"
    html = (static / "dashboard.html").read_text(encoding="utf-8")
    css = (static / "dashboard.css").read_text(encoding="utf-8")
    js = (static / "dashboard.js").read_text(encoding="utf-8")
    # The markers sit inside <style>/<script>; "</" in the assets would end those elements.
    assert "</style" not in css and "</script" not in js
    return html.replace("/*KVTIER_CSS*/", css).replace("/*KVTIER_JS*/", js).encode("utf-8")
