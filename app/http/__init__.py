"""The HTTP edge: what a request meets before the use case and after it.

The connection's guards (``connections``, ``slow_clients``, ``shedding``), the ASGI entry and its
direct path for POST /translate (``entry``, ``direct``), bodies and their schemas (``body``,
``schemas``, ``uploads``), the dependencies a route declares (``deps``), one table from the use
case's errors to HTTP statuses (``errors``), and the routes themselves (``routes/``). Below this
room nothing imports FastAPI or Starlette's request types.
"""
