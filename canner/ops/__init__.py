"""What an operator sees: metrics, the status page and its charts, the verdict, readiness, the
inventory of a data directory, the manhole."""
