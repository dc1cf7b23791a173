//! From a store URL to a connected store.

use std::time::Duration;

use idempotent_runtime::store::admin::Admin;
use idempotent_runtime::{MysqlStore, PostgresStore, RedisStore, ZooKeeperStore, zookeeper_store};

use crate::{Exit, Failure};

/// The URL schemes, for error messages.
const SCHEMES: &str = "redis://, rediss://, redis+cluster://, rediss+cluster://, \
    redis+sentinel://, rediss+sentinel://, postgres://, \
    postgresql://, mysql://, mariadb://, zk://, zookeeper://";

/// How long reaching the store may take before the command gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to the store at `url`, with records at `at` (a prefix, table or root)
/// when given there or as the URL's `at` parameter.
pub async fn connect(url: &str, at: Option<&str>) -> Result<Box<dyn Admin>, Failure> {
    let (url, at_param) = split_at_param(url);
    let at = at.map(str::to_owned).or(at_param);
    let shown = redacted(&url);
    let Some((scheme, rest)) = url.split_once("://") else {
        // Not printed: without a scheme there is no telling where a password ends.
        return Err(usage(format!("the store is not a URL; it starts with one of {SCHEMES}")));
    };
    let connecting = async {
        let store: Box<dyn Admin> = match scheme {
            "redis" | "rediss" => Box::new(redis_options(&at).connect(url.as_str()).await?),
            "redis+cluster" | "rediss+cluster" => {
                Box::new(redis_options(&at).cluster(cluster_nodes(scheme, rest)).await?)
            }
            "redis+sentinel" | "rediss+sentinel" => {
                let Some(target) = sentinel_target(scheme, rest) else {
                    return Ok(Err(scheme));
                };
                let mut options = redis_options(&at);
                if let Some((user, password)) = target.credentials {
                    options = options.master_credentials(user, password);
                }
                Box::new(options.sentinel(target.sentinels, target.master).await?)
            }
            "postgres" | "postgresql" => {
                let store = PostgresStore::connect(&url).await?;
                Box::new(match &at {
                    Some(table) => store.with_table(table)?,
                    None => store,
                })
            }
            "mysql" | "mariadb" => {
                // sqlx knows MariaDB's URLs as `mysql://`.
                let store = MysqlStore::connect(&format!("mysql://{rest}")).await?;
                Box::new(match &at {
                    Some(table) => store.with_table(table)?,
                    None => store,
                })
            }
            "zk" | "zookeeper" => {
                let Some(target) = zookeeper_target(rest, at.as_deref()) else {
                    return Ok(Err(scheme));
                };
                let mut options = ZooKeeperStore::builder(target.hosts).root(&target.root);
                if let Some((user, password)) = &target.digest {
                    options = options.digest(user, password);
                }
                Box::new(options.connect().await?)
            }
            _ => return Ok(Err("")),
        };
        Ok::<_, idempotent_runtime::StoreError>(Ok(store))
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
        Ok(Ok(Ok(store))) => Ok(store),
        Ok(Ok(Err(""))) => {
            Err(usage(format!("`{scheme}://` is not a store this tool knows; one of {SCHEMES}")))
        }
        Ok(Ok(Err(scheme))) => {
            let path = if scheme.ends_with("+sentinel") { "master-name" } else { "root" };
            Err(usage(format!(
                "`{shown}` is not a {scheme}:// URL: expected \
                 {scheme}://[user:password@]host:port,host:port/{path} (with no parameters but `at`)"
            )))
        }
        Ok(Err(error)) => {
            Err(Failure(Exit::Store, format!("cannot use the store at {shown}: {error}")))
        }
        Err(_) => Err(Failure(
            Exit::Store,
            format!("the store at {shown} did not answer within {CONNECT_TIMEOUT:?}"),
        )),
    }
}

/// The node URLs of `redis+cluster://[user:password@]host:port,host:port[/db]`: each
/// with the credentials (the client refuses nodes that differ in them).
fn cluster_nodes(scheme: &str, rest: &str) -> Vec<String> {
    let plain = scheme.trim_end_matches("+cluster");
    let (auth, hosts) = match rest.rfind('@') {
        Some(at) => rest.split_at(at + 1),
        None => ("", rest),
    };
    let (hosts, tail) = hosts.split_once('/').unwrap_or((hosts, ""));
    hosts.split(',').map(|host| format!("{plain}://{auth}{host}/{tail}")).collect()
}

/// Where a `redis+sentinel://[user:password@]host:port,host:port/master-name` URL
/// points: the Sentinels (each given the credentials, for Sentinels that ask for
/// them), the name they know the master by, and the credentials for the master
/// (percent-decoded; an empty user is `default`).
#[derive(Debug, PartialEq)]
struct SentinelTarget {
    sentinels: Vec<String>,
    master: String,
    credentials: Option<(String, String)>,
}

/// The target of a Sentinel URL's `rest` (after the scheme); `None` for a URL of
/// another shape (no master name, parameters, a path beyond the name).
fn sentinel_target(scheme: &str, rest: &str) -> Option<SentinelTarget> {
    let plain = scheme.trim_end_matches("+sentinel");
    let (auth, hosts) = match rest.rfind('@') {
        Some(at) => rest.split_at(at + 1),
        None => ("", rest),
    };
    let (hosts, master) = hosts.split_once('/')?;
    if master.is_empty() || master.contains(['/', '?']) || hosts.is_empty() {
        return None;
    }
    let credentials = match auth.strip_suffix('@') {
        None => None,
        Some(userinfo) => {
            let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
            let decode = |part: &str| {
                percent_encoding::percent_decode_str(part).decode_utf8().ok().map(String::from)
            };
            let user = decode(user)?;
            let user = if user.is_empty() { "default".to_owned() } else { user };
            Some((user, decode(password)?))
        }
    };
    let sentinels = hosts.split(',').map(|host| format!("{plain}://{auth}{host}/")).collect();
    Some(SentinelTarget { sentinels, master: master.to_owned(), credentials })
}

/// Where a `zk://[user:password@]host:port,host:port/root` URL points.
#[derive(Debug, PartialEq)]
struct ZooKeeperTarget<'a> {
    hosts: &'a str,
    root: String,
    /// The `digest` user and password, percent-decoded.
    digest: Option<(String, String)>,
}

/// The target of a ZooKeeper URL's `rest` (after the scheme), with `at` (the option
/// or the URL's `at` parameter) taking the place of the URL's path. `None` for a URL
/// of another shape.
fn zookeeper_target<'a>(rest: &'a str, at: Option<&str>) -> Option<ZooKeeperTarget<'a>> {
    // The credentials end at the last `@`: a password may hold `/` or `@`.
    let (digest, rest) = match rest.rfind('@') {
        Some(at) => {
            let (user, password) = rest[..at].split_once(':')?;
            let decode = |part: &str| {
                percent_encoding::percent_decode_str(part).decode_utf8().ok().map(String::from)
            };
            (Some((decode(user)?, decode(password)?)), &rest[at + 1..])
        }
        None => (None, rest),
    };
    if rest.contains('?') {
        return None;
    }
    let (hosts, path) = match rest.split_once('/') {
        Some((hosts, path)) => (hosts, path.trim_end_matches('/')),
        None => (rest, ""),
    };
    if hosts.is_empty() || digest.as_ref().is_some_and(|(user, _)| user.is_empty()) {
        return None;
    }
    let root = match at {
        Some(root) if root.starts_with('/') => root.to_owned(),
        Some(root) => format!("/{root}"),
        None if path.is_empty() => zookeeper_store::DEFAULT_ROOT.to_owned(),
        None => format!("/{path}"),
    };
    Some(ZooKeeperTarget { hosts, root, digest })
}

fn usage(message: String) -> Failure {
    Failure(Exit::Usage, message)
}

/// The URL without its `at` query parameter, and that parameter's value.
fn split_at_param(url: &str) -> (String, Option<String>) {
    // The query starts after the credentials: a password may hold a `?`.
    let from = url.rfind('@').unwrap_or(0);
    let Some(mark) = url[from..].find('?').map(|i| from + i) else {
        return (url.to_owned(), None);
    };
    let (base, query) = (&url[..mark], &url[mark + 1..]);
    let mut at = None;
    let rest: Vec<&str> = (query.split('&'))
        .filter(|pair| match pair.strip_prefix("at=") {
            Some(value) => {
                at = Some(value.to_owned());
                false
            }
            None => true,
        })
        .collect();
    let url = if rest.is_empty() { base.to_owned() } else { format!("{base}?{}", rest.join("&")) };
    (url, at)
}

/// The URL with its password, if any, replaced by `***`: error messages and logs
/// must not carry it. Passwords are not always percent-encoded: everything between
/// the user name and the last `@` counts as the password, whatever it holds (`/`,
/// `?`, `@`), since a host never holds an `@`.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return "(not a URL)".to_owned() };
    let Some(at) = rest.rfind('@') else { return url.to_owned() };
    let (userinfo, host) = (&rest[..at], &rest[at + 1..]);
    match userinfo.split_once(':') {
        Some((user, _password)) if !user.contains(['/', '?']) => {
            format!("{scheme}://{user}:***@{host}")
        }
        // A user name alone.
        None if !userinfo.contains(['/', '?']) => url.to_owned(),
        _ => format!("{scheme}://***@{host}"),
    }
}

/// How the command connects to Redis: records under `at` (the default prefix
/// otherwise), and a server that may evict records accepted (with the store's
/// warning): an operator inspecting or releasing records needs to reach the server
/// as it is, and the store's refusal exists for consumers.
fn redis_options(at: &Option<String>) -> idempotent_runtime::redis_store::RedisOptions {
    let options = RedisStore::options().allow_eviction();
    match at {
        Some(prefix) => options.prefix(prefix.as_str()),
        None => options,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_show() {
        assert_eq!(redacted("redis://:s3cret@host:6379/0"), "redis://:***@host:6379/0");
        assert_eq!(
            redacted("postgres://app:p%40ss@db.internal:5432/orders?sslmode=require"),
            "postgres://app:***@db.internal:5432/orders?sslmode=require"
        );
        assert_eq!(redacted("mysql://root@127.0.0.1/test"), "mysql://root@127.0.0.1/test");
        assert_eq!(redacted("zk://a:2181,b:2181/idempotent"), "zk://a:2181,b:2181/idempotent");
        // An `@` in the password: the last `@` before the host ends it.
        assert_eq!(redacted("redis://u:p@ss@host/0"), "redis://u:***@host/0");
        // A `/` or `?` in a password that was not percent-encoded.
        assert_eq!(redacted("redis://:pa/ss@127.0.0.1:1/0"), "redis://:***@127.0.0.1:1/0");
        assert_eq!(redacted("postgres://u:a?b@h/db"), "postgres://u:***@h/db");
        assert_eq!(redacted("redis://a/b@h/0"), "redis://***@h/0");
        // No scheme: nothing of it is shown.
        assert_eq!(redacted("admin:hunter2@db:6379"), "(not a URL)");
    }

    #[test]
    fn every_cluster_node_gets_the_credentials() {
        assert_eq!(
            cluster_nodes("redis+cluster", ":pw@h1:7000,h2:7001"),
            ["redis://:pw@h1:7000/", "redis://:pw@h2:7001/"]
        );
        assert_eq!(
            cluster_nodes("rediss+cluster", "u:p@h1:7000,h2:7001/0"),
            ["rediss://u:p@h1:7000/0", "rediss://u:p@h2:7001/0"]
        );
        assert_eq!(cluster_nodes("redis+cluster", "h1:7000"), ["redis://h1:7000/"]);
    }

    #[test]
    fn sentinel_urls_give_sentinels_master_and_credentials() {
        let target =
            sentinel_target("redis+sentinel", "ops:p%40ss@s1:26379,s2:26379/orders-master");
        assert_eq!(
            target,
            Some(SentinelTarget {
                sentinels: vec![
                    "redis://ops:p%40ss@s1:26379/".into(),
                    "redis://ops:p%40ss@s2:26379/".into()
                ],
                master: "orders-master".into(),
                credentials: Some(("ops".into(), "p@ss".into())),
            })
        );
        let plain = sentinel_target("rediss+sentinel", ":pw@s1:26379/m").unwrap();
        assert_eq!(plain.sentinels, ["rediss://:pw@s1:26379/"]);
        assert_eq!(plain.credentials, Some(("default".into(), "pw".into())));
        assert_eq!(sentinel_target("redis+sentinel", "s1:26379/m").unwrap().credentials, None);
        for bad in ["s1:26379", "s1:26379/", "s1:26379/m/0", "/m", "s1:26379/m?x=1"] {
            assert_eq!(sentinel_target("redis+sentinel", bad), None, "{bad}");
        }
    }

    #[test]
    fn zookeeper_urls_give_hosts_root_and_credentials() {
        let target = |hosts, root: &str| {
            Some(ZooKeeperTarget { hosts, root: root.to_owned(), digest: None })
        };
        assert_eq!(
            zookeeper_target("a:2181,b:2181/apps/idempotent", None),
            target("a:2181,b:2181", "/apps/idempotent")
        );
        assert_eq!(zookeeper_target("a:2181", None), target("a:2181", "/idempotent"));
        assert_eq!(zookeeper_target("a:2181/", None), target("a:2181", "/idempotent"));
        assert_eq!(
            zookeeper_target("a:2181/ignored", Some("/orders")),
            target("a:2181", "/orders")
        );
        assert_eq!(zookeeper_target("a:2181", Some("orders")), target("a:2181", "/orders"));
        assert_eq!(zookeeper_target("/idempotent", None), None);
        assert_eq!(zookeeper_target("a:2181/x?timeout=5", None), None);
        // Digest credentials, percent-decoded; the last `@` ends them.
        assert_eq!(
            zookeeper_target("orders:s3%2Fc@ret@zk1:2181,zk2:2181/idempotent", None),
            Some(ZooKeeperTarget {
                hosts: "zk1:2181,zk2:2181",
                root: "/idempotent".to_owned(),
                digest: Some(("orders".to_owned(), "s3/c@ret".to_owned())),
            })
        );
        // A user with no password, or no user, is not a digest identity.
        assert_eq!(zookeeper_target("admin@zkhost/idempotent", None), None);
        assert_eq!(zookeeper_target(":pw@zkhost/idempotent", None), None);
    }

    #[test]
    fn the_at_parameter_is_taken_out() {
        assert_eq!(
            split_at_param("redis://h/0?at=orders"),
            ("redis://h/0".into(), Some("orders".into()))
        );
        assert_eq!(
            split_at_param("postgres://h/db?sslmode=require&at=keys"),
            ("postgres://h/db?sslmode=require".into(), Some("keys".into()))
        );
        assert_eq!(split_at_param("zk://h:2181"), ("zk://h:2181".into(), None));
        // A `?` in a password is not the query.
        assert_eq!(
            split_at_param("mysql://app:hun?ter2@db/app?at=orders"),
            ("mysql://app:hun?ter2@db/app".into(), Some("orders".into()))
        );
        assert_eq!(split_at_param("mysql://app:hun?ter2@db/app").1, None);
    }
}
