-- Load-test reports POSTed by the load test, for the dashboard's history. The report
-- is kept whole as JSON (its shape is SPEC §6); generated_at orders them.
CREATE TABLE load_test_runs (
    id           BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    generated_at TIMESTAMP(6) NOT NULL,
    received_at  TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    report       LONGTEXT     NOT NULL,
    KEY load_test_runs_by_time (generated_at)
) ENGINE = InnoDB;
