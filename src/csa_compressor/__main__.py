"""``python -m csa_compressor``: the command line (csa_compressor.cli.main)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
