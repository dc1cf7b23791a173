//! From a store URL to a connected store.

use std::time::Duration;

use idempotent_runtime::store::admin::Admin;
use idempotent_runtime::{PostgresStore, RedisStore};

use crate::{Exit, Failure};

/// The URL schemes, for error messages.
const SCHEMES: &str = "redis://, rediss://, redis+cluster://, rediss+cluster://, postgres://, \
    postgresql://, mysql://, mariadb://, zk://";

/// How long reaching the store may take before the command gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to the store at `url`, with records at `at` (a prefix, table or root)
/// when given there or as the URL's `at` parameter.
pub async fn connect(url: &str, at: Option<&str>) -> Result<Box<dyn Admin>, Failure> {
    let (url, at_param) = split_at_param(url);
    let at = at.map(str::to_owned).or(at_param);
    let shown = redacted(&url);
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(usage(format!("`{shown}` is not a store URL; one of {SCHEMES}")));
    };
    let connecting = async {
        let store: Box<dyn Admin> = match scheme {
            "redis" | "rediss" => {
                let store = RedisStore::connect(url.as_str()).await?;
                Box::new(match &at {
                    Some(prefix) => store.with_prefix(prefix.as_str()),
                    None => store,
                })
            }
            "redis+cluster" | "rediss+cluster" => {
                let plain = scheme.trim_end_matches("+cluster");
                let (hosts, tail) = rest.split_once('/').unwrap_or((rest, ""));
                let nodes: Vec<String> =
                    (hosts.split(',')).map(|host| format!("{plain}://{host}/{tail}")).collect();
                let store = RedisStore::cluster(nodes).await?;
                Box::new(match &at {
                    Some(prefix) => store.with_prefix(prefix.as_str()),
                    None => store,
                })
            }
            "postgres" | "postgresql" => {
                let store = PostgresStore::connect(&url).await?;
                Box::new(match &at {
                    Some(table) => store.with_table(table)?,
                    None => store,
                })
            }
            "mysql" | "mariadb" | "zk" | "zookeeper" => return Ok(Err(scheme)),
            _ => return Ok(Err("")),
        };
        Ok::<_, idempotent_runtime::StoreError>(Ok(store))
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
        Ok(Ok(Ok(store))) => Ok(store),
        Ok(Ok(Err(""))) => {
            Err(usage(format!("`{scheme}://` is not a store this tool knows; one of {SCHEMES}")))
        }
        Ok(Ok(Err(scheme))) => Err(usage(format!(
            "`{scheme}://` stores cannot be inspected by this version yet (Redis, Redis Cluster \
             and PostgreSQL can)"
        ))),
        Ok(Err(error)) => {
            Err(Failure(Exit::Store, format!("cannot use the store at {shown}: {error}")))
        }
        Err(_) => Err(Failure(
            Exit::Store,
            format!("the store at {shown} did not answer within {CONNECT_TIMEOUT:?}"),
        )),
    }
}

fn usage(message: String) -> Failure {
    Failure(Exit::Usage, message)
}

/// The URL without its `at` query parameter, and that parameter's value.
fn split_at_param(url: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else { return (url.to_owned(), None) };
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
/// must not carry it.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some((userinfo, host)) = authority.rsplit_once('@') else { return url.to_owned() };
    match userinfo.split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***@{host}{tail}"),
        None => url.to_owned(),
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
    }
}
