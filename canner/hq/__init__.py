"""HQ's API on the receiver: status, release, lookup by origin, objects."""
