"""canner: the durable handoff between volunteer archiving workers and the Internet Archive."""
