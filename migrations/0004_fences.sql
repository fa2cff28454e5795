-- Fencing: the last token each lock service wrote for a product. With fencing on, an
-- order's transaction only commits if its lock's token is greater than the last one
-- written for that SKU by the same lock service (tokens of different lock services
-- are not comparable, so each has its own row).
CREATE TABLE product_fences (
    sku          VARCHAR(64) NOT NULL,
    lock_service VARCHAR(32) NOT NULL,
    fence        BIGINT UNSIGNED NOT NULL DEFAULT 0,
    PRIMARY KEY (sku, lock_service)
) ENGINE = InnoDB;
