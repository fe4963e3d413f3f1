"""Copy the latest run (``results/latest.md``) into README.md and benchmarks/README.md, between
the ``<!-- bench:latest -->`` and ``<!-- /bench:latest -->`` markers.

    python -m benchmarks.publish
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- bench:latest -->", "<!-- /bench:latest -->"


def publish(md: str, target: Path, plots_prefix: str) -> None:
    text = target.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{target}: markers {START} ... {END} not found")
    table = md.replace("### ferrum-service benchmarks", "#### ferrum-service benchmarks")
    plots = " ".join(f"![{n}]({plots_prefix}{n}.png)" for n in ("throughput", "latency", "targets", "rss"))
    block = f"{START}\n{table}\n{plots}\n{END}"
    target.write_text(re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S))


def main() -> int:
    md = (ROOT / "benchmarks" / "results" / "latest.md").read_text()
    publish(md, ROOT / "README.md", "benchmarks/results/")
    publish(md, ROOT / "benchmarks" / "README.md", "results/")
    print("published results/latest.md into README.md and benchmarks/README.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
