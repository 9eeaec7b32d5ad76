-- delivery.sqlite, version 4: HQ release and the ledger (issue 10).  Only adds; it applies on
-- top of version 2 or 3 alike.
-- released_at: HQ no longer references the receipt (a fact of its own, beside delivery and the
-- local payload; its durable copy is in the facts journal, journal/).  ledger_id: the ledger this
-- object's record was assigned to (set once, in the transaction that creates the ledger).
ALTER TABLE objects ADD COLUMN released_at REAL;
ALTER TABLE objects ADD COLUMN ledger_id INTEGER;
CREATE INDEX objects_archivable ON objects (released_at)
    WHERE released_at IS NOT NULL AND ledger_id IS NULL;
CREATE INDEX objects_ledger ON objects (ledger_id, object_id) WHERE ledger_id IS NOT NULL;
-- One row per ledger file ledger/<name>.jsonl.zst.  state only moves forward:
-- writing -> written -> uploaded -> verified -> deleting -> done; a remote copy that does not
-- verify goes back to written (re-upload) with needs_operator set.
CREATE TABLE ledgers (
    ledger_id      INTEGER PRIMARY KEY,
    name           TEXT NOT NULL UNIQUE,
    period         TEXT NOT NULL,
    state          TEXT NOT NULL DEFAULT 'writing'
                   CHECK (state IN ('writing', 'written', 'uploaded', 'verified', 'deleting',
                                    'done')),
    records        INTEGER NOT NULL DEFAULT 0,
    bytes          INTEGER,
    md5            TEXT,
    blake3         TEXT,
    identifier     TEXT,
    remote_name    TEXT,
    created_at     REAL NOT NULL,
    written_at     REAL,
    uploaded_at    REAL,
    verified_at    REAL,
    done_at        REAL,
    attempts       INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL DEFAULT 0,
    last_error     TEXT,
    needs_operator INTEGER NOT NULL DEFAULT 0
);
-- canner ledger flush: archive everything past delay now (the deliver process answers it).
CREATE TABLE ledger_flush (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    requested_at  REAL NOT NULL,
    handled_at    REAL
);
