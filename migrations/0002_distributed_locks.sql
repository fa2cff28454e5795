-- The lock table of the db-unique strategy. A row is a held lock: the unique key on
-- lock_name makes a second INSERT of the same name fail (1062), which is the lock.
-- owner is unique per acquisition, so release and renewal touch only one's own row;
-- id only ever grows, so an expired row is taken over by deleting exactly that row.
CREATE TABLE distributed_locks (
    id          BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    lock_name   VARCHAR(128) NOT NULL,
    owner       VARCHAR(128) NOT NULL,
    acquired_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    expires_at  TIMESTAMP(6) NOT NULL,
    UNIQUE KEY distributed_locks_name (lock_name)
) ENGINE = InnoDB;
