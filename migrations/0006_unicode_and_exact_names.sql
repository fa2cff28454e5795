-- Text in full Unicode, compared byte for byte.
--
-- A server whose default character set is latin1 (Debian's MariaDB) created the
-- tables above in latin1: a user id such as "张伟" or "😀" could not be stored, and
-- the order failed with a server error. Its case-insensitive collation also made
-- "PHONE-1" and "phone-1" one product in MySQL while Redis, ZooKeeper and etcd keep
-- them apart. utf8mb4 with a binary collation fixes both.
ALTER DATABASE CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
ALTER TABLE products CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
ALTER TABLE orders CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
ALTER TABLE distributed_locks CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
ALTER TABLE product_fences CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
ALTER TABLE cluster_settings CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;

-- Reports are listed in the order they arrived. Their own `generated_at` stays in
-- the report: a TIMESTAMP column cannot hold dates before 1970 or after 2038, and
-- a report claiming such a date made the insert fail.
ALTER TABLE load_test_runs
    CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    DROP INDEX load_test_runs_by_time,
    DROP COLUMN generated_at;
