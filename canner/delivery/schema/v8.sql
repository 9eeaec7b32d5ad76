-- delivery.sqlite, version 8: one outbound row per thing that leaves the node (issue 24).
-- Objects, megawarc packages and ledgers each kept their own delivery columns; they move here,
-- every row kept, and the owners' tables keep only what their owner decides: an object's
-- payload (purge_after, purged_at), a package's build and files, a ledger's write and delete.
-- ref is the owner's key (object_id; batch_id or ledger_id as text); project says which sink
-- sends it ('' for a ledger).  next_check_at: the next verification, or the owner's delete
-- after it; NULL once the owner has nothing left to do with the row.
CREATE TABLE outbound (
    kind               TEXT NOT NULL CHECK (kind IN ('object', 'package', 'ledger')),
    ref                TEXT NOT NULL,
    project            TEXT NOT NULL,
    state              TEXT NOT NULL DEFAULT 'pending'
                       CHECK (state IN ('pending', 'delivering', 'retry_wait', 'delivered')),
    attempts           INTEGER NOT NULL DEFAULT 0,
    next_attempt_at    REAL NOT NULL DEFAULT 0,
    last_error         TEXT,
    needs_operator     INTEGER NOT NULL DEFAULT 0,
    redeliveries       INTEGER NOT NULL DEFAULT 0,
    force_upload       INTEGER NOT NULL DEFAULT 0,
    remote_identifier  TEXT,
    delivered_at       REAL,
    verified_at        REAL,
    next_check_at      REAL,
    updated_at         REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (kind, ref)
);
CREATE INDEX outbound_due ON outbound (kind, next_attempt_at)
    WHERE state IN ('pending', 'retry_wait');
CREATE INDEX outbound_follow_up ON outbound (kind, next_check_at)
    WHERE state = 'delivered' AND next_check_at IS NOT NULL;
CREATE INDEX outbound_flagged ON outbound (kind, ref) WHERE needs_operator != 0;

-- Objects: every row has its outbound row (a purged one has nothing left to check).
INSERT INTO outbound (kind, ref, project, state, attempts, next_attempt_at, last_error,
                      needs_operator, redeliveries, force_upload, remote_identifier,
                      delivered_at, verified_at, next_check_at, updated_at)
    SELECT 'object', object_id, project, state, attempts, next_attempt_at, last_error,
           needs_operator, redeliveries, force_upload, remote_identifier, delivered_at,
           verified_at, CASE WHEN purged_at IS NULL THEN next_check_at END, updated_at
    FROM objects;
DROP INDEX objects_due;
DROP INDEX objects_follow_up;
ALTER TABLE objects DROP COLUMN state;
ALTER TABLE objects DROP COLUMN attempts;
ALTER TABLE objects DROP COLUMN next_attempt_at;
ALTER TABLE objects DROP COLUMN last_error;
ALTER TABLE objects DROP COLUMN needs_operator;
ALTER TABLE objects DROP COLUMN redeliveries;
ALTER TABLE objects DROP COLUMN force_upload;
ALTER TABLE objects DROP COLUMN remote_identifier;
ALTER TABLE objects DROP COLUMN delivered_at;
ALTER TABLE objects DROP COLUMN verified_at;
ALTER TABLE objects DROP COLUMN next_check_at;

-- Packages: an outbound row from the moment the package is verified locally (ready to send).
INSERT INTO outbound (kind, ref, project, state, attempts, next_attempt_at, last_error,
                      needs_operator, redeliveries, force_upload, remote_identifier,
                      delivered_at, verified_at, next_check_at, updated_at)
    SELECT 'package', CAST(batch_id AS TEXT), project, delivery_state, attempts,
           next_attempt_at, last_error, needs_operator, redeliveries, force_upload,
           remote_identifier, delivered_at, remote_verified_at,
           CASE WHEN purged_at IS NULL THEN next_check_at END, updated_at
    FROM packages WHERE state = 'verified';
ALTER TABLE packages DROP COLUMN delivery_state;
ALTER TABLE packages DROP COLUMN attempts;
ALTER TABLE packages DROP COLUMN next_attempt_at;
ALTER TABLE packages DROP COLUMN last_error;
ALTER TABLE packages DROP COLUMN needs_operator;
ALTER TABLE packages DROP COLUMN redeliveries;
ALTER TABLE packages DROP COLUMN force_upload;
ALTER TABLE packages DROP COLUMN remote_identifier;
ALTER TABLE packages DROP COLUMN delivered_at;
ALTER TABLE packages DROP COLUMN remote_verified_at;
ALTER TABLE packages DROP COLUMN next_check_at;

-- Ledgers: an outbound row from 'written' on.  'uploaded' and 'verified' were delivery states:
-- such a ledger is 'written' now, its outbound row delivered (verified_at kept, checked
-- again, as the old 'verified' state did).  The ledger's own attempts, next_attempt_at,
-- last_error and needs_operator stay for its own steps (writing, deleting).
INSERT INTO outbound (kind, ref, project, state, attempts, next_attempt_at, last_error,
                      needs_operator, force_upload, remote_identifier, delivered_at,
                      verified_at, next_check_at, updated_at)
    SELECT 'ledger', CAST(ledger_id AS TEXT), '',
           CASE WHEN state = 'written' AND attempts = 0 THEN 'pending'
                WHEN state = 'written' THEN 'retry_wait'
                ELSE 'delivered' END,
           attempts, next_attempt_at, last_error, needs_operator, force_upload,
           CASE WHEN state != 'written' THEN identifier END,
           CASE WHEN state != 'written' THEN coalesce(uploaded_at, written_at, created_at) END,
           CASE WHEN state IN ('deleting', 'done') THEN verified_at END,
           CASE WHEN state IN ('uploaded', 'verified') THEN next_attempt_at END,
           coalesce(done_at, verified_at, uploaded_at, written_at, created_at)
    FROM ledgers WHERE state != 'writing';
UPDATE ledgers SET attempts = 0, next_attempt_at = 0, last_error = NULL, needs_operator = 0
    WHERE state IN ('written', 'uploaded', 'verified');
UPDATE ledgers SET state = 'written' WHERE state IN ('uploaded', 'verified');
ALTER TABLE ledgers DROP COLUMN uploaded_at;
ALTER TABLE ledgers DROP COLUMN verified_at;
ALTER TABLE ledgers DROP COLUMN force_upload;

-- What readers see: each owner's row with its delivery facts, under the names they had.
CREATE VIEW object_delivery AS
    SELECT o.object_id, o.project, o.filename, o.size_bytes, o.checksum, o.accepted_at,
           d.state, d.attempts, d.next_attempt_at, d.last_error, d.needs_operator,
           o.content_md5, d.remote_identifier, o.remote_name, d.delivered_at, d.verified_at,
           o.purge_after, o.purged_at, d.next_check_at,
           max(o.updated_at, d.updated_at) AS updated_at, d.redeliveries, d.force_upload,
           o.released_at, o.batch_id, o.packed_file, o.packed_offset, o.pack_rejected_at,
           o.ledger_id, o.downloader
    FROM objects o JOIN outbound d ON d.kind = 'object' AND d.ref = o.object_id;
CREATE VIEW package_delivery AS
    SELECT p.batch_id, p.project, p.state, p.members, p.bytes, p.oldest_accepted_at,
           p.opened_at, p.closed_at, p.close_reason, p.package_id, p.batch_date,
           p.build_attempts, p.next_build_at, p.build_error, p.sealed_at, p.verified_at,
           p.sources_purged_at, coalesce(d.state, 'pending') AS delivery_state,
           coalesce(d.attempts, 0) AS attempts, coalesce(d.next_attempt_at, 0) AS next_attempt_at,
           d.last_error, coalesce(d.needs_operator, 0) AS needs_operator, d.remote_identifier,
           d.delivered_at, d.verified_at AS remote_verified_at, d.next_check_at, p.purge_after,
           p.purged_at, max(p.updated_at, coalesce(d.updated_at, 0)) AS updated_at,
           coalesce(d.redeliveries, 0) AS redeliveries, coalesce(d.force_upload, 0) AS force_upload
    FROM packages p LEFT JOIN outbound d ON d.kind = 'package' AND d.ref = CAST(p.batch_id AS TEXT);
