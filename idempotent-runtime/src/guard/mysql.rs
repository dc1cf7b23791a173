//! The guards' SQL on MySQL and MariaDB.

use sqlx::mysql::MySqlArguments;
use sqlx::{Arguments, AssertSqlSafe, Decode, MySql, MySqlConnection, SqlSafeStr, SqlStr};

use super::{
    GuardDatabase, Ident, StateChange, StateGuard, Value, VersionChange, VersionGuard, not_unique,
    not_updated, quoted, quoted_table, updated,
};

/// The answers the state update hands back through `LAST_INSERT_ID(expr)`, which the
/// server returns with the statement's result: no second statement to read them.
const APPLIED: u64 = 1;
const ALREADY_APPLIED: u64 = 2;
const CONFLICT: u64 = 3;

impl GuardDatabase for MySql {
    async fn change_state<'a, S, K>(
        conn: &'a mut MySqlConnection,
        guard: &'a StateGuard<S>,
        key: &'a K,
    ) -> Result<StateChange<S>, sqlx::Error>
    where
        S: Value<Self> + for<'r> Decode<'r, Self> + PartialEq + Unpin,
        K: Value<Self>,
    {
        let sql = guard.sql.mysql.get_or_init(|| state_sql(guard));
        let mut query = sqlx::query(sql.clone());
        for state in &guard.from {
            query = query.bind(state);
        }
        let done = query.bind(&guard.to).bind(&guard.to).bind(key).execute(&mut *conn).await?;
        // sqlx asks for found rows: the row counts as affected even when its
        // state is left as it was.
        match (done.rows_affected(), done.last_insert_id()) {
            (0, _) => Ok(StateChange::NotFound),
            (1, APPLIED) => Ok(StateChange::Applied),
            (1, ALREADY_APPLIED) => Ok(StateChange::AlreadyApplied),
            (1, CONFLICT) => {
                // The update locked the row, so inside a transaction this read
                // sees the state it found; on its own, the state now.
                let table = quoted_table(&guard.table, '`');
                let (k, c) = (quoted(&guard.table.key, '`'), quoted(&guard.column, '`'));
                let read = format!("SELECT {c} FROM {table} WHERE {k} = ? LOCK IN SHARE MODE");
                let state: Option<Option<S>> = sqlx::query_scalar(AssertSqlSafe(read))
                    .bind(key)
                    .fetch_optional(&mut *conn)
                    .await?;
                match state {
                    None => Ok(StateChange::NotFound),
                    Some(None) => Err(super::null_state(&guard.column)),
                    Some(Some(state)) if state == guard.to => Ok(StateChange::AlreadyApplied),
                    Some(Some(state)) => Ok(StateChange::Conflict(state)),
                }
            }
            (1, other) => Err(sqlx::Error::Protocol(format!(
                "the state update answered {other}, not one of 1, 2 or 3"
            ))),
            (n, _) => Err(not_unique(&guard.table, n)),
        }
    }

    async fn update_versioned<'a, K>(
        conn: &'a mut MySqlConnection,
        guard: &'a VersionGuard,
        columns: &'a [Ident],
        mut args: MySqlArguments,
        key: &'a K,
        version: i64,
    ) -> Result<VersionChange, sqlx::Error>
    where
        K: Value<Self>,
    {
        args.add(key).map_err(sqlx::Error::Encode)?;
        args.add(version).map_err(sqlx::Error::Encode)?;
        let table = quoted_table(&guard.table, '`');
        let (k, v) = (quoted(&guard.table.key, '`'), quoted(&guard.version, '`'));
        let mut sets = String::new();
        for column in columns {
            sets += &format!("{} = ?, ", quoted(column, '`'));
        }
        let update = format!("UPDATE {table} SET {sets}{v} = {v} + 1 WHERE {k} = ? AND {v} = ?");
        let done = sqlx::query_with(AssertSqlSafe(update), args).execute(&mut *conn).await?;
        if let Some(change) = updated(&guard.table, done.rows_affected())? {
            return Ok(change);
        }
        // A locking read: a plain one inside a REPEATABLE READ transaction would
        // answer from the transaction's snapshot, possibly the very version that
        // just failed to match.
        let read =
            format!("SELECT CAST({v} AS SIGNED) FROM {table} WHERE {k} = ? LOCK IN SHARE MODE");
        let versions: Vec<i64> =
            sqlx::query_scalar(AssertSqlSafe(read)).bind(key).fetch_all(&mut *conn).await?;
        not_updated(&guard.table, &versions)
    }
}

/// One `UPDATE` that changes the state only if it is one of `from` and hands back,
/// through `LAST_INSERT_ID(expr)`, which case it met. The assignment reads the column
/// before it is written.
fn state_sql<S>(guard: &StateGuard<S>) -> SqlStr {
    let table = quoted_table(&guard.table, '`');
    let (k, c) = (quoted(&guard.table.key, '`'), quoted(&guard.column, '`'));
    let from = vec!["?"; guard.from.len()].join(", ");
    AssertSqlSafe(format!(
        "UPDATE {table} SET {c} = IF(LAST_INSERT_ID(CASE WHEN {c} IN ({from}) THEN {APPLIED} \
         WHEN {c} = ? THEN {ALREADY_APPLIED} ELSE {CONFLICT} END) = {APPLIED}, ?, {c}) \
         WHERE {k} = ?"
    ))
    .into_sql_str()
}
