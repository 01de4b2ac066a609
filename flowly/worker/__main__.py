"""``python -m flowly.worker --app module[:attr] ...``: the same as ``flowly worker``."""

import sys

from ..cli import main

if __name__ == "__main__":
    raise SystemExit(main(["worker", *sys.argv[1:]]))
