//! TLS to stores, against servers of the test's own that speak only TLS with a
//! certificate from a CA made for the run: `RedisStore` over `rediss://` trusting that
//! CA (and refusing a server it did not sign), `PostgresStore` over a pool with
//! `sslmode=verify-full` (a plain connection is refused by the server). And no
//! password or URL in any error (`Display`, `Debug`, sources) or log line when
//! connecting to Redis, PostgreSQL, MySQL or ZooKeeper fails.

#[path = "support/log_capture.rs"]
mod log_capture;
#[path = "support/mysql.rs"]
mod mysql;
#[path = "support/tls_servers.rs"]
mod tls_servers;

use std::time::{Duration, Instant};

use idempotent::testing::{self, block_on};
use idempotent::{
    Claim, MysqlStore, PostgresStore, RedisStore, Store, StoreError, Transition, ZooKeeperStore,
};
use log_capture::log;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use tls_servers::{Pki, TlsPostgres, TlsRedis, free_port, secret};

/// Every store call a connection failure must answer within.
const BOUND: Duration = Duration::from_secs(30);

fn trusting(ca_pem: &str) -> redis::TlsCertificates {
    redis::TlsCertificates { client_tls: None, root_cert: Some(ca_pem.as_bytes().to_vec()) }
}

/// Claim, complete, and a second claim that finds the key DONE.
async fn claim_complete_duplicate(store: &impl Store) {
    let key = testing::fresh_key("tls");
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
    let Claim::Won { token, attempt: 1, .. } = store.claim(&key, lease, ttl, None).await.unwrap()
    else {
        panic!("a fresh key is won")
    };
    assert_eq!(store.complete(&key, token, ttl, None).await.unwrap(), Transition::Applied);
    assert!(matches!(store.claim(&key, lease, ttl, None).await.unwrap(), Claim::Done));
}

#[test]
fn redis_over_tls_trusts_a_private_ca_and_verifies_the_server() {
    let pki = Pki::new();
    let Some(server) = TlsRedis::start(&pki) else { return };
    block_on(async {
        for host in ["127.0.0.1", "localhost"] {
            let store = RedisStore::connect_with_tls(server.url(host), trusting(&pki.ca_pem))
                .await
                .unwrap_or_else(|e| panic!("TLS to {host} with the test's CA: {e}"));
            claim_complete_duplicate(&store).await;
            testing::first_delivery_success(&store).await;
            testing::duplicate_within_ttl(&store).await;
        }
    });
}

#[test]
fn redis_refuses_a_server_certificate_from_an_unknown_ca() {
    let pki = Pki::new();
    let Some(server) = TlsRedis::start(&pki) else { return };
    let stranger = Pki::new();
    block_on(async {
        let started = Instant::now();
        let refused = tokio::time::timeout(
            BOUND,
            RedisStore::connect_with_tls(server.url("127.0.0.1"), trusting(&stranger.ca_pem)),
        )
        .await
        .expect("a refused certificate fails the connection, it does not hang");
        let error = refused.expect_err("a certificate from another CA is refused");
        assert!(matches!(error, StoreError::Unavailable(_)), "{error:?}");
        assert!(error.to_string().contains("certificate"), "says why: {error}");
        // The platform's roots do not hold the test's CA either.
        let refused = tokio::time::timeout(BOUND, RedisStore::connect(server.url("127.0.0.1")))
            .await
            .expect("does not hang");
        let error = refused.expect_err("the platform's roots do not trust the test's CA");
        assert!(error.to_string().contains("certificate"), "says why: {error}");
        eprintln!("both refused in {:?}: {error}", started.elapsed());
    });
}

/// A pool for `app` on `server` with `sslmode` and, when given, a root certificate.
async fn postgres_pool(
    server: &TlsPostgres,
    password: &str,
    mode: PgSslMode,
    ca_pem: Option<&str>,
) -> Result<sqlx::PgPool, sqlx::Error> {
    let mut options = PgConnectOptions::new()
        .host("localhost")
        .port(server.port)
        .username(TlsPostgres::USER)
        .password(password)
        .database(TlsPostgres::USER)
        .ssl_mode(mode);
    if let Some(ca) = ca_pem {
        options = options.ssl_root_cert_from_pem(ca.as_bytes().to_vec());
    }
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
}

#[test]
fn postgres_over_tls_with_verify_full() {
    let pki = Pki::new();
    block_on(async {
        let Some(server) = TlsPostgres::start(&pki).await else { return };
        let pool =
            postgres_pool(&server, &server.password, PgSslMode::VerifyFull, Some(&pki.ca_pem))
                .await
                .expect("verify-full with the test's CA");
        let (ssl,): (bool,) =
            sqlx::query_as("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert!(ssl, "the connection is encrypted");
        let store = PostgresStore::from_pool(pool);
        store.migrate().await.unwrap();
        claim_complete_duplicate(&store).await;
        testing::first_delivery_success(&store).await;
        testing::duplicate_within_ttl(&store).await;

        // `connect(url)` does TLS too, with the CA's file in the URL.
        let url = format!(
            "postgres://app:{}@127.0.0.1:{}/app?sslmode=verify-full&sslrootcert={}",
            server.password,
            server.port,
            server.ca_file().display()
        );
        let store = PostgresStore::connect(&url).await.expect("connect(url) over TLS");
        claim_complete_duplicate(&store).await;

        // A plain connection finds no `host` line in pg_hba.conf.
        let plain = postgres_pool(&server, &server.password, PgSslMode::Disable, None).await;
        let error = plain.expect_err("the server refuses a connection without TLS");
        assert!(error.to_string().contains("no encryption"), "refused for want of TLS: {error}");
        // verify-full with another CA refuses the server.
        let stranger = Pki::new();
        let other =
            postgres_pool(&server, &server.password, PgSslMode::VerifyFull, Some(&stranger.ca_pem))
                .await;
        let error = other.expect_err("a server certificate from another CA is refused");
        assert!(error.to_string().to_lowercase().contains("certificate"), "says why: {error}");
    });
}

// Secrets. Every test connects with a password of its own and asserts that neither it
// nor the URL it is part of occurs in the error or in anything logged (at TRACE, by
// every crate) while the process ran.

/// Asserts that `attempt` failed within [`BOUND`], and that none of `secrets` (the
/// password, the URL) is in its error, the error's sources, or the log.
async fn assert_no_secret<T>(
    what: &str,
    secrets: &[&str],
    attempt: impl std::future::Future<Output = Result<T, StoreError>>,
) -> StoreError {
    let log = log();
    tracing::info!("connecting: {what}");
    let error = match tokio::time::timeout(BOUND, attempt).await {
        Err(_) => panic!("{what}: no answer within {BOUND:?}"),
        Ok(Ok(_)) => panic!("{what}: connected"),
        Ok(Err(error)) => error,
    };
    let mut texts = vec![error.to_string(), format!("{error:?}")];
    let mut source = std::error::Error::source(&error);
    while let Some(e) = source {
        texts.push(e.to_string());
        texts.push(format!("{e:?}"));
        source = e.source();
    }
    let logged = String::from_utf8_lossy(&log.lock().unwrap()).into_owned();
    assert!(logged.contains(&format!("connecting: {what}")), "the log is captured");
    for secret in secrets {
        for text in &texts {
            assert!(!text.contains(secret), "{what}: {secret} is in the error: {text}");
        }
        for line in logged.lines() {
            assert!(!line.contains(secret), "{what}: {secret} is logged: {line}");
        }
    }
    eprintln!("{what}: {error}");
    error
}

#[test]
fn redis_errors_and_logs_hold_no_password() {
    let pki = Pki::new();
    let Some(server) = TlsRedis::start(&pki) else { return };
    block_on(async {
        let password = secret();
        let url = format!("redis://:{password}@127.0.0.1:{}", free_port());
        assert_no_secret(
            "Redis, unreachable",
            &[&password, &url],
            RedisStore::connect(url.as_str()),
        )
        .await;

        let password = secret();
        let url = format!("rediss://:{password}@127.0.0.1:{}", server.port);
        let error = assert_no_secret(
            "Redis over TLS, wrong password",
            &[&password, &url],
            RedisStore::connect_with_tls(url.as_str(), trusting(&pki.ca_pem)),
        )
        .await;
        assert!(error.to_string().contains("authentication failed"), "says why: {error}");

        let password = secret();
        let url = format!("rediss://default:{password}@localhost:{}", server.port);
        assert_no_secret(
            "Redis over TLS, user and wrong password",
            &[&password, &url],
            RedisStore::connect_with_tls(url.as_str(), trusting(&pki.ca_pem)),
        )
        .await;
    });
}

#[test]
fn postgres_errors_and_logs_hold_no_password() {
    let pki = Pki::new();
    block_on(async {
        let Some(server) = TlsPostgres::start(&pki).await else { return };
        let password = secret();
        let url = format!(
            "postgres://app:{password}@127.0.0.1:{}/app?sslmode=verify-full&sslrootcert={}",
            server.port,
            server.ca_file().display()
        );
        let error = assert_no_secret(
            "PostgreSQL, wrong password",
            &[&password, &url],
            PostgresStore::connect(&url),
        )
        .await;
        assert!(error.to_string().contains("password authentication failed"), "says why: {error}");

        let password = secret();
        let url = format!("postgres://app:{password}@127.0.0.1:{}/app", free_port());
        assert_no_secret(
            "PostgreSQL, unreachable",
            &[&password, &url],
            PostgresStore::connect(&url),
        )
        .await;
    });
}

#[test]
fn mysql_errors_and_logs_hold_no_password() {
    block_on(async {
        // The machine's server, reached with its own URL, tells whether there is one.
        let Some(_) = mysql::pool(1).await else { return };
        let base = mysql::url();
        let address = base
            .split_once('@')
            .and_then(|(_, rest)| rest.split('/').next())
            .unwrap_or("127.0.0.1:3306")
            .to_owned();

        let password = secret();
        let url = format!("mysql://root:{password}@{address}/test");
        let error = assert_no_secret(
            "MySQL, wrong password",
            &[&password, &url],
            MysqlStore::connect(&url),
        )
        .await;
        assert!(error.to_string().contains("Access denied"), "says why: {error}");

        let password = secret();
        let user = format!("idempotent_nobody_{}", tls_servers::random_hex());
        let url = format!("mysql://{user}:{password}@{address}/test");
        assert_no_secret("MySQL, no such user", &[&password, &url], MysqlStore::connect(&url))
            .await;

        let password = secret();
        let url = format!("mysql://root:{password}@127.0.0.1:{}/test", free_port());
        assert_no_secret("MySQL, unreachable", &[&password, &url], MysqlStore::connect(&url)).await;
    });
}

#[test]
fn zookeeper_errors_and_logs_hold_no_password() {
    block_on(async {
        let port = free_port();
        let hosts = format!("127.0.0.1:{port}");
        // A connect string holds no credentials: the error names the ensemble.
        let error =
            assert_no_secret("ZooKeeper, unreachable", &[], ZooKeeperStore::connect(&hosts)).await;
        assert!(error.to_string().contains(&hosts), "names the ensemble: {error}");

        // ZooKeeper connect strings hold no credentials; one written as a URL with
        // some is refused without repeating them.
        let password = secret();
        let url = format!("zk://idempotent:{password}@127.0.0.1:{port}");
        assert_no_secret(
            "ZooKeeper, credentials in the hosts",
            &[&password, &url],
            ZooKeeperStore::connect(&url),
        )
        .await;
    });
}
