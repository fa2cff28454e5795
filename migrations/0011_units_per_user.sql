-- Issue 39, after review: the units each user bought of a SKU in its sale, one row per
-- (SKU, user), added to in the order's transaction when the SKU has a limit per user
-- (`products.limit_per_user`). It replaces a locking read of the user's orders
-- (`SELECT SUM(quantity) … LOCK IN SHARE MODE`), whose next-key locks under REPEATABLE
-- READ covered the gaps between one SKU's orders and the next SKU's: orders of
-- neighbouring limited SKUs deadlocked (1213). An upsert of this row by its primary key
-- locks that one row only, so it serialises one user's orders of one SKU and nothing
-- else. A reset deletes the SKU's rows with its orders: each sale counts afresh.
CREATE TABLE units_per_user (
    sku     VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    user_id VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    units   BIGINT NOT NULL,
    PRIMARY KEY (sku, user_id)
) ENGINE = InnoDB;

-- The sales under way with a limit keep counting what their users bought.
INSERT INTO units_per_user (sku, user_id, units)
SELECT o.sku, o.user_id, SUM(o.quantity)
FROM orders o JOIN products p ON p.sku = o.sku
WHERE p.limit_per_user IS NOT NULL
GROUP BY o.sku, o.user_id;
