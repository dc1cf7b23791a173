//! The guards' SQL on PostgreSQL.

use sqlx::postgres::PgArguments;
use sqlx::{Arguments, AssertSqlSafe, Decode, PgConnection, Postgres, SqlSafeStr, SqlStr};

use super::{
    GuardDatabase, Ident, RACES, StateChange, StateGuard, Value, VersionChange, VersionGuard,
    changing_row, not_unique, not_updated, null_state, quoted, quoted_table, updated,
};

/// What the state statement returns for the key's row: rows the update changed,
/// whether the row (as the statement's snapshot has it) is in `to`, whether it is in
/// one of `from` (both as the database compares: collations, `CHAR` padding), and
/// the state.
type StateRow<S> = (i64, Option<bool>, Option<bool>, Option<S>);

impl GuardDatabase for Postgres {
    async fn change_state<'a, S, K>(
        conn: &'a mut PgConnection,
        guard: &'a StateGuard<S>,
        key: &'a K,
    ) -> Result<StateChange<S>, sqlx::Error>
    where
        S: Value<Self> + for<'r> Decode<'r, Self> + PartialEq + Unpin,
        K: Value<Self>,
    {
        let sql = guard.sql.postgres.get_or_init(|| state_sql(guard));
        for _ in 0..RACES {
            let mut query = sqlx::query_as::<_, StateRow<S>>(sql.clone()).bind(&guard.to).bind(key);
            for state in &guard.from {
                query = query.bind(state);
            }
            let rows = query.fetch_all(&mut *conn).await?;
            let (applied, is_to, is_from, state) = match <[StateRow<S>; 1]>::try_from(rows) {
                Ok([row]) => row,
                Err(rows) if rows.is_empty() => return Ok(StateChange::NotFound),
                Err(rows) => return Err(not_unique(&guard.table, rows.len() as u64)),
            };
            match (applied, is_to, is_from, state) {
                (1, ..) => return Ok(StateChange::Applied),
                (0, _, _, None) => return Err(null_state(&guard.column)),
                (0, Some(true), ..) => return Ok(StateChange::AlreadyApplied),
                // The statement's snapshot shows a state the update would have
                // changed, so the row changed while the update waited for its lock:
                // ask again, with a newer snapshot.
                (0, _, Some(true), _) => continue,
                (0, _, _, Some(state)) => return Ok(StateChange::Conflict(state)),
                (n, ..) => return Err(not_unique(&guard.table, n as u64)),
            }
        }
        Err(changing_row(&guard.column))
    }

    async fn update_versioned<'a, K>(
        conn: &'a mut PgConnection,
        guard: &'a VersionGuard,
        columns: &'a [Ident],
        mut args: PgArguments,
        key: &'a K,
        version: i64,
    ) -> Result<VersionChange, sqlx::Error>
    where
        K: Value<Self>,
    {
        args.add(key).map_err(sqlx::Error::Encode)?;
        args.add(version).map_err(sqlx::Error::Encode)?;
        let table = quoted_table(&guard.table, '"');
        let (k, v) = (quoted(&guard.table.key, '"'), quoted(&guard.version, '"'));
        let mut sets = String::new();
        for (i, column) in columns.iter().enumerate() {
            sets += &format!("{} = ${}, ", quoted(column, '"'), i + 1);
        }
        let (key_at, version_at) = (columns.len() + 1, columns.len() + 2);
        let update = format!(
            "UPDATE {table} SET {sets}{v} = {v} + 1 WHERE {k} = ${key_at} AND {v} = ${version_at} \
             AND (SELECT count(*) FROM {table} WHERE {k} = ${key_at}) = 1"
        );
        let done = sqlx::query_with(AssertSqlSafe(update), args).execute(&mut *conn).await?;
        if let Some(change) = updated(&guard.table, done.rows_affected())? {
            return Ok(change);
        }
        // `FOR SHARE` reads the latest version, or, under a snapshot isolation level
        // whose snapshot is older than it, fails with a serialization error (retryable)
        // rather than answer with a version older than the caller's.
        let read = format!("SELECT {v}::int8 FROM {table} WHERE {k} = $1 FOR SHARE");
        let versions: Vec<i64> =
            sqlx::query_scalar(AssertSqlSafe(read)).bind(key).fetch_all(&mut *conn).await?;
        not_updated(&guard.table, &versions)
    }
}

/// One statement that changes the state if it is one of `from` and not `to` already,
/// and only if the key names one row, and reads the row as the statement found it:
/// the `WITH` update and the outer `SELECT` share a snapshot, so the `SELECT` sees the
/// row as it was before the update. Binds: `to`, the key, the `from` states.
fn state_sql<S>(guard: &StateGuard<S>) -> SqlStr {
    let table = quoted_table(&guard.table, '"');
    let (k, c) = (quoted(&guard.table.key, '"'), quoted(&guard.column, '"'));
    let from: Vec<String> = (0..guard.from.len()).map(|i| format!("${}", i + 3)).collect();
    let from = from.join(", ");
    AssertSqlSafe(format!(
        "WITH applied AS (UPDATE {table} SET {c} = $1 WHERE {k} = $2 AND {c} IN ({from}) \
         AND {c} <> $1 AND (SELECT count(*) FROM {table} WHERE {k} = $2) = 1 RETURNING 1) \
         SELECT (SELECT count(*) FROM applied), {c} = $1, {c} IN ({from}), {c} \
         FROM {table} WHERE {k} = $2"
    ))
    .into_sql_str()
}
