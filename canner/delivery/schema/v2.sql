-- delivery.sqlite, version 2: what operators watch (issue 12).
-- canner-deliver's heartbeat and the attempts it has in flight (one row, rewritten every few
-- seconds); a history of delivery attempts; per-minute samples for the status page's 24 h trends.
CREATE TABLE deliver_heartbeat (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    pid         INTEGER NOT NULL,
    version     TEXT NOT NULL,
    started_at  REAL NOT NULL,
    beat_at     REAL NOT NULL,
    stopped_at  REAL,                      -- set by a clean shutdown
    in_flight   TEXT NOT NULL DEFAULT '[]' -- JSON list of attempts in flight
);
CREATE TABLE attempts (
    object_id   TEXT NOT NULL,
    attempt     INTEGER NOT NULL,
    started_at  REAL NOT NULL,
    ended_at    REAL NOT NULL,
    outcome     TEXT NOT NULL CHECK (outcome IN ('delivered', 'failed')),
    error       TEXT,
    PRIMARY KEY (object_id, attempt)
);
CREATE TABLE trends (
    minute           INTEGER NOT NULL,     -- unix time // 60
    project          TEXT NOT NULL,        -- '' for all projects together
    accepted_bytes   INTEGER NOT NULL,     -- cumulative: bytes of objects in the index
    delivered_bytes  INTEGER NOT NULL,     -- cumulative: bytes of delivered objects
    pending_bytes    INTEGER NOT NULL,
    pending_objects  INTEGER NOT NULL,
    free_bytes       INTEGER,              -- only on the '' row
    PRIMARY KEY (minute, project)
);
