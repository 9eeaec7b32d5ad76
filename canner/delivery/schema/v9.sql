-- delivery.sqlite, version 9: what is at rest costs nothing per tick (issue 37).  Only adds; the
-- whole step is one transaction (upgrade_schema), so a kill during it leaves version 8 intact
-- and the next start applies it again.
--
-- The rows left 'delivering' by an interrupted attempt, found without reading every row: at
-- start-up (reset_delivering) and every minute (release_orphans).
CREATE INDEX outbound_delivering ON outbound (kind, ref) WHERE state = 'delivering';

-- The counts of object_delivery per project and delivery state, kept up to date by the
-- triggers below in the transaction of every change, so the trend sample each minute and the
-- survey behind the status page, the metrics and `canner status` read a few rows instead of
-- every object: objects (rows of the view), their bytes, and the sum of their needs_operator.
-- A count that drops to zero keeps its row at zero (readers skip those, as a GROUP BY over the
-- view would).
CREATE TABLE object_states (
    project    TEXT NOT NULL,
    state      TEXT NOT NULL,
    objects    INTEGER NOT NULL DEFAULT 0,
    bytes      INTEGER NOT NULL DEFAULT 0,
    flagged    INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (project, state)
) WITHOUT ROWID;
INSERT INTO object_states (project, state, objects, bytes, flagged)
    SELECT project, state, count(*), coalesce(sum(size_bytes), 0), coalesce(sum(needs_operator), 0)
    FROM object_delivery GROUP BY project, state;
-- The totals per project (what the trend sample records), from the counts above.
CREATE VIEW object_totals AS
    SELECT project, sum(objects) AS objects, sum(bytes) AS accepted_bytes,
           sum(CASE WHEN state = 'delivered' THEN bytes ELSE 0 END) AS delivered_bytes,
           sum(CASE WHEN state != 'delivered' THEN objects ELSE 0 END) AS pending_objects,
           sum(CASE WHEN state != 'delivered' THEN bytes ELSE 0 END) AS pending_bytes
    FROM object_states GROUP BY project;

-- The rows of object_delivery not delivered yet (their number is what waits, not what is at
-- rest), with the view's accepted_at, state and updated_at, so the oldest undelivered object
-- and the latest failures are the first entries of an index.  Kept by the same triggers: each
-- change of either table rebuilds the changed object's row from the view.
CREATE TABLE undelivered (
    object_id    TEXT PRIMARY KEY,
    accepted_at  INTEGER NOT NULL,
    state        TEXT NOT NULL,
    updated_at   REAL NOT NULL
) WITHOUT ROWID;
INSERT INTO undelivered (object_id, accepted_at, state, updated_at)
    SELECT object_id, accepted_at, state, updated_at FROM object_delivery
    WHERE state != 'delivered';
CREATE INDEX undelivered_oldest ON undelivered (accepted_at);
CREATE INDEX undelivered_failed ON undelivered (updated_at) WHERE state = 'retry_wait';

-- Overdue local purges, and the latest deliveries, found without reading the rows at rest.
CREATE INDEX objects_purge_due ON objects (purge_after)
    WHERE purged_at IS NULL AND purge_after IS NOT NULL;
CREATE INDEX outbound_delivered ON outbound (kind, delivered_at)
    WHERE state = 'delivered' AND delivered_at IS NOT NULL;

-- A row of the view is an objects row joined with its outbound row; whichever of the two is
-- written second adds the pair, whichever is deleted first takes it away (the other one's
-- trigger then finds no partner).  No writer replaces these rows (INSERT OR REPLACE would
-- delete without firing a trigger).
CREATE TRIGGER object_states_object_added AFTER INSERT ON objects
BEGIN
    INSERT INTO object_states (project, state, objects, bytes, flagged)
        SELECT new.project, d.state, 1, new.size_bytes, d.needs_operator
        FROM outbound d WHERE d.kind = 'object' AND d.ref = new.object_id
    ON CONFLICT (project, state) DO UPDATE SET
        objects = objects + excluded.objects,
        bytes = bytes + excluded.bytes,
        flagged = flagged + excluded.flagged;
    DELETE FROM undelivered WHERE object_id = new.object_id;
    INSERT INTO undelivered (object_id, accepted_at, state, updated_at)
        SELECT object_id, accepted_at, state, updated_at FROM object_delivery
        WHERE object_id = new.object_id AND state != 'delivered';
END;

CREATE TRIGGER object_states_object_removed AFTER DELETE ON objects
BEGIN
    INSERT INTO object_states (project, state, objects, bytes, flagged)
        SELECT old.project, d.state, -1, -old.size_bytes, -d.needs_operator
        FROM outbound d WHERE d.kind = 'object' AND d.ref = old.object_id
    ON CONFLICT (project, state) DO UPDATE SET
        objects = objects + excluded.objects,
        bytes = bytes + excluded.bytes,
        flagged = flagged + excluded.flagged;
    DELETE FROM undelivered WHERE object_id = old.object_id;
END;

CREATE TRIGGER object_states_object_changed AFTER UPDATE OF project, size_bytes ON objects
    WHEN old.project IS NOT new.project OR old.size_bytes IS NOT new.size_bytes
BEGIN
    INSERT INTO object_states (project, state, objects, bytes, flagged)
        SELECT old.project, d.state, -1, -old.size_bytes, -d.needs_operator
        FROM outbound d WHERE d.kind = 'object' AND d.ref = old.object_id
    ON CONFLICT (project, state) DO UPDATE SET
        objects = objects + excluded.objects,
        bytes = bytes + excluded.bytes,
        flagged = flagged + excluded.flagged;
    INSERT INTO object_states (project, state, objects, bytes, flagged)
        SELECT new.project, d.state, 1, new.size_bytes, d.needs_operator
        FROM outbound d WHERE d.kind = 'object' AND d.ref = new.object_id
    ON CONFLICT (project, state) DO UPDATE SET
        objects = objects + excluded.objects,
        bytes = bytes + excluded.bytes,
        flagged = flagged + excluded.flagged;
END;

-- What the undelivered row copies from objects (object_id and project never change).
CREATE TRIGGER undelivered_object_changed AFTER UPDATE OF accepted_at, updated_at ON objects
    WHEN old.accepted_at IS NOT new.accepted_at OR old.updated_at IS NOT new.updated_at
BEGIN
    DELETE FROM undelivered WHERE object_id = new.object_id;
    INSERT INTO undelivered (object_id, accepted_at, state, updated_at)
        SELECT object_id, accepted_at, state, updated_at FROM object_delivery
        WHERE object_id = new.object_id AND state != 'delivered';
END;

CREATE TRIGGER object_states_outbound_added AFTER INSERT ON outbound
    WHEN new.kind = 'object'
BEGIN
    INSERT INTO object_states (project, state, objects, bytes, flagged)
        SELECT o.project, new.state, 1, o.size_bytes, new.needs_operator
        FROM objects o WHERE o.object_id = new.ref
    ON CONFLICT (project, state) DO UPDATE SET
        objects = objects + excluded.objects,
        bytes = bytes + excluded.bytes,
        flagged = flagged + excluded.flagged;
    DELETE FROM undelivered WHERE object_id = new.ref;
    INSERT INTO undelivered (object_id, accepted_at, state, updated_at)
        SELECT object_id, accepted_at, state, updated_at FROM object_delivery
        WHERE object_id = new.ref AND state != 'delivered';
END;

CREATE TRIGGER object_states_outbound_removed AFTER DELETE ON outbound
    WHEN old.kind = 'object'
BEGIN
    INSERT INTO object_states (project, state, objects, bytes, flagged)
        SELECT o.project, old.state, -1, -o.size_bytes, -old.needs_operator
        FROM objects o WHERE o.object_id = old.ref
    ON CONFLICT (project, state) DO UPDATE SET
        objects = objects + excluded.objects,
        bytes = bytes + excluded.bytes,
        flagged = flagged + excluded.flagged;
    DELETE FROM undelivered WHERE object_id = old.ref;
END;

-- Kind and ref never change.
CREATE TRIGGER object_states_outbound_moved AFTER UPDATE OF state, needs_operator ON outbound
    WHEN new.kind = 'object'
        AND (old.state IS NOT new.state OR old.needs_operator IS NOT new.needs_operator)
BEGIN
    INSERT INTO object_states (project, state, objects, bytes, flagged)
        SELECT o.project, old.state, -1, -o.size_bytes, -old.needs_operator
        FROM objects o WHERE o.object_id = old.ref
    ON CONFLICT (project, state) DO UPDATE SET
        objects = objects + excluded.objects,
        bytes = bytes + excluded.bytes,
        flagged = flagged + excluded.flagged;
    INSERT INTO object_states (project, state, objects, bytes, flagged)
        SELECT o.project, new.state, 1, o.size_bytes, new.needs_operator
        FROM objects o WHERE o.object_id = new.ref
    ON CONFLICT (project, state) DO UPDATE SET
        objects = objects + excluded.objects,
        bytes = bytes + excluded.bytes,
        flagged = flagged + excluded.flagged;
END;

CREATE TRIGGER undelivered_outbound_changed AFTER UPDATE OF state, updated_at ON outbound
    WHEN new.kind = 'object'
        AND (old.state IS NOT new.state OR old.updated_at IS NOT new.updated_at)
        AND (old.state != 'delivered' OR new.state != 'delivered')
BEGIN
    DELETE FROM undelivered WHERE object_id = new.ref;
    INSERT INTO undelivered (object_id, accepted_at, state, updated_at)
        SELECT object_id, accepted_at, state, updated_at FROM object_delivery
        WHERE object_id = new.ref AND state != 'delivered';
END;
