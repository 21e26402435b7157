"""The models the service serves, as the front end knows them: fetched by name at start
(``fetched``), read from their directories without their weights (``served``), and their decoding
steps compiled before the service starts (``precompile``). The weights live in the workers
(``app.serving.worker``)."""
