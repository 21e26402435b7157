"""The worker's room of the serving side, in each model worker process: the process's entry
(``process.serve_worker``, started by name from ``app.serving.frontend.handle``), its ``inbox``,
the ``executor`` that runs continuous batches, and the ``models`` table it loads and evicts.
Nothing of HTTP: it hears the front end only through ``app.serving.protocol``'s messages."""
