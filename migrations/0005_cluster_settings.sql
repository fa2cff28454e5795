-- Durable copy of the cluster-wide settings (active strategy, fencing). Redis holds
-- the copy every order reads; if Redis loses it (a restart), it is rebuilt from here
-- instead of silently falling back to the default strategy.
CREATE TABLE cluster_settings (
    name  VARCHAR(32) NOT NULL PRIMARY KEY,
    value VARCHAR(64) NOT NULL
) ENGINE = InnoDB;

-- The defaults, so Redis can always be rebuilt from here.
INSERT INTO cluster_settings (name, value) VALUES ('strategy', 'none'), ('fencing', 'off');
