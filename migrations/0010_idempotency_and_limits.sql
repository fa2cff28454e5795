-- Issue 39: a shopper who retries gets one order; a sale may sell a user at most N units.
--
-- orders.idempotency_key: the shopper's Idempotency-Key, written in the order's own
-- transaction (with the stock decrement) under a unique key. Whatever happens to the
-- replica or the connection, MySQL holds at most one order per key, under every
-- strategy. NULL for orders without a key (any number of them). `fingerprint` is the
-- SHA-256 of the request the key was sent with: the same key with another request is
-- refused, never answered with this order.
--
-- orders_by_sku_user: the units a user bought of a SKU, summed in the order's
-- transaction when the SKU has a limit per user (`products.limit_per_user`, NULL: no
-- limit; set by each reset, whose deletion of the SKU's orders starts the count afresh).
ALTER TABLE orders
    ADD COLUMN idempotency_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NULL,
    ADD COLUMN fingerprint CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NULL,
    ADD UNIQUE KEY orders_by_idempotency_key (idempotency_key),
    ADD KEY orders_by_sku_user (sku, user_id);

ALTER TABLE products ADD COLUMN limit_per_user BIGINT NULL;

-- The claim of a key (`src/store/idempotency.rs`): inserted before its order runs, so
-- the same key sent again meanwhile, to any replica, answers 409 in_progress instead of
-- running twice; then the definitive answer (the 201's order, or a refusal such as
-- sold_out) to replay. `claim` is the running holder's random token (NULL once
-- answered); past `claimed_until` (MySQL's clock) a holder is presumed dead and the
-- claim may be taken over, after the orders table says no order has the key. Rows are
-- kept 24 hours from `created_at`, then purged.
CREATE TABLE idempotency_keys (
    idem_key      VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    fingerprint   CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    claim         BIGINT UNSIGNED NULL,
    claimed_until TIMESTAMP(6) NULL,
    status        SMALLINT UNSIGNED NULL,
    answer        TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    created_at    TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    KEY idempotency_keys_by_age (created_at)
) ENGINE = InnoDB;
