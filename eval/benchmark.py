"""The side-by-side decoding benchmark (speed, CRR, exactness, quality); same as `streamspec eval`.

    python eval/benchmark.py --checkpoint runs/smollm2-sql/final --task sql \
        --baseline runs/smollm2-sql-next-token/final --limit 30 --sweep 1 2 3 --out runs/benchmark-sql

The logic lives in `streamspec.evaluation.benchmark`; this file only parses the command line.
"""

import sys

from streamspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
