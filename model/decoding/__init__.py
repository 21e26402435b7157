"""What decoding decides: options, the choice of tokens, the running batch, the Translator, the CLI.

Import the modules themselves (``model.decoding.options`` is torch-free, for the front end)."""
