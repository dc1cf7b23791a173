//! The guards' SQL on MySQL and MariaDB.

use sqlx::mysql::MySqlArguments;
use sqlx::{Arguments, AssertSqlSafe, Decode, MySql, MySqlConnection, SqlSafeStr, SqlStr};

use super::{
    GuardDatabase, Ident, RACES, StateChange, StateGuard, Value, VersionChange, VersionGuard,
    changing_row, not_unique, not_updated, null_state, quoted, quoted_table, updated,
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
        for _ in 0..RACES {
            let mut query = sqlx::query(sql.clone()).bind(&guard.to);
            for state in &guard.from {
                query = query.bind(state);
            }
            let done = query.bind(&guard.to).bind(key).execute(&mut *conn).await?;
            // sqlx asks for found rows: the row counts as affected even when its state
            // is left as it was.
            let verdict = match (done.rows_affected(), done.last_insert_id()) {
                (0, _) => return Ok(StateChange::NotFound),
                (1, 0) => {
                    // MariaDB leaves the answer out of the reply when the table has a
                    // trigger; the session still holds it.
                    sqlx::query_scalar::<_, u64>("SELECT LAST_INSERT_ID()")
                        .fetch_one(&mut *conn)
                        .await?
                }
                (1, verdict) => verdict,
                (n, _) => return Err(not_unique(&guard.table, n)),
            };
            match verdict {
                APPLIED => return Ok(StateChange::Applied),
                ALREADY_APPLIED => return Ok(StateChange::AlreadyApplied),
                CONFLICT => {}
                other => {
                    return Err(sqlx::Error::Protocol(format!(
                        "the state update answered {other}, not one of 1, 2 or 3"
                    )));
                }
            }
            // The update locked the row, so inside a transaction this read sees the
            // state it found; on its own, the state now, which another writer may have
            // changed since: a state the change is allowed from means trying again.
            let read = read_state_sql(guard);
            let mut query =
                sqlx::query_as::<_, (Option<S>, Option<bool>, Option<bool>)>(AssertSqlSafe(read))
                    .bind(&guard.to);
            for state in &guard.from {
                query = query.bind(state);
            }
            match query.bind(key).fetch_optional(&mut *conn).await? {
                None => return Ok(StateChange::NotFound),
                Some((None, ..)) => return Err(null_state(&guard.column)),
                Some((_, Some(true), _)) => return Ok(StateChange::AlreadyApplied),
                Some((_, _, Some(true))) => continue,
                Some((Some(state), ..)) => return Ok(StateChange::Conflict(state)),
            }
        }
        Err(changing_row(&guard.column))
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

/// One `UPDATE` that changes the state only if it is one of `from` (and not already
/// `to`: the target wins when it is listed among the sources too, or equal to one in
/// the column's collation) and hands back, through `LAST_INSERT_ID(expr)`, which case
/// it met. The assignment reads the column before it is written. Binds: `to`, the
/// `from` states, `to`, the key.
///
/// Unlike PostgreSQL's, the statement does not check that the key names one row: a
/// count of the key's rows inside the `UPDATE` is a locking read under REPEATABLE
/// READ, and concurrent guards on one row deadlocked on it. A key column that is not
/// unique is reported after the update changed every matching row, which the caller's
/// transaction, rolled back on the error, undoes.
fn state_sql<S>(guard: &StateGuard<S>) -> SqlStr {
    let table = quoted_table(&guard.table, '`');
    let (k, c) = (quoted(&guard.table.key, '`'), quoted(&guard.column, '`'));
    let from = vec!["?"; guard.from.len()].join(", ");
    AssertSqlSafe(format!(
        "UPDATE {table} SET {c} = IF(LAST_INSERT_ID(CASE WHEN {c} = ? THEN {ALREADY_APPLIED} \
         WHEN {c} IN ({from}) THEN {APPLIED} ELSE {CONFLICT} END) = {APPLIED}, ?, {c}) \
         WHERE {k} = ?"
    ))
    .into_sql_str()
}

/// Reads the state with a locking read, and whether the database finds it equal to
/// `to` or to one of `from` (in the column's collation). Binds: `to`, the `from`
/// states, the key.
fn read_state_sql<S>(guard: &StateGuard<S>) -> String {
    let table = quoted_table(&guard.table, '`');
    let (k, c) = (quoted(&guard.table.key, '`'), quoted(&guard.column, '`'));
    let from = vec!["?"; guard.from.len()].join(", ");
    format!("SELECT {c}, {c} = ?, {c} IN ({from}) FROM {table} WHERE {k} = ? LOCK IN SHARE MODE")
}
