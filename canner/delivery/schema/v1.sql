-- delivery.sqlite, version 1: one row per accepted object.
-- The receipts directory is the source of truth; this index can be rebuilt from it.
CREATE TABLE objects (
    object_id          TEXT PRIMARY KEY,
    project            TEXT NOT NULL,
    filename           TEXT,
    size_bytes         INTEGER NOT NULL CHECK (size_bytes >= 1),
    checksum           TEXT NOT NULL,
    accepted_at        INTEGER NOT NULL,
    state              TEXT NOT NULL DEFAULT 'pending'
                       CHECK (state IN ('pending', 'delivering', 'retry_wait', 'delivered')),
    attempts           INTEGER NOT NULL DEFAULT 0,
    next_attempt_at    REAL NOT NULL DEFAULT 0,
    last_error         TEXT,
    needs_operator     INTEGER NOT NULL DEFAULT 0,
    content_md5        TEXT,
    remote_identifier  TEXT,
    remote_name        TEXT,
    delivered_at       REAL,
    verified_at        REAL,
    purge_after        REAL,
    purged_at          REAL,
    updated_at         REAL NOT NULL DEFAULT 0
);
CREATE INDEX objects_due ON objects (state, next_attempt_at);
CREATE INDEX objects_purge ON objects (purged_at, purge_after) WHERE state = 'delivered';
