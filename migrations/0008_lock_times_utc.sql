-- Lock-table times in UTC, in columns without time zone conversion.
--
-- A TIMESTAMP column converts from and to each session's time zone. Writing NOW(6)
-- into it agrees across sessions only while every zone maps local times one to one:
-- in a zone with daylight saving time, the hour repeated in autumn is ambiguous and a
-- lease written then can come back an hour off. Writing UTC_TIMESTAMP(6) into a
-- TIMESTAMP column is worse: a session in another zone reads it hours off. DATETIME
-- stores what it is given, and the lock table writes and compares UTC_TIMESTAMP(6)
-- only, so replicas whose sessions differ in time zone agree. Rows in the table are
-- leases of seconds; any converted here are at worst taken over early or late once.
ALTER TABLE distributed_locks
    MODIFY acquired_at DATETIME(6) NOT NULL DEFAULT UTC_TIMESTAMP(6),
    MODIFY expires_at  DATETIME(6) NOT NULL;
