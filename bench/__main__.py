"""`make bench`: every benchmark of the project, each writing its results under bench/results/."""

from __future__ import annotations

import sys

from bench import simulate_averaging


def main() -> int:
    return simulate_averaging.main(["--scale", "1000"])


if __name__ == "__main__":
    sys.exit(main())
