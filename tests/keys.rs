//! Distinct messages never share a key: a producer who controls a field can't make
//! its message look like a duplicate of someone else's, whatever the field holds.
//! One handler per placeholder kind: typed fields, another argument, a `self` field,
//! JSON pointers, and `key_fn`.

use std::future::Future;
use std::sync::LazyLock;

use idempotent::serde_json::json;
use idempotent::{Key, MemoryStore, Outcome, Store, idempotent};

static STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);

struct Transfer {
    from: String,
    to: String,
}

fn transfer(from: &str, to: &str) -> Transfer {
    Transfer { from: from.to_owned(), to: to.to_owned() }
}

#[idempotent(key = "{from}:{to}", store = STORE, namespace = "typed")]
async fn typed(msg: Transfer) {
    let _ = msg;
}

#[idempotent(key = "{tenant}:{msg.to}", store = STORE, namespace = "argument")]
async fn argument(msg: Transfer, tenant: &str) {
    let _ = (msg, tenant);
}

struct Ledger {
    region: String,
}

impl Ledger {
    #[idempotent(key = "{self.region}/{from}", store = STORE, namespace = "receiver")]
    async fn post(&self, msg: Transfer) {
        let _ = msg;
    }
}

#[idempotent(key = "{/from}:{/to}", store = STORE, namespace = "pointer")]
async fn pointer(msg: idempotent::serde_json::Value) {
    let _ = msg;
}

/// `key_fn` output is the id as it is: a function that joins fields must keep them
/// apart itself, which `format!("{:?}")` of a tuple does.
fn joined(msg: &Transfer) -> String {
    format!("{:?}", (&msg.from, &msg.to))
}

#[idempotent(key_fn = joined, store = STORE, namespace = "key_fn")]
async fn by_key_fn(msg: Transfer) {
    let _ = msg;
}

/// Transfers that a naive `"{from}:{to}"` renders alike (in pairs), and the separator
/// and escape characters a hostile producer would try. All distinct.
const HOSTILE: [(&str, &str); 12] = [
    ("a:b", "c"),
    ("a", "b:c"),
    ("a%3Ab", "c"),
    ("a%3A", "b:c"),
    ("a%", "b"),
    ("a%25", "b"),
    ("a/b", "c"),
    ("a", "b/c"),
    ("x:", "y"),
    ("x", ":y"),
    ("é:\n", "}{"),
    ("é", ":\n:}{"),
];

/// Every hostile transfer runs once: none is taken for a duplicate of another.
async fn each_runs_once<F, Fut>(call: F)
where
    F: Fn(&'static str, &'static str) -> Fut,
    Fut: Future<Output = Outcome<()>>,
{
    for (from, to) in HOSTILE {
        assert!(call(from, to).await.is_processed(), "({from:?}, {to:?}) was not processed");
    }
    for (from, to) in HOSTILE {
        assert_eq!(call(from, to).await, Outcome::Duplicate, "({from:?}, {to:?})");
    }
}

#[tokio::test]
async fn typed_fields_never_collide() {
    each_runs_once(|from, to| async move { typed(transfer(from, to)).await.unwrap() }).await;
}

#[tokio::test]
async fn arguments_never_collide() {
    each_runs_once(|from, to| async move { argument(transfer("-", to), from).await.unwrap() })
        .await;
}

#[tokio::test]
async fn receiver_fields_never_collide() {
    each_runs_once(|from, to| async move {
        Ledger { region: from.to_owned() }.post(transfer(to, "-")).await.unwrap()
    })
    .await;
}

#[tokio::test]
async fn json_pointers_never_collide() {
    each_runs_once(
        |from, to| async move { pointer(json!({"from": from, "to": to})).await.unwrap() },
    )
    .await;
    // Numbers are values too: 1.5 and "1.5" are one key, as before.
    assert!(pointer(json!({"from": 1.5, "to": 2})).await.unwrap().is_processed());
    assert_eq!(pointer(json!({"from": "1.5", "to": "2"})).await.unwrap(), Outcome::Duplicate);
}

#[tokio::test]
async fn key_fn_output_is_used_as_it_is() {
    each_runs_once(|from, to| async move { by_key_fn(transfer(from, to)).await.unwrap() }).await;
}

/// Plain values are written as they are, so records written before the encoding
/// existed still match; only a value holding `%` or its separator is encoded.
#[tokio::test]
async fn plain_values_keep_their_keys() {
    assert!(typed(transfer("acct-1", "acct-2")).await.unwrap().is_processed());
    assert!(typed(transfer("50%:off", "x:y")).await.unwrap().is_processed());
    let done = |id: &str| {
        let key = Key::new("typed", id).unwrap();
        async move { STORE.claim(&key, LEASE, LEASE, None).await.unwrap() }
    };
    assert_eq!(done("acct-1:acct-2").await, idempotent::Claim::Done);
    assert_eq!(done("50%25%3Aoff:x:y").await, idempotent::Claim::Done);
}

const LEASE: std::time::Duration = std::time::Duration::from_secs(30);
