//! Guards kept by the business rows themselves, for PostgreSQL and MySQL / MariaDB
//! through sqlx: a state machine ("only an UNPAID order may be paid") and a version
//! column (optimistic locking).
//!
//! Each guard is one conditional `UPDATE`: two deliveries of the same message, on two
//! consumers, cannot both pass it, because the database serialises the two updates of
//! the row and the second finds the row changed. That makes a guard enough on its own
//! for a handler whose effect *is* that row change (with [`NoStore`](crate::NoStore)),
//! and a cheap second line behind a claim store for any other.
//!
//! * [`StateGuard`] moves a row from one of some states to a target state and answers
//!   [`StateChange`]: `Applied`, `AlreadyApplied` (the row is in the target state:
//!   this message, or its twin, got there first), `Conflict(current)`, `NotFound`.
//! * [`VersionGuard`] applies an update only if the row's version is the one read,
//!   bumping it, and answers [`VersionChange`]: `Applied`, `Stale(current)`,
//!   `NotFound`.
//!
//! Both run on anything sqlx can acquire a connection from: a pool (`&pool`, the
//! statement commits on its own), a connection, or a transaction (`&mut *tx`, the
//! change commits or rolls back with the rest of the handler's writes, as in an
//! `#[idempotent(transactional)]` handler). Table and column names are checked when
//! the guard is built (plain identifiers only, quoted in the SQL); every value is a
//! bound parameter. The key column must identify one row (a primary key or a unique
//! index): a key matching several rows is an error.
//!
//! An answer that is not `Applied` turns into an error that already carries the
//! class the handler needs ([`StateChange::into_result`], [`VersionChange::into_result`]):
//! already applied → [`ErrorClass::Duplicate`] (acked as a duplicate, no alert),
//! conflict and not found → [`ErrorClass::Terminal`], stale → [`ErrorClass::Retryable`]
//! (read again and retry).
//!
//! ```no_run
//! # async fn pay(pool: sqlx::PgPool, order_id: i64) -> Result<(), Box<dyn std::error::Error>> {
//! use idempotent_runtime::guard::{StateChange, StateGuard, Table};
//!
//! let orders = Table::new("orders", "id")?;
//! let pay: StateGuard<String> = orders.state("status", ["UNPAID"], "PAID")?;
//!
//! let mut tx = pool.begin().await?;
//! match pay.apply(&mut *tx, order_id).await? {
//!     StateChange::Applied => { /* charge the card, in the same transaction */ }
//!     StateChange::AlreadyApplied => return Ok(()), // a duplicate: already paid
//!     StateChange::Conflict(state) => return Err(format!("order is {state}").into()),
//!     StateChange::NotFound => return Err("no such order".into()),
//! }
//! tx.commit().await?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::sync::OnceLock;

use sqlx::{Acquire, Arguments, Database, Decode, Encode, SqlStr, Type};

use crate::{Classify, ErrorClass};

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;

/// How long a table or column name may be: PostgreSQL keeps 63 bytes of a name
/// (MySQL 64) and would silently cut a longer one.
pub const MAX_IDENTIFIER_LEN: usize = 63;

/// A guard that can't be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidGuard {
    /// A table or column name that is not a plain identifier.
    #[error(
        "`{0}` is not a plain SQL identifier: use ASCII letters, digits and `_`, not starting \
         with a digit, at most 63 bytes (a table may be `schema.table`)"
    )]
    Identifier(String),
    /// A state guard with no state to move from.
    #[error("a state guard needs at least one state to move from")]
    NoFromState,
}

use sealed::Ident;

impl Ident {
    fn new(name: &str) -> Result<Self, InvalidGuard> {
        let plain = name.len() <= MAX_IDENTIFIER_LEN
            && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if plain {
            Ok(Ident(name.to_owned()))
        } else {
            Err(InvalidGuard::Identifier(name.to_owned()))
        }
    }
}

/// A table and the column that identifies its rows; guards on its columns are made
/// from it.
///
/// ```
/// use idempotent_runtime::guard::Table;
///
/// let stock = Table::new("shop.stock", "sku").unwrap();
/// assert!(Table::new("stock; DROP TABLE stock", "sku").is_err());
/// assert!(stock.versioned("version").is_ok());
/// ```
#[derive(Debug, Clone)]
pub struct Table {
    /// `name` or `schema`, `name`.
    path: Vec<Ident>,
    key: Ident,
}

impl Table {
    /// The table `name` (or `schema.name`) whose rows are found by `key_column`, which
    /// must be unique (a primary key or a unique index).
    pub fn new(name: &str, key_column: &str) -> Result<Self, InvalidGuard> {
        let parts: Vec<&str> = name.split('.').collect();
        if parts.len() > 2 {
            return Err(InvalidGuard::Identifier(name.to_owned()));
        }
        let path = parts
            .into_iter()
            .map(Ident::new)
            .collect::<Result<_, _>>()
            .map_err(|_| InvalidGuard::Identifier(name.to_owned()))?;
        Ok(Table { path, key: Ident::new(key_column)? })
    }

    /// A guard that moves `column` from one of the `from` states to `to`.
    ///
    /// `S` is the column's Rust type: `String` for text columns, or your own
    /// `sqlx::Type` enum for a PostgreSQL enum type or a MySQL `ENUM`.
    pub fn state<S>(
        &self,
        column: &str,
        from: impl IntoIterator<Item = impl Into<S>>,
        to: impl Into<S>,
    ) -> Result<StateGuard<S>, InvalidGuard> {
        let from: Vec<S> = from.into_iter().map(Into::into).collect();
        if from.is_empty() {
            return Err(InvalidGuard::NoFromState);
        }
        Ok(StateGuard {
            table: self.clone(),
            column: Ident::new(column)?,
            from,
            to: to.into(),
            beyond: Vec::new(),
            sql: Statements::default(),
        })
    }

    /// A guard on the integer version column `column`.
    pub fn versioned(&self, column: &str) -> Result<VersionGuard, InvalidGuard> {
        Ok(VersionGuard { table: self.clone(), version: Ident::new(column)? })
    }
}

/// What a [`StateGuard`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateChange<S> {
    /// The row was in one of the `from` states and is now in `to`.
    Applied,
    /// The row was in `to` already: this message's effect (or a twin's) happened.
    AlreadyApplied,
    /// The row is in another state, which forbids the change.
    Conflict(S),
    /// No row has this key.
    NotFound,
}

impl<S> StateChange<S> {
    /// `Ok` when applied; otherwise the refusal as an error classified for a handler.
    pub fn into_result(self) -> Result<(), StateRefused<S>> {
        match self {
            StateChange::Applied => Ok(()),
            StateChange::AlreadyApplied => Err(StateRefused::AlreadyApplied),
            StateChange::Conflict(state) => Err(StateRefused::Conflict(state)),
            StateChange::NotFound => Err(StateRefused::NotFound),
        }
    }
}

/// A [`StateGuard`] that did not apply, as a handler error.
///
/// Classified: `AlreadyApplied` is [`ErrorClass::Duplicate`] (the message is acked as
/// a duplicate, without an alert), `Conflict` and `NotFound` are
/// [`ErrorClass::Terminal`]. Wrap it in your error enum with
/// `#[idempotent(transparent)]` to keep those classes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateRefused<S> {
    /// The row was in the target state already.
    #[error("the change was applied already")]
    AlreadyApplied,
    /// The row is in a state that forbids the change.
    #[error("the row is in state {0:?}, which forbids the change")]
    Conflict(S),
    /// No row has the key.
    #[error("no row has this key")]
    NotFound,
}

impl<S> Classify for StateRefused<S> {
    fn class(&self) -> ErrorClass {
        match self {
            StateRefused::AlreadyApplied => ErrorClass::Duplicate,
            StateRefused::Conflict(_) | StateRefused::NotFound => ErrorClass::Terminal,
        }
    }
}

/// Moves a row's state column from one of some states to a target state in one
/// conditional `UPDATE`; see the [module documentation](self).
///
/// Costs: one statement, on PostgreSQL whatever the answer; on MySQL one more on a
/// conflict (a locking read of the state). States are compared by the
/// database, in the column's collation: a row already in the target state is
/// `AlreadyApplied` even when the target is also listed among the sources. When the
/// row changed between the update and the answer (on PostgreSQL at READ COMMITTED, a
/// change committed while the update waited for its lock; on MySQL outside a
/// transaction, a change between the two statements) and it is now in one of the
/// `from` states, the guard asks again, so the answer is about the row as the update
/// found it. A key column that is not unique is an error; on PostgreSQL the update
/// then changes nothing, on MySQL it has changed the matching rows, which rolling back
/// the caller's transaction undoes (through a pool they stay changed). On MySQL the statement sets
/// `LAST_INSERT_ID()` on the connection (it carries the answer back): read your own
/// inserts' ids from their own results.
#[derive(Debug)]
pub struct StateGuard<S> {
    table: Table,
    column: Ident,
    from: Vec<S>,
    to: S,
    /// States the row reaches only after `to`.
    beyond: Vec<S>,
    sql: Statements,
}

impl<S> StateGuard<S> {
    /// The states a row reaches only after `to` (an order goes PAID, then SHIPPED,
    /// then DELIVERED): a row found in one of them has had this change, so a late
    /// duplicate (redelivered after the order shipped) is answered `AlreadyApplied`
    /// (acked, no alert) instead of `Conflict` (dead-lettered with an alert). States
    /// are compared in Rust (`PartialEq`), not in the column's collation.
    ///
    /// A state machine with a cycle (a reversal puts a PAID order back to UNPAID)
    /// lets a redelivery after the cycle pass the guard again: the row's state says
    /// nothing about which message moved it. There, record the message on the row
    /// or beside it, in the same transaction: a column holding the last message id
    /// applied, or an effect row keyed by the message id under a unique index, whose
    /// insert fails for a duplicate.
    pub fn beyond(mut self, states: impl IntoIterator<Item = impl Into<S>>) -> Self {
        self.beyond = states.into_iter().map(Into::into).collect();
        self
    }

    /// Moves the row `key` from one of the `from` states to `to`, on `conn` (a
    /// `&Pool`, a `&mut` connection, or `&mut *tx` to do it inside a transaction).
    // Not an `async fn`: a future spelled `Send + 'a` is what lets callers spawn it
    // (sqlx's documented way around "`Acquire` is not general enough").
    #[allow(clippy::manual_async_fn)]
    pub fn apply<'a, 'c, A, K>(
        &'a self,
        conn: A,
        key: K,
    ) -> impl Future<Output = Result<StateChange<S>, sqlx::Error>> + Send + 'a
    where
        A: Acquire<'c> + Send + 'a,
        A::Database: GuardDatabase,
        S: Value<A::Database> + for<'r> Decode<'r, A::Database> + PartialEq + Unpin,
        K: Value<A::Database> + 'a,
    {
        async move {
            let mut conn = conn.acquire().await?;
            let change =
                <A::Database as GuardDatabase>::change_state(&mut conn, self, &key).await?;
            Ok(match change {
                StateChange::Conflict(state) if self.beyond.contains(&state) => {
                    StateChange::AlreadyApplied
                }
                other => other,
            })
        }
    }
}

/// Applies an update only if the row's version column still holds the version read,
/// bumping it by one; see the [module documentation](self).
///
/// Costs: one statement when the update applies, two when it does not (the second
/// reads the current version with a locking read, so that a REPEATABLE READ snapshot
/// does not answer with an old one). A key column that is not unique is an error; on
/// PostgreSQL the update then changes nothing, on MySQL it has changed the matching
/// rows, which rolling back the caller's transaction undoes.
#[derive(Debug, Clone)]
pub struct VersionGuard {
    table: Table,
    version: Ident,
}

impl VersionGuard {
    /// Starts an update that sets `column` to `value` (add more with
    /// [`Update::set`]); [`Update::apply`] runs it.
    pub fn set<DB, T>(&self, column: &str, value: T) -> Update<'_, DB>
    where
        DB: GuardDatabase,
        T: Value<DB>,
    {
        Update { guard: self, columns: Vec::new(), args: Ok(DB::Arguments::default()) }
            .set(column, value)
    }
}

/// An update under a [`VersionGuard`], built column by column.
pub struct Update<'g, DB: Database> {
    guard: &'g VersionGuard,
    columns: Vec<Ident>,
    /// The first mistake (a bad column name, a value that would not encode), reported
    /// by `apply` so that the chain needs one `?`.
    args: Result<DB::Arguments, sqlx::Error>,
}

impl<DB: Database> fmt::Debug for Update<'_, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Update")
            .field("guard", self.guard)
            .field("columns", &self.columns)
            .field("error", &self.args.as_ref().err())
            .finish()
    }
}

impl<'g, DB: GuardDatabase> Update<'g, DB> {
    /// Also sets `column` to `value`. The version column itself is the guard's to bump.
    pub fn set<T: Value<DB>>(mut self, column: &str, value: T) -> Self {
        let column = Ident::new(column).map_err(|e| sqlx::Error::Configuration(e.into()));
        self.args = match (self.args, column) {
            // Compared as MySQL compares names (PostgreSQL's quoted names are
            // case-sensitive, so there this only refuses a near miss).
            (Ok(_), Ok(column)) if column.0.eq_ignore_ascii_case(&self.guard.version.0) => {
                Err(sqlx::Error::Configuration(
                    format!("`{}` is the version column, which the guard bumps", column.0).into(),
                ))
            }
            (Ok(mut args), Ok(column)) => match args.add(value) {
                Ok(()) => {
                    self.columns.push(column);
                    Ok(args)
                }
                Err(e) => Err(sqlx::Error::Encode(e)),
            },
            (Err(e), _) | (_, Err(e)) => Err(e),
        };
        self
    }

    /// Applies the update to the row `key` if its version is `version`, and bumps the
    /// version; on `conn` (a `&Pool`, a `&mut` connection or `&mut *tx`).
    #[allow(clippy::manual_async_fn)] // as `StateGuard::apply`
    pub fn apply<'c, A, K>(
        self,
        conn: A,
        key: K,
        version: i64,
    ) -> impl Future<Output = Result<VersionChange, sqlx::Error>> + Send + 'g
    where
        A: Acquire<'c, Database = DB> + Send + 'g,
        K: Value<DB> + 'g,
    {
        async move {
            let args = self.args?;
            let mut conn = conn.acquire().await?;
            DB::update_versioned(&mut conn, self.guard, &self.columns, args, &key, version).await
        }
    }
}

/// What a [`VersionGuard`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionChange {
    /// The version matched: the update applied and the version is one higher.
    Applied,
    /// Another writer got there first: the row's version is now this one.
    Stale(i64),
    /// No row has this key.
    NotFound,
}

impl VersionChange {
    /// `Ok` when applied; otherwise the refusal as an error classified for a handler.
    pub fn into_result(self) -> Result<(), VersionRefused> {
        match self {
            VersionChange::Applied => Ok(()),
            VersionChange::Stale(version) => Err(VersionRefused::Stale(version)),
            VersionChange::NotFound => Err(VersionRefused::NotFound),
        }
    }

    /// As [`into_result`](Self::into_result), for a guard whose expected version came
    /// from the message (the producer's "apply this to version 7"), not from a read:
    /// a row already past `expected` has had this message's change (or a later one),
    /// so it is [`VersionRefused::AlreadyApplied`] (acked as a duplicate) rather than
    /// `Stale`, which retrying can never get past; a row behind `expected` is `Stale`
    /// (an earlier message has not been applied yet: retry).
    pub fn into_result_for_message(self, expected: i64) -> Result<(), VersionRefused> {
        match self {
            VersionChange::Stale(version) if version > expected => {
                Err(VersionRefused::AlreadyApplied(version))
            }
            other => other.into_result(),
        }
    }
}

/// A [`VersionGuard`] that did not apply, as a handler error.
///
/// Classified: `Stale` is [`ErrorClass::Retryable`] (the next attempt reads the row
/// again), `AlreadyApplied` is [`ErrorClass::Duplicate`], `NotFound` is
/// [`ErrorClass::Terminal`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum VersionRefused {
    /// Another writer changed the row since it was read.
    #[error("the row changed since it was read (its version is now {0})")]
    Stale(i64),
    /// The row is past the version the message named: its change was applied
    /// ([`VersionChange::into_result_for_message`]).
    #[error("the row is at version {0}, past the message's: its change was applied")]
    AlreadyApplied(i64),
    /// No row has the key.
    #[error("no row has this key")]
    NotFound,
}

impl Classify for VersionRefused {
    fn class(&self) -> ErrorClass {
        match self {
            VersionRefused::Stale(_) => ErrorClass::Retryable,
            VersionRefused::AlreadyApplied(_) => ErrorClass::Duplicate,
            VersionRefused::NotFound => ErrorClass::Terminal,
        }
    }
}

/// A value a guard can bind: a key, a state, a column's new value.
pub trait Value<DB: Database>: for<'q> Encode<'q, DB> + Type<DB> + Send + Sync {}

impl<DB: Database, T> Value<DB> for T where T: for<'q> Encode<'q, DB> + Type<DB> + Send + Sync {}

/// A database the guards speak: `Postgres` (feature `postgres`) and `MySql` (feature
/// `mysql`). Sealed; its methods are the guards' own SQL.
pub trait GuardDatabase: Database + sealed::Sealed {
    #[doc(hidden)]
    fn change_state<'a, S, K>(
        conn: &'a mut Self::Connection,
        guard: &'a StateGuard<S>,
        key: &'a K,
    ) -> impl Future<Output = Result<StateChange<S>, sqlx::Error>> + Send + 'a
    where
        S: Value<Self> + for<'r> Decode<'r, Self> + PartialEq + Unpin,
        K: Value<Self>;

    #[doc(hidden)]
    fn update_versioned<'a, K>(
        conn: &'a mut Self::Connection,
        guard: &'a VersionGuard,
        columns: &'a [Ident],
        args: Self::Arguments,
        key: &'a K,
        version: i64,
    ) -> impl Future<Output = Result<VersionChange, sqlx::Error>> + Send + 'a
    where
        K: Value<Self>;
}

mod sealed {
    /// A validated identifier: written into SQL text, quoted, so it must be plain.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Ident(pub(super) String);

    pub trait Sealed {}
    #[cfg(feature = "postgres")]
    impl Sealed for sqlx::Postgres {}
    #[cfg(feature = "mysql")]
    impl Sealed for sqlx::MySql {}
}

/// A state guard's SQL, built on first use for each database.
#[derive(Debug, Default)]
struct Statements {
    #[cfg(feature = "postgres")]
    postgres: OnceLock<SqlStr>,
    #[cfg(feature = "mysql")]
    mysql: OnceLock<SqlStr>,
}

/// The error for a key column that matched `n` rows.
fn not_unique(table: &Table, n: u64) -> sqlx::Error {
    let name: Vec<&str> = table.path.iter().map(|i| i.0.as_str()).collect();
    sqlx::Error::Configuration(
        format!(
            "the key `{}` matched {n} rows of `{}`: a guard's key column must be unique",
            table.key.0,
            name.join(".")
        )
        .into(),
    )
}

/// A versioned update's answer from the rows it changed: `None` when it changed none,
/// and the current version must be read.
fn updated(table: &Table, rows: u64) -> Result<Option<VersionChange>, sqlx::Error> {
    match rows {
        0 => Ok(None),
        1 => Ok(Some(VersionChange::Applied)),
        n => Err(not_unique(table, n)),
    }
}

/// A versioned update's answer from the versions read for its key, when it changed
/// nothing.
fn not_updated(table: &Table, versions: &[i64]) -> Result<VersionChange, sqlx::Error> {
    match versions {
        [] => Ok(VersionChange::NotFound),
        [version] => Ok(VersionChange::Stale(*version)),
        _ => Err(not_unique(table, versions.len() as u64)),
    }
}

/// How many times a state change is tried again when the row changed under it.
const RACES: usize = 8;

/// The error for a row whose state kept changing between a guard's statements.
fn changing_row(column: &Ident) -> sqlx::Error {
    sqlx::Error::Protocol(format!("the row's `{column}` kept changing while it was being updated"))
}

/// The error for a state column holding NULL, which no guard's `from` can match.
fn null_state(column: &Ident) -> sqlx::Error {
    sqlx::Error::Decode(format!("the row's `{column}` is NULL, which no state guard allows").into())
}

/// `table`'s name and the identifiers, quoted with `quote` (`"` or `` ` ``).
fn quoted(ident: &Ident, quote: char) -> String {
    format!("{quote}{}{quote}", ident.0)
}

fn quoted_table(table: &Table, quote: char) -> String {
    table.path.iter().map(|i| quoted(i, quote)).collect::<Vec<_>>().join(".")
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
