"""Sample documents of each format, generated with the format's own library, and a check that a
translated copy kept each one's structure (tests/test_document_formats.py runs every sample
through the service)."""
