//! `MysqlStore` against the machine's MySQL or MariaDB (`MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`): the store-generic suite, unchanged, on a table
//! of this run's own, plus the table's upkeep and keys a producer may send on purpose.

#[path = "support/mysql.rs"]
mod mysql;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idempotent::testing::block_on;
use idempotent::{Claim, Key, MysqlStore, Store, Transition};

/// This run's records table, shared by the suite's cases (they use fresh namespaces).
fn suite_table() -> &'static str {
    static TABLE: OnceLock<String> = OnceLock::new();
    TABLE.get_or_init(|| mysql::table("idempotent_suite"))
}

/// A migrated store on this run's table; `None` (with a printed reason) when no
/// server answers outside CI. The first call also drops suite tables that earlier
/// runs left behind more than an hour ago.
async fn store() -> Option<MysqlStore> {
    store_with(&[]).await
}

/// As [`store`], with `session` run on every connection.
async fn store_with(session: &[&'static str]) -> Option<MysqlStore> {
    static SWEPT: AtomicBool = AtomicBool::new(false);
    let pool = mysql::pool_with(10, session).await?;
    if !SWEPT.swap(true, Ordering::SeqCst) {
        let stale: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(table_name AS CHAR) FROM information_schema.tables
             WHERE table_schema = DATABASE() AND table_name LIKE 'idempotent\\_suite\\_%'
               AND create_time < NOW() - INTERVAL 1 HOUR",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        for table in stale {
            mysql::drop_tables(&pool, &[&table]).await;
        }
    }
    let store = MysqlStore::from_pool(pool).with_table(suite_table()).unwrap();
    store.migrate().await.expect("migration");
    Some(store)
}

idempotent::store_suite!(match store().await {
    Some(store) => store,
    None => return,
});

/// The suite with the session's binary log in ROW format (MySQL 8's default), beside
/// the server's own MIXED (MariaDB's default) that every other test here runs under
/// in CI.
mod row_binlog {
    idempotent::store_suite!(
        match super::store_with(&["SET SESSION binlog_format = 'ROW'"]).await {
            Some(store) => store,
            None => return,
        }
    );
}

/// CI's server logs as a primary with replicas does (binary log on, MIXED), so that
/// every MySQL test runs under it: checked here, from the server, so the setting
/// can't go missing unseen.
#[test]
fn ci_runs_the_tests_with_the_binary_log_on() {
    block_on(async {
        if std::env::var_os("CI").is_none() {
            return;
        }
        let pool = mysql::pool(1).await.unwrap();
        let (log_bin, format): (i64, String) =
            sqlx::query_as("SELECT @@log_bin, CAST(@@binlog_format AS CHAR)")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(
            (log_bin, format.as_str()),
            (1, "MIXED"),
            "start the server as .ci/services does"
        );
    });
}

/// A session whose binary log is in STATEMENT format can't log the READ COMMITTED
/// transactions of transactional handlers (error 1665 on every message): the store
/// refuses it when it connects, saying what to set, instead of dead-lettering
/// messages later.
#[test]
fn a_statement_binary_log_is_refused_at_connect() {
    block_on(async {
        let Some(pool) = mysql::pool(1).await else { return };
        let log_bin: i64 = sqlx::query_scalar("SELECT @@log_bin").fetch_one(&pool).await.unwrap();
        if log_bin == 0 {
            // A server without a binary log logs nothing, in any format (not CI's).
            return;
        }
        let statement = "SET SESSION binlog_format = 'STATEMENT'";
        let options = sqlx::mysql::MySqlPoolOptions::new().max_connections(2).after_connect(
            move |conn, _| {
                Box::pin(async move { sqlx::Executor::execute(conn, statement).await.map(drop) })
            },
        );
        let refused = MysqlStore::connect_with(&mysql::url(), options).await.unwrap_err();
        assert!(matches!(refused, idempotent::StoreError::Misconfigured(_)), "{refused:?}");
        let text = refused.to_string();
        assert!(
            text.contains("binlog_format=STATEMENT") && text.contains("binlog_format=ROW"),
            "{text}"
        );
    });
}

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);

/// A store on a fresh table of its own, and the table's name.
async fn own_store(prefix: &str) -> Option<(MysqlStore, String)> {
    let table = mysql::table(prefix);
    let store = MysqlStore::from_pool(mysql::pool(4).await?).with_table(&table).unwrap();
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    Some((store, table))
}

async fn won(store: &MysqlStore, key: &Key) -> idempotent::Token {
    match store.claim(key, LEASE, TTL, None).await.unwrap() {
        Claim::Won { token, .. } => token,
        other => panic!("{key} was not won: {other:?}"),
    }
}

#[test]
fn tables_are_configurable_and_expired_records_are_purged() {
    block_on(async {
        let Some((store, table)) = own_store("idempotent_purge").await else { return };
        assert!(store.clone().with_table("bad name; drop table x").is_err());
        let short = Duration::from_millis(50);
        for i in 0..20 {
            let key = Key::new("purge", i.to_string()).unwrap();
            let Claim::Won { token, .. } = store.claim(&key, short, short, None).await.unwrap()
            else {
                panic!("fresh key")
            };
            let _ = store.complete(&key, token, short, None).await.unwrap();
        }
        let live = Key::new("purge", "live").unwrap();
        won(&store, &live).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(store.purge_expired(1_000).await.unwrap(), 20);
        assert_eq!(store.purge_expired(1_000).await.unwrap(), 0);
        assert!(matches!(
            store.claim(&live, LEASE, TTL, None).await.unwrap(),
            Claim::InProgress { .. }
        ));
        mysql::drop_tables(store.pool(), &[&table]).await;
    });
}

/// Ids are bytes, compared byte for byte: no collation folds case, accents or
/// trailing spaces, and NUL and invalid UTF-8 are kept.
#[test]
fn binary_and_unicode_ids_are_distinct_keys() {
    block_on(async {
        let Some((store, table)) = own_store("idempotent_bytes").await else { return };
        let ids: Vec<Vec<u8>> = vec![
            b"a".to_vec(),
            b"A".to_vec(),
            b"a ".to_vec(),
            b"a\0".to_vec(),
            b"\0".to_vec(),
            vec![0xff, 0xfe, 0x00, 0x80],
            "é".as_bytes().to_vec(),
            "e\u{301}".as_bytes().to_vec(),
            "ß".as_bytes().to_vec(),
            "ss".as_bytes().to_vec(),
            "🦀".as_bytes().to_vec(),
            b"'; DROP TABLE x; --".to_vec(),
        ];
        let keys: Vec<Key> = ids.iter().map(|id| Key::new("bytes", id).unwrap()).collect();
        for key in &keys {
            let token = won(&store, key).await;
            assert_eq!(
                store.complete(key, token, TTL, Some(key.id())).await.unwrap(),
                Transition::Applied
            );
        }
        for key in &keys {
            let claim = store.claim(key, LEASE, TTL, None).await.unwrap();
            assert_eq!(claim, Claim::Cached(key.id().to_vec()), "{key}");
        }
        mysql::drop_tables(store.pool(), &[&table]).await;
    });
}

/// An id too long for the primary key, which a producer can send on purpose, is
/// stored under its hash and deduplicated like any other.
#[test]
fn ids_too_long_for_the_primary_key_are_stored_hashed() {
    block_on(async {
        let Some((store, table)) = own_store("idempotent_long").await else { return };
        let noise: Vec<u8> =
            (0..10_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
        let key = Key::new("long", &noise).unwrap();
        let token = won(&store, &key).await;
        assert_eq!(store.complete(&key, token, TTL, None).await.unwrap(), Transition::Applied);
        assert_eq!(store.claim(&key, LEASE, TTL, None).await.unwrap(), Claim::Done);
        let mut sibling = noise.clone();
        sibling.push(b'!');
        won(&store, &Key::new("long", &sibling).unwrap()).await;
        // The longest id kept as it is.
        let edge = Key::new("long", vec![0xee; idempotent::MAX_STORED_ID_LEN]).unwrap();
        let token = won(&store, &edge).await;
        assert_eq!(store.complete(&edge, token, TTL, None).await.unwrap(), Transition::Applied);
        assert_eq!(store.claim(&edge, LEASE, TTL, None).await.unwrap(), Claim::Done);
        mysql::drop_tables(store.pool(), &[&table]).await;
    });
}
