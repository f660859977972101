"""Look at the built site as a reader would: every page in a real browser, no code block cut.

Serves the built site (`mkdocs build` output, default `site/`) on the loopback interface,
opens every page in Chromium through Playwright (Debian's `/usr/bin/chromium`, or
`$CHROMIUM`), at a laptop's width and at a narrow one, and fails if a code block or an
`explain` output overflows its column (its `scrollWidth` beyond its `clientWidth`: the
reader would have to scroll sideways, or a printed line is cut). A full-page screenshot of
each failing view is written to a temporary folder named in the log, never into the
repository (one of every view took most of the check's minute).

    python .ci/browser_check.py [SITE_DIR]
"""

from __future__ import annotations

import functools
import http.server
import os
import pathlib
import sys
import tempfile
import threading

from playwright.sync_api import sync_playwright

SITE = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "site").resolve()
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
# A laptop and a desktop screen.
WIDTHS = (1280, 1600)
# Chromium's own network activity is refused on a closed network: turn it off.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

OVERFLOWING = """
() => [...document.querySelectorAll('.md-content pre, .md-content pre > code')]
  .filter(e => e.scrollWidth > e.clientWidth + 1)
  .map(e => ({
    width: e.clientWidth,
    needed: e.scrollWidth,
    line: (e.innerText.split('\\n').reduce((a, b) => (b.length > a.length ? b : a), '')).slice(0, 140),
  }))
"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # (one line a request would bury the findings)
        pass


def pages() -> list[str]:
    found = []
    for index in sorted(SITE.rglob("index.html")):
        rel = index.relative_to(SITE).parent.as_posix()
        if rel.startswith(("assets", "search")):
            continue
        found.append("" if rel == "." else rel + "/")
    return found


def main() -> int:
    if not (SITE / "index.html").exists():
        sys.exit(f"browser check: no built site at {SITE} (run `mkdocs build` first)")
    if not pathlib.Path(CHROMIUM).exists():
        sys.exit(f"browser check: no Chromium at {CHROMIUM} (apt-get install chromium, or set $CHROMIUM)")
    handler = functools.partial(_Quiet, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    shots = pathlib.Path(tempfile.mkdtemp(prefix="deferax-site-"))
    print(f"screenshots of the failing views go to {shots}")
    failures = 0
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            for width in WIDTHS:
                page = browser.new_page(viewport={"width": width, "height": 900})
                for path in pages():
                    response = page.goto(base + path)
                    if response is None or not response.ok:
                        print(f"FAIL {path or '/'} at {width}px: HTTP {response.status if response else '?'}")
                        failures += 1
                        continue
                    bad = page.evaluate(OVERFLOWING)
                    if bad:
                        name = (path.strip("/").replace("/", "-") or "home") + f"-{width}.png"
                        page.screenshot(path=str(shots / name), full_page=True)
                    status = "ok  " if not bad else "FAIL"
                    print(f"{status} {path or '/'} at {width}px: {len(bad)} overflowing block(s)")
                    for b in bad:
                        print(f"     {b['needed']}px needed in {b['width']}px: {b['line']!r}")
                    failures += bool(bad)
                page.close()
            browser.close()
    finally:
        server.shutdown()
    if failures:
        print(f"browser check: {failures} page view(s) with overflowing code blocks (screenshots in {shots})")
        return 1
    print(f"browser check: every page at {', '.join(f'{w}px' for w in WIDTHS)}, no code block overflows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
