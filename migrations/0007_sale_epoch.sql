-- The sale epoch: a number every admin change of the sale moves forward (a strategy
-- or fencing switch, a reset, a reconcile). Each order reads it with the active
-- strategy and its commit only succeeds while it is unchanged: the commit's UPDATE
-- joins this row, which takes a shared lock on it, and the admin change's UPDATE of
-- the row waits for those in-flight commits. So an order placed under the old
-- strategy can never commit after the new one has begun: two strategies never
-- overlap on a SKU, and a reset never meets an order that read the stock before it.
INSERT INTO cluster_settings (name, value) VALUES ('epoch', '1');
