"""Where the service keeps what outlives a request: the databases (``database``: SQLite on one
machine, PostgreSQL across replicas) and translated files waiting to be downloaded
(``downloads``). The jobs' own store lives with the jobs (``app.jobs``)."""
