"""Every test may parse a config: the sinks it names are registered on import."""

import canner.sinks.registry  # noqa: F401
