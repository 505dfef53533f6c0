"""``inferflow bench`` from a checkout: python tools/bench.py [offline|serving] [options] (see --help)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.bench.cli import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main())
