"""The receiver's HTTP seam, door-neutral: the connection and its body streams, routing (decided
once), the one answer renderer, connection caps."""
