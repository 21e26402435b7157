"""``python -m model.export_ctranslate2``: export to CTranslate2 (``model.convert.ctranslate2``)."""

import sys

from model.convert.ctranslate2 import QUANTIZATIONS, build_spec, export, main

__all__ = ["QUANTIZATIONS", "build_spec", "export", "main"]

if __name__ == "__main__":
    sys.exit(main())
