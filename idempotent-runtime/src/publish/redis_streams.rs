//! Adding entries to a Redis stream with a `message-id` field.

use redis::RedisResult;
use redis::aio::ConnectionLike;

/// The field that carries the message id.
pub const MESSAGE_ID_FIELD: &str = "message-id";

/// Where an entry was added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The entry's message id.
    pub id: String,
    /// The entry's stream id, as Redis assigned it.
    pub entry_id: String,
}

/// Adds an entry to `stream` (`XADD stream * ...`) with `fields` and the field
/// `message-id`: `id`, or a fresh [`message_id`](super::message_id).
///
/// Redis keeps no record of message ids: an `XADD` sent again after its reply was
/// lost adds a second entry. Send it again with the same id and key the consumer's
/// handler on `{message_id}`: the second entry is then a duplicate.
///
/// ```no_run
/// # async fn demo(mut conn: redis::aio::ConnectionManager) -> redis::RedisResult<()> {
/// use idempotent_runtime::publish::redis_streams::publish;
///
/// let added = publish(&mut conn, "orders", &[("payload", br#"{"order_id":42}"#)], None).await?;
/// assert_ne!(added.id, added.entry_id, "the message id is ours, the entry id Redis's");
/// # Ok(()) }
/// ```
pub async fn publish<C: ConnectionLike>(
    conn: &mut C,
    stream: &str,
    fields: &[(&str, &[u8])],
    id: Option<&str>,
) -> RedisResult<Published> {
    let id = id.map_or_else(super::message_id, str::to_owned);
    let mut add = redis::cmd("XADD");
    add.arg(stream).arg("*");
    for (name, value) in fields {
        add.arg(*name).arg(*value);
    }
    add.arg(MESSAGE_ID_FIELD).arg(&id);
    let entry_id: String = add.query_async(conn).await?;
    Ok(Published { id, entry_id })
}
