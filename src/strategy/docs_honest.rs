//! Keeps the lab's text honest where a machine can tell: every command a strategy's
//! card shows is one its code sends, and every route of the router is in
//! `docs/api.md` (and every route there is served).
//!
//! A command is "sent" when the strategy's sources, comments left out, hold it as
//! Redis or SQL text (`'INCR'` in a Lua script, `"BLPOP"` in `redis::cmd`, `UPDATE`
//! in a query) or as the client call that sends it (`.mget(`, `.lease_grant(`).

use super::{Explanation, db_unique, etcd, redis_lock, redlock, zookeeper};
use super::{Strategy, db_for_update, none, optimistic, redis_atomic};

/// The words a card may name as commands, and the client calls that send them when
/// the source does not spell the command itself.
const COMMANDS: &[(&str, &[&str])] = &[
    ("GET", &[".get("]),
    ("SET", &[]),
    ("DEL", &[".del("]),
    ("INCR", &[]),
    ("INCRBY", &[]),
    ("DECRBY", &[]),
    ("PEXPIRE", &[]),
    ("PTTL", &[]),
    ("RPUSH", &[]),
    ("BLPOP", &[]),
    ("ZADD", &[]),
    ("ZREM", &[]),
    ("ZRANGE", &[]),
    ("HSET", &[]),
    ("PUBLISH", &[]),
    ("WAIT", &[]),
    ("SUBSCRIBE", &[".subscribe("]),
    ("MGET", &[".mget("]),
    ("SELECT", &[]),
    ("INSERT", &[]),
    ("UPDATE", &[]),
    ("DELETE", &["::delete("]),
    ("BEGIN", &[".begin("]),
    ("COMMIT", &[".commit("]),
    ("ROLLBACK", &[".rollback("]),
    ("PUT", &["::put("]),
    ("create", &[".create("]),
    ("getChildren", &[".list_children("]),
    ("exists", &[".check_stat(", ".check_and_watch_stat("]),
    ("getData", &[".get_data("]),
    ("delete", &[".delete("]),
    ("LeaseGrant", &[".lease_grant("]),
    ("LeaseKeepAlive", &[".lease_keep_alive("]),
    ("LeaseRevoke", &[".lease_revoke("]),
    ("Txn", &["Txn::new("]),
    ("Watch", &[".watch("]),
];

/// What every order's path sends, whatever the strategy.
const SHARED: &[&str] = &[
    include_str!("flow.rs"),
    include_str!("../store/stock_cache.rs"),
    include_str!("../store/order_commit.rs"),
    include_str!("../store/records.rs"),
    include_str!("../store/cluster_state.rs"),
];

/// Each strategy's card and the sources of its own mechanism.
fn cards() -> Vec<(Explanation, Vec<&'static str>)> {
    vec![
        (none::NoCoordination.explanation(), vec![]),
        (
            redis_lock::explanation(),
            vec![
                include_str!("../lock/redis.rs"),
                include_str!("../lock/redis/subscriptions.rs"),
            ],
        ),
        (
            db_unique::explanation(),
            vec![include_str!("../lock/table.rs")],
        ),
        (
            optimistic::OptimisticStrategy::new(10).explanation(),
            vec![include_str!("optimistic.rs")],
        ),
        (
            zookeeper::explanation(),
            vec![include_str!("../lock/zookeeper.rs")],
        ),
        (
            db_for_update::DbForUpdateStrategy::default().explanation(),
            vec![include_str!("db_for_update.rs")],
        ),
        (
            etcd::explanation(),
            vec![
                include_str!("../lock/etcd.rs"),
                include_str!("../lock/etcd/calls.rs"),
                include_str!("../lock/etcd/session.rs"),
                include_str!("../lock/etcd/undo.rs"),
                include_str!("../lock/etcd/view.rs"),
            ],
        ),
        (
            redlock::explanation(),
            vec![
                include_str!("../lock/redlock.rs"),
                include_str!("../lock/redis.rs"),
            ],
        ),
        (
            redis_atomic::RedisAtomicStrategy::default().explanation(),
            vec![include_str!("../store/group_commit.rs")],
        ),
    ]
}

/// The source without its comments: a command named only in a comment is not sent.
fn code(source: &str) -> String {
    source
        .lines()
        .filter(|line| {
            let line = line.trim_start();
            !line.starts_with("//")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `word` in `text` as a whole word (not part of a longer identifier).
fn has_word(text: &str, word: &str) -> bool {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices(word).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
    })
}

/// The commands a card's line names.
fn named(line: &str) -> Vec<&'static str> {
    COMMANDS
        .iter()
        .map(|(word, _)| *word)
        .filter(|word| has_word(line, word))
        .collect()
}

fn sent(word: &str, sources: &str) -> bool {
    let calls = COMMANDS
        .iter()
        .find(|(w, _)| *w == word)
        .map_or(&[][..], |(_, calls)| calls);
    has_word(sources, word) || calls.iter().any(|call| sources.contains(call))
}

/// Every line of every card names at least one command, and each command it names is
/// one the strategy's code sends. Fails for a card that shows a command its code does
/// not send: e.g. with `INCR` taken out of redis-lock's acquiring script
/// (`lock/redis.rs`), its card's fencing counter fails here.
#[test]
fn every_command_a_card_shows_is_sent() {
    for (card, own) in cards() {
        let sources = SHARED
            .iter()
            .chain(own.iter())
            .map(|source| code(source))
            .collect::<Vec<_>>()
            .join("\n");
        for line in &card.commands {
            let words = named(line);
            assert!(
                !words.is_empty(),
                "{}: the line names no command: {line}",
                card.name
            );
            for word in words {
                assert!(
                    sent(word, &sources),
                    "{}: the card shows {word}, which its code does not send: {line}",
                    card.name
                );
            }
        }
    }
}

/// Every card has its idea, what the lab adds, and how it fails.
#[test]
fn every_card_is_complete() {
    for (card, _) in cards() {
        assert!(!card.summary.is_empty(), "{}", card.name);
        assert!(!card.adds.is_empty(), "{}", card.name);
        assert!(!card.failure_mode.is_empty(), "{}", card.name);
    }
}

/// The router's routes as (method, path), from `src/http/mod.rs`: each `.route("path",
/// get(..).post(..))`, catch-alls (`any`) left out.
fn routes() -> Vec<(String, String)> {
    let source = code(include_str!("../http/mod.rs"));
    let mut routes = Vec::new();
    for piece in source.split(".route(").skip(1) {
        let Some(path) = piece.split('"').nth(1) else {
            continue;
        };
        let handlers = piece.split(".route(").next().unwrap_or("");
        let handlers = handlers.split(';').next().unwrap_or("");
        for method in ["get", "post", "put", "delete", "patch"] {
            if has_word(handlers, method) && handlers.contains(&format!("{method}(")) {
                routes.push((method.to_uppercase(), path.to_owned()));
            }
        }
    }
    routes
}

/// The API table of `docs/api.md` as (method, path): rows like
/// "| `GET, PUT /api/admin/strategy` | … |", a query (`[?sku=S]`, `?sku=S`) left off.
fn documented() -> Vec<(String, String)> {
    let mut rows = Vec::new();
    for line in include_str!("../../docs/api.md").lines() {
        let Some(cell) = line.strip_prefix("| `") else {
            continue;
        };
        let Some((cell, _)) = cell.split_once('`') else {
            continue;
        };
        let Some((methods, path)) = cell.rsplit_once(' ') else {
            continue;
        };
        let path = path.split(['[', '?']).next().unwrap_or(path);
        if !path.starts_with('/') {
            continue;
        }
        for method in methods.split(", ") {
            rows.push((method.to_owned(), path.to_owned()));
        }
    }
    rows
}

/// Each route the router serves is in docs/api.md's table, and each route there is
/// served. Fails when a route is added, removed or renamed without the table.
#[test]
fn every_route_is_documented_and_every_documented_route_served() {
    let routes = routes();
    let documented = documented();
    assert!(routes.len() > 10, "the router was read: {routes:?}");
    for route in &routes {
        assert!(
            documented.contains(route),
            "{} {} is served but not in docs/api.md",
            route.0,
            route.1
        );
    }
    for row in &documented {
        assert!(
            routes.contains(row),
            "docs/api.md lists {} {}, which the router does not serve",
            row.0,
            row.1
        );
    }
}

/// Each test docs/choosing.md names as the evidence of a property exists: a test
/// renamed or deleted would leave the table claiming what nothing checks (it named
/// `db_unique_serves_replicas_in_the_order_they_began_waiting` after the queue that
/// test checked was deleted).
#[test]
fn every_test_the_guide_names_exists() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/integration");
    let mut tests = String::new();
    for entry in std::fs::read_dir(dir).expect("tests/integration") {
        let path = entry.expect("an entry").path();
        tests += &std::fs::read_to_string(&path).unwrap_or_default();
    }
    let guide = include_str!("../../docs/choosing.md");
    let is_name = |word: &&str| {
        word.contains('_')
            && word
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == ':')
    };
    let names: Vec<&str> = guide
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(is_name)
        .collect();
    assert!(names.len() > 10, "the guide's tests were read: {names:?}");
    for name in names {
        let function = name.rsplit("::").next().unwrap_or(name);
        assert!(
            tests.contains(&format!("fn {function}(")),
            "docs/choosing.md names {name}, which no test in tests/integration is"
        );
    }
}

/// The dashboard's card on the idempotency key (`#key-card` in static/index.html) says
/// what the code does: the UNIQUE column written by the order's own INSERT, the
/// answers to a key sent again (409 in_progress, 422 with another body), the 24 h the
/// keys are kept, and the claim's INSERT and UPDATE it counts as the cost. Fails when
/// the card and the code part: e.g. with the unique key dropped from the migration,
/// `KEY_RETENTION` changed, or the card saying "48 h".
#[test]
fn the_key_card_says_what_the_code_does() {
    let squash = |text: &str| text.split_whitespace().collect::<Vec<_>>().join(" ");
    let page = include_str!("../../static/index.html");
    let start = page.find("id=\"key-card\"").expect("the key card");
    let end = start + page[start..].find("</article>").expect("the card's end");
    let card = squash(&page[start..end]);
    let migration = squash(include_str!(
        "../../migrations/0010_idempotency_and_limits.sql"
    ));
    let records = squash(&code(include_str!("../store/records.rs")));
    let claims = squash(&code(include_str!("../store/idempotency.rs")));
    let errors = squash(&code(include_str!("../http/error.rs")));
    let says = |claim: &str| assert!(card.contains(claim), "the card says {claim:?}: {card}");

    says(
        "<code>orders.idempotency_key</code>, a UNIQUE column, in the same transaction as the stock decrement",
    );
    assert!(migration.contains("ADD UNIQUE KEY orders_by_idempotency_key (idempotency_key)"));
    assert!(
        records.contains(
            "INSERT INTO orders (sku, user_id, quantity, strategy, replica, created_at, idempotency_key"
        ),
        "the order's own INSERT writes the key"
    );
    says("409 <code>in_progress</code> while the first still runs, 422 with another body");
    assert!(errors.contains(r#"AppError::InProgress => (StatusCode::CONFLICT, "in_progress")"#));
    assert!(errors.contains("AppError::KeyReused => (StatusCode::UNPROCESSABLE_ENTITY"));
    says("Keys are kept 24 h.");
    assert_eq!(
        crate::store::KEY_RETENTION,
        std::time::Duration::from_secs(24 * 3600)
    );
    says(
        "an <code>INSERT</code> before the order, an <code>UPDATE</code> with the answer after it",
    );
    assert!(claims.contains("INSERT INTO idempotency_keys"));
    assert!(claims.contains("UPDATE idempotency_keys"));
}
