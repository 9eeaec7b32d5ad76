-- delivery.sqlite, version 3: megawarc packaging (issue 9).
-- An object of a megawarc project joins a batch (objects.batch_id); a batch becomes one package
-- (packages), built, sealed, verified locally, delivered as one IA item and verified there.
-- Three facts stay apart on a package row: its build (state), its delivery (delivery_state ...),
-- its local files (purged_at); and on an object, its source's purge (objects.purged_at).
ALTER TABLE objects ADD COLUMN batch_id INTEGER;       -- the batch it belongs to (megawarc)
ALTER TABLE objects ADD COLUMN packed_file TEXT;       -- suffix of the package file holding it
ALTER TABLE objects ADD COLUMN packed_offset INTEGER;  -- where its bytes start in that file
ALTER TABLE objects ADD COLUMN pack_rejected_at REAL;  -- its bytes did not match its receipt
CREATE INDEX objects_unbatched ON objects (project, accepted_at, object_id)
    WHERE batch_id IS NULL AND pack_rejected_at IS NULL;
CREATE INDEX objects_batch ON objects (batch_id) WHERE batch_id IS NOT NULL;
CREATE TABLE packages (
    batch_id            INTEGER PRIMARY KEY,
    project             TEXT NOT NULL,
    state               TEXT NOT NULL DEFAULT 'open'
                        CHECK (state IN ('open', 'closed', 'building', 'sealed', 'verified')),
    members             INTEGER NOT NULL DEFAULT 0,
    bytes               INTEGER NOT NULL DEFAULT 0,
    oldest_accepted_at  INTEGER,                -- receipt time of its oldest member
    opened_at           REAL NOT NULL,
    closed_at           REAL,
    close_reason        TEXT,                   -- 'size' or 'max_wait'
    package_id          TEXT UNIQUE,            -- derived from its members when built
    batch_date          TEXT,                   -- UTC YYYYMMDDhhmmss of its first member
    build_attempts      INTEGER NOT NULL DEFAULT 0,
    next_build_at       REAL NOT NULL DEFAULT 0,
    build_error         TEXT,
    sealed_at           REAL,                   -- every file durable, its index complete
    verified_at         REAL,                   -- every member re-read from it matched its receipt
    sources_purged_at   REAL,                   -- its members' uploads are deleted
    delivery_state      TEXT NOT NULL DEFAULT 'pending'
                        CHECK (delivery_state IN ('pending', 'delivering', 'retry_wait', 'delivered')),
    attempts            INTEGER NOT NULL DEFAULT 0,
    next_attempt_at     REAL NOT NULL DEFAULT 0,
    last_error          TEXT,
    needs_operator      INTEGER NOT NULL DEFAULT 0,
    remote_identifier   TEXT,
    delivered_at        REAL,
    remote_verified_at  REAL,                   -- every file listed by IA with its size and MD5
    next_check_at       REAL,
    purge_after         REAL,
    purged_at           REAL,                   -- the local package files are deleted
    updated_at          REAL NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX packages_open ON packages (project) WHERE state = 'open';
CREATE TABLE package_files (
    batch_id     INTEGER NOT NULL REFERENCES packages (batch_id),
    suffix       TEXT NOT NULL,   -- '.megawarc.warc.gz', '.<dict id>.megawarc.warc.zst', ...
    size_bytes   INTEGER NOT NULL,
    content_md5  TEXT,            -- set by the verification pass
    remote_name  TEXT,            -- set when delivered
    PRIMARY KEY (batch_id, suffix)
);
