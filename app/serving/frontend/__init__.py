"""The front end's room of the serving side, in the HTTP process: the language ``Router``, the
``Scheduler`` and its ``placement`` state, a worker process's ``handle``, and the ``pipeline``
that chains two hops through English. No torch: it reaches the workers only through
``app.serving.protocol``'s messages."""
