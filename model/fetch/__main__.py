"""``python -m model.fetch NAME... [--into DIR]``."""

import sys

from model.fetch import main

sys.exit(main())
