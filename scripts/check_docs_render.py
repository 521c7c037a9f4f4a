#!/usr/bin/env python3
"""Check that the built docs site renders: serve it on a local port, open pages in headless Chromium, screenshot them.

    python3 scripts/check_docs_render.py                        # build the site (mkdocs build --strict), then check
    python3 scripts/check_docs_render.py --site site --out shots # check an already built site; keep the PNGs

For each page (default: the home page and the serving guide) it fetches the HTML over HTTP and checks the status
and the <title>, then has Chromium (Debian's `chromium`, `--headless --screenshot`) render the page at 1280x900 and
checks the PNG is not blank (enough distinct colours: a blank or unstyled page has a handful). Exit status 0 when
every page passes, 1 with a message naming the page and the problem otherwise, 2 when a tool is missing.
"""

from __future__ import annotations

import argparse
import functools
import html
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT = 1280, 900
MIN_COLOURS = 64  # distinct colours a rendered page has at least (text antialiasing alone gives hundreds)
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# (path under the site, a string its <title> must contain, case-insensitive)
DEFAULT_PAGES = ("=verispec", "guides/serving/=serving")


class CheckError(Exception):
    pass


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


def build_site(out: Path) -> None:
    """`mkdocs build --strict` into `out` (the repository's mkdocs.yml)."""
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=ROOT)
    if done.returncode != 0:
        raise CheckError(f"mkdocs build --strict failed (exit status {done.returncode})")


def serve(site: Path) -> tuple[ThreadingHTTPServer, str]:
    """An HTTP server for `site` on a free loopback port, in a daemon thread; (server, base URL)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def find_browser(given: str | None) -> str:
    for name in (given,) if given else BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError(
        f"no headless browser found ({given or ', '.join(BROWSERS)}); on Debian: apt-get install -y chromium"
    )


def page_title(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        if r.status != 200:
            raise CheckError(f"{url}: HTTP {r.status}")
        text = r.read().decode("utf-8", "replace")
    m = re.search(r"<title>(.*?)</title>", text, re.S | re.I)
    if m is None:
        raise CheckError(f"{url}: the page has no <title>")
    return html.unescape(m.group(1)).strip()


def screenshot(browser: str, url: str, png: Path, profile: Path, timeout: float) -> None:
    cmd = [
        browser,
        "--headless",
        "--disable-gpu",
        "--no-sandbox",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--window-size={WIDTH},{HEIGHT}",
        "--virtual-time-budget=5000",  # let the theme's scripts run before the shot
        f"--screenshot={png}",
        url,
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise CheckError(f"{url}: the browser took over {timeout:.0f} s") from e
    if done.returncode != 0 or not png.is_file():
        raise CheckError(f"{url}: the browser failed (exit status {done.returncode}): {done.stderr.strip()[-2000:]}")


def colours(png: Path) -> tuple[tuple[int, int], int]:
    """(width, height) and the number of distinct RGB colours of a PNG (Pillow if installed, else matplotlib)."""
    try:
        from PIL import Image

        with Image.open(png) as im:
            rgb = im.convert("RGB")
            found = rgb.getcolors(maxcolors=WIDTH * HEIGHT * 4)
            return rgb.size, len(found) if found is not None else WIDTH * HEIGHT
    except ImportError:
        import matplotlib.image as mpimg
        import numpy as np

        a = mpimg.imread(png)[..., :3]
        a = (a * 255).astype(np.uint8) if a.dtype != np.uint8 else a
        return (a.shape[1], a.shape[0]), len(np.unique(a.reshape(-1, 3), axis=0))


def check_page(browser: str, base: str, path: str, want: str, out: Path, profile: Path, timeout: float) -> str:
    url = base + path
    title = page_title(url)
    if want.lower() not in title.lower():
        raise CheckError(f"{url}: title {title!r} does not contain {want!r}")
    png = out / ((path.strip("/").replace("/", "-") or "home") + ".png")
    screenshot(browser, url, png, profile, timeout)
    size, n = colours(png)
    if size != (WIDTH, HEIGHT):
        raise CheckError(f"{url}: the screenshot is {size[0]}x{size[1]}, expected {WIDTH}x{HEIGHT}")
    if n < MIN_COLOURS:
        raise CheckError(f"{url}: the screenshot looks blank ({n} distinct colours, expected >= {MIN_COLOURS}): {png}")
    return f"ok  {url}  title {title!r}  {png} ({n} colours)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", type=Path, help="an already built site (default: build one into a temporary folder)")
    ap.add_argument("--out", type=Path, help="folder for the screenshots (default: a temporary folder, kept)")
    ap.add_argument("--browser", help=f"the browser executable (default: the first of {', '.join(BROWSERS)})")
    ap.add_argument(
        "--page",
        action="append",
        metavar="PATH=TITLE",
        help="a page under the site and a string its title must contain (repeatable; default: "
        + ", ".join(repr(p) for p in DEFAULT_PAGES)
        + ")",
    )
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per screenshot (default 120)")
    args = ap.parse_args(argv)
    pages = [p.partition("=")[::2] for p in (args.page or DEFAULT_PAGES)]
    try:
        browser = find_browser(args.browser)
    except FileNotFoundError as e:
        print(f"check_docs_render: {e}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="verispec-docs-shots-"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="verispec-docs-") as tmp:
        try:
            site = args.site
            if site is None:
                site = Path(tmp) / "site"
                build_site(site)
            if not (site / "index.html").is_file():
                raise CheckError(f"{site} is not a built site (no index.html)")
            server, base = serve(site)
            try:
                for path, want in pages:
                    print(check_page(browser, base, path, want, out, Path(tmp) / "profile", args.timeout), flush=True)
            finally:
                server.shutdown()
                server.server_close()
        except CheckError as e:
            print(f"check_docs_render: FAIL: {e}", file=sys.stderr)
            return 1
    print(f"check_docs_render: {len(pages)} pages rendered; screenshots in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
