"""Lexical constraints: target token sequences every finished hypothesis must contain (torch-free:
the front end imports it to count a constrained input's rows)."""

from __future__ import annotations


def beam_for(beam_size: int, n_constraints: int) -> int:
    """The beam an input with ``n_constraints`` constraints decodes with: its own without any;
    with some, at least one beam per number of constraints met so far (0..n), so that dynamic beam
    allocation keeps a hypothesis for each (greedy requests with constraints fall back to the
    smallest beam that honours them)."""
    return beam_size if n_constraints == 0 else max(beam_size, n_constraints + 1)
