"""Switching from the Go canner (saveweb/canner): its config and its data directory."""
