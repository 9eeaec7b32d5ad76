"""Composition roots and process services: the two daemons' roots and parts, the receiver's
site, start-up checks, systemd."""
