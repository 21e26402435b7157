"""Terminology: glossary entries and placeholders found in a request's sentences (``match``), and
what /translate makes of them (``service``): constraints for the decoder, marks for the response."""
