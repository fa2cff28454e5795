-- The system of record: one row per SKU with its stock, one row per order.
-- Anyone can check a run with plain SQL:
--   SELECT p.sku, p.initial_stock, p.stock, COUNT(o.id), SUM(o.quantity)
--   FROM products p LEFT JOIN orders o USING (sku) GROUP BY p.sku;
CREATE TABLE products (
    sku           VARCHAR(64)  NOT NULL PRIMARY KEY,
    stock         BIGINT       NOT NULL,
    initial_stock BIGINT       NOT NULL,
    -- Bumped by every write; the optimistic strategy compares it.
    version       BIGINT       NOT NULL DEFAULT 0,
    updated_at    TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6)
) ENGINE = InnoDB;

CREATE TABLE orders (
    id         BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    sku        VARCHAR(64)  NOT NULL,
    user_id    VARCHAR(64)  NOT NULL,
    quantity   INT          NOT NULL,
    strategy   VARCHAR(32)  NOT NULL,
    replica    VARCHAR(64)  NOT NULL,
    created_at TIMESTAMP(6) NOT NULL,
    KEY orders_by_sku (sku)
) ENGINE = InnoDB;
