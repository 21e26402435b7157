"""What operators watch: every Prometheus metric of the service (``metrics``) and the event loop's
lag and what held it (``loop``)."""
