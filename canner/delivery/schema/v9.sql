-- delivery.sqlite, version 9: what is at rest costs nothing per tick (issue 37).  Only adds; the
-- whole step is one transaction (upgrade_schema), so a kill during it leaves version 8 intact
-- and the next start applies it again.
--
-- The rows left 'delivering' by an interrupted attempt, found without reading every row: at
-- start-up (reset_delivering) and every minute (release_orphans).
CREATE INDEX outbound_delivering ON outbound (kind, ref) WHERE state = 'delivering';

-- The totals of object_delivery per project, kept up to date by the triggers below in the
-- transaction of every change, so the trend sample each minute reads a few rows instead of
-- summing every object: objects (rows of the view), their bytes, the bytes delivered, and the
-- objects and bytes not delivered yet.  A project whose objects are all gone keeps its row at
-- zero objects (readers skip those, as a GROUP BY over the view would).
CREATE TABLE object_totals (
    project          TEXT PRIMARY KEY,
    objects          INTEGER NOT NULL DEFAULT 0,
    accepted_bytes   INTEGER NOT NULL DEFAULT 0,
    delivered_bytes  INTEGER NOT NULL DEFAULT 0,
    pending_objects  INTEGER NOT NULL DEFAULT 0,
    pending_bytes    INTEGER NOT NULL DEFAULT 0
);
INSERT INTO object_totals (project, objects, accepted_bytes, delivered_bytes, pending_objects,
                           pending_bytes)
    SELECT project, count(*), coalesce(sum(size_bytes), 0),
           coalesce(sum(CASE WHEN state = 'delivered' THEN size_bytes END), 0),
           coalesce(sum(state != 'delivered'), 0),
           coalesce(sum(CASE WHEN state != 'delivered' THEN size_bytes END), 0)
    FROM object_delivery GROUP BY project;

-- A row of the view is an objects row joined with its outbound row; whichever of the two is
-- written second adds the pair, whichever is deleted first takes it away (the other one's
-- trigger then finds no partner).  No writer replaces these rows (INSERT OR REPLACE would
-- delete without firing a trigger).
CREATE TRIGGER object_totals_object_added AFTER INSERT ON objects
BEGIN
    INSERT INTO object_totals (project, objects, accepted_bytes, delivered_bytes,
                               pending_objects, pending_bytes)
        SELECT new.project, 1, new.size_bytes,
               CASE WHEN d.state = 'delivered' THEN new.size_bytes ELSE 0 END,
               d.state != 'delivered',
               CASE WHEN d.state != 'delivered' THEN new.size_bytes ELSE 0 END
        FROM outbound d WHERE d.kind = 'object' AND d.ref = new.object_id
    ON CONFLICT (project) DO UPDATE SET
        objects = objects + excluded.objects,
        accepted_bytes = accepted_bytes + excluded.accepted_bytes,
        delivered_bytes = delivered_bytes + excluded.delivered_bytes,
        pending_objects = pending_objects + excluded.pending_objects,
        pending_bytes = pending_bytes + excluded.pending_bytes;
END;
CREATE TRIGGER object_totals_object_removed AFTER DELETE ON objects
BEGIN
    INSERT INTO object_totals (project, objects, accepted_bytes, delivered_bytes,
                               pending_objects, pending_bytes)
        SELECT old.project, -1, -old.size_bytes,
               CASE WHEN d.state = 'delivered' THEN -old.size_bytes ELSE 0 END,
               -(d.state != 'delivered'),
               CASE WHEN d.state != 'delivered' THEN -old.size_bytes ELSE 0 END
        FROM outbound d WHERE d.kind = 'object' AND d.ref = old.object_id
    ON CONFLICT (project) DO UPDATE SET
        objects = objects + excluded.objects,
        accepted_bytes = accepted_bytes + excluded.accepted_bytes,
        delivered_bytes = delivered_bytes + excluded.delivered_bytes,
        pending_objects = pending_objects + excluded.pending_objects,
        pending_bytes = pending_bytes + excluded.pending_bytes;
END;
CREATE TRIGGER object_totals_object_changed AFTER UPDATE OF project, size_bytes ON objects
    WHEN old.project IS NOT new.project OR old.size_bytes IS NOT new.size_bytes
BEGIN
    INSERT INTO object_totals (project, objects, accepted_bytes, delivered_bytes,
                               pending_objects, pending_bytes)
        SELECT old.project, -1, -old.size_bytes,
               CASE WHEN d.state = 'delivered' THEN -old.size_bytes ELSE 0 END,
               -(d.state != 'delivered'),
               CASE WHEN d.state != 'delivered' THEN -old.size_bytes ELSE 0 END
        FROM outbound d WHERE d.kind = 'object' AND d.ref = old.object_id
    ON CONFLICT (project) DO UPDATE SET
        objects = objects + excluded.objects,
        accepted_bytes = accepted_bytes + excluded.accepted_bytes,
        delivered_bytes = delivered_bytes + excluded.delivered_bytes,
        pending_objects = pending_objects + excluded.pending_objects,
        pending_bytes = pending_bytes + excluded.pending_bytes;
    INSERT INTO object_totals (project, objects, accepted_bytes, delivered_bytes,
                               pending_objects, pending_bytes)
        SELECT new.project, 1, new.size_bytes,
               CASE WHEN d.state = 'delivered' THEN new.size_bytes ELSE 0 END,
               d.state != 'delivered',
               CASE WHEN d.state != 'delivered' THEN new.size_bytes ELSE 0 END
        FROM outbound d WHERE d.kind = 'object' AND d.ref = new.object_id
    ON CONFLICT (project) DO UPDATE SET
        objects = objects + excluded.objects,
        accepted_bytes = accepted_bytes + excluded.accepted_bytes,
        delivered_bytes = delivered_bytes + excluded.delivered_bytes,
        pending_objects = pending_objects + excluded.pending_objects,
        pending_bytes = pending_bytes + excluded.pending_bytes;
END;
CREATE TRIGGER object_totals_outbound_added AFTER INSERT ON outbound
    WHEN new.kind = 'object'
BEGIN
    INSERT INTO object_totals (project, objects, accepted_bytes, delivered_bytes,
                               pending_objects, pending_bytes)
        SELECT o.project, 1, o.size_bytes,
               CASE WHEN new.state = 'delivered' THEN o.size_bytes ELSE 0 END,
               new.state != 'delivered',
               CASE WHEN new.state != 'delivered' THEN o.size_bytes ELSE 0 END
        FROM objects o WHERE o.object_id = new.ref
    ON CONFLICT (project) DO UPDATE SET
        objects = objects + excluded.objects,
        accepted_bytes = accepted_bytes + excluded.accepted_bytes,
        delivered_bytes = delivered_bytes + excluded.delivered_bytes,
        pending_objects = pending_objects + excluded.pending_objects,
        pending_bytes = pending_bytes + excluded.pending_bytes;
END;
CREATE TRIGGER object_totals_outbound_removed AFTER DELETE ON outbound
    WHEN old.kind = 'object'
BEGIN
    INSERT INTO object_totals (project, objects, accepted_bytes, delivered_bytes,
                               pending_objects, pending_bytes)
        SELECT o.project, -1, -o.size_bytes,
               CASE WHEN old.state = 'delivered' THEN -o.size_bytes ELSE 0 END,
               -(old.state != 'delivered'),
               CASE WHEN old.state != 'delivered' THEN -o.size_bytes ELSE 0 END
        FROM objects o WHERE o.object_id = old.ref
    ON CONFLICT (project) DO UPDATE SET
        objects = objects + excluded.objects,
        accepted_bytes = accepted_bytes + excluded.accepted_bytes,
        delivered_bytes = delivered_bytes + excluded.delivered_bytes,
        pending_objects = pending_objects + excluded.pending_objects,
        pending_bytes = pending_bytes + excluded.pending_bytes;
END;
-- Only a move into or out of 'delivered' changes a total; kind and ref never change.
CREATE TRIGGER object_totals_outbound_moved AFTER UPDATE OF state ON outbound
    WHEN new.kind = 'object' AND (old.state = 'delivered') != (new.state = 'delivered')
BEGIN
    UPDATE object_totals SET
        delivered_bytes = delivered_bytes
            + (SELECT size_bytes FROM objects WHERE object_id = new.ref)
              * ((new.state = 'delivered') - (old.state = 'delivered')),
        pending_objects = pending_objects
            - ((new.state = 'delivered') - (old.state = 'delivered')),
        pending_bytes = pending_bytes
            - (SELECT size_bytes FROM objects WHERE object_id = new.ref)
              * ((new.state = 'delivered') - (old.state = 'delivered'))
    WHERE project = (SELECT project FROM objects WHERE object_id = new.ref);
END;
