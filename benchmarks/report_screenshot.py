"""The report as a reader sees it: `pflbed report` on the given runs, then a full-page screenshot of the HTML in
headless Chromium (Debian's `chromium` package), to look at. Prints the report's size and the time to write it.

    python benchmarks/report_screenshot.py RUN [RUN ...] --out DIR [--height 5200] [--name report]

Chromium's command line cannot size the window to the page, so the shot is taken `--height` tall and the blank
rows below the page's end are cut off (a page taller than `--height` is cut at it: raise it).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from pflbed.results.report import write_report

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--hide-scrollbars",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--height", type=int, default=5200, help="screenshot height in pixels (width 1280)")
    ap.add_argument("--name", default="report", help="file names: NAME.html and NAME.png in --out")
    a = ap.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("needs Chromium: apt-get install chromium")
    t0 = time.perf_counter()
    page = write_report(a.runs, a.out / f"{a.name}.html")
    took = time.perf_counter() - t0
    shot = a.out / f"{a.name}.png"
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", f"--window-size=1280,{a.height}",
                        f"--screenshot={shot}", page.resolve().as_uri()], check=True, capture_output=True)  # fmt: skip
    _trim(shot)
    print(f"report {page}: {page.stat().st_size / 1024:.0f} KiB, written in {took:.1f} s; screenshot {shot}")


def _trim(png: Path, margin: int = 40) -> None:
    """Cut the white rows below the last non-white one, keeping `margin` of them."""
    from PIL import Image, ImageChops

    with Image.open(png) as im:
        rgb = im.convert("RGB")
    box = ImageChops.difference(rgb, Image.new("RGB", rgb.size, "white")).getbbox()
    if box is not None and box[3] + margin < rgb.height:
        rgb.crop((0, 0, rgb.width, box[3] + margin)).save(png, optimize=True)


if __name__ == "__main__":
    main()
