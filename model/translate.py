"""``python -m model.translate``: the command-line translator (``model.decoding.cli``)."""

import sys

from model.decoding.cli import main

if __name__ == "__main__":
    sys.exit(main())
