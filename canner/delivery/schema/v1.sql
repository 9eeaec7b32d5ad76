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
    next_attempt_at    REAL NOT NULL DEFAULT 0,   -- when the next delivery attempt is due
    last_error         TEXT,
    needs_operator     INTEGER NOT NULL DEFAULT 0, -- 1: the last error needs a human (403, ...)
    content_md5        TEXT,
    remote_identifier  TEXT,
    remote_name        TEXT,
    delivered_at       REAL,
    verified_at        REAL,
    purge_after        REAL,
    purged_at          REAL,
    next_check_at      REAL,                      -- when to verify remotely / purge next
    updated_at         REAL NOT NULL DEFAULT 0
);
CREATE INDEX objects_due ON objects (next_attempt_at) WHERE state IN ('pending', 'retry_wait');
CREATE INDEX objects_follow_up ON objects (next_check_at) WHERE state = 'delivered' AND purged_at IS NULL;
