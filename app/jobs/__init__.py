"""Document jobs: long documents translated in the background, their state kept on disk
(``store.py``), run by the front end's loop (``runner.py``)."""
