"""umbp bench ssd restricted to some object sizes: ab15.py <KiB,KiB,...> <out.json> (old/new code by PYTHONPATH)."""
import sys

from umbp.tools import bench_ssd

bench_ssd.SIZES = tuple(int(k) * 1024 for k in sys.argv[1].split(","))
from umbp.cli import main  # noqa: E402

sys.exit(main(["bench", "ssd", "--dir", "/tmp/umbp-ssd", "--out", sys.argv[2]]))
