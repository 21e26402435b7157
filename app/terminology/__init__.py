"""Terminology: glossary entries and placeholders found in a request's sentences (``match``) and
what /translate makes of them (``service``: constraints for the decoder, marks for the response);
each API key's stored glossaries (``glossaries``) and translation memory (``memory``); the bounded
cache of recent sentence translations (``cache``); which sentences each answers (``precedence``)."""
