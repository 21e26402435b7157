"""API keys and their limits: which keys the service accepts (``accepted``), what each has used
(``usage`` in SQLite, ``usage_redis`` in a Redis every replica shares), and the limits enforced
in one place for every route that takes a key (``limits``)."""
