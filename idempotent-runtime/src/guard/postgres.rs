//! The guards' SQL on PostgreSQL.

use sqlx::postgres::PgArguments;
use sqlx::{Arguments, AssertSqlSafe, Decode, PgConnection, Postgres, SqlSafeStr, SqlStr};

use super::{
    GuardDatabase, Ident, StateChange, StateGuard, Value, VersionChange, VersionGuard, not_unique,
    not_updated, null_state, quoted, quoted_table, updated,
};

/// How many times a state change is tried again when the row changed under it.
const RACES: usize = 8;

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
            let mut query =
                sqlx::query_as::<_, (i64, Option<S>)>(sql.clone()).bind(&guard.to).bind(key);
            for state in &guard.from {
                query = query.bind(state);
            }
            let rows = query.fetch_all(&mut *conn).await?;
            let (applied, current) = match rows.len() {
                0 => return Ok(StateChange::NotFound),
                1 => rows.into_iter().next().expect("one row"),
                n => return Err(not_unique(&guard.table, n as u64)),
            };
            match (applied, current) {
                (1, _) => return Ok(StateChange::Applied),
                (0, None) => return Err(null_state(&guard.column)),
                (0, Some(state)) if state == guard.to => {
                    return Ok(StateChange::AlreadyApplied);
                }
                // The statement's snapshot shows a state the update would have
                // changed, so the row changed while the update waited for its
                // lock: ask again, with a newer snapshot.
                (0, Some(state)) if guard.from.contains(&state) => continue,
                (0, Some(state)) => return Ok(StateChange::Conflict(state)),
                (n, _) => return Err(not_unique(&guard.table, n as u64)),
            }
        }
        Err(sqlx::Error::Protocol(format!(
            "the row's `{}` kept changing while it was being updated",
            guard.column
        )))
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
        let n = columns.len();
        let update = format!(
            "UPDATE {table} SET {sets}{v} = {v} + 1 WHERE {k} = ${} AND {v} = ${}",
            n + 1,
            n + 2
        );
        let done = sqlx::query_with(AssertSqlSafe(update), args).execute(&mut *conn).await?;
        if let Some(change) = updated(&guard.table, done.rows_affected())? {
            return Ok(change);
        }
        let read = format!("SELECT {v}::int8 FROM {table} WHERE {k} = $1");
        let versions: Vec<i64> =
            sqlx::query_scalar(AssertSqlSafe(read)).bind(key).fetch_all(&mut *conn).await?;
        not_updated(&guard.table, &versions)
    }
}

/// One statement that changes the state if it is one of `from` and reads the state
/// the statement found: the `WITH` update and the outer `SELECT` share a snapshot, so
/// the `SELECT` sees the row as it was before the update.
fn state_sql<S>(guard: &StateGuard<S>) -> SqlStr {
    let table = quoted_table(&guard.table, '"');
    let (k, c) = (quoted(&guard.table.key, '"'), quoted(&guard.column, '"'));
    let from: Vec<String> = (0..guard.from.len()).map(|i| format!("${}", i + 3)).collect();
    AssertSqlSafe(format!(
        "WITH applied AS (UPDATE {table} SET {c} = $1 WHERE {k} = $2 AND {c} IN ({}) RETURNING 1) \
         SELECT (SELECT count(*) FROM applied), {c} FROM {table} WHERE {k} = $2",
        from.join(", ")
    ))
    .into_sql_str()
}
